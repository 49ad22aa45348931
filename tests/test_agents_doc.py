"""docs/agents.md's example workflow and agent, run as written on the tiny model through a real built-in
server; the agent is the CPU toy's (areal_hpc/agent/toy_agent.py), word for word."""

from __future__ import annotations

import re
import types
from pathlib import Path

from areal_hpc.agent import Toolbox, load_tools, toy_agent
from areal_hpc.agent.tools import CALCULATOR
from areal_hpc.config import load_config
from areal_hpc.data import PromptSample
from areal_hpc.gen.agents import function_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episode import Services
from areal_hpc.gen.episodes import run_group
from tests.helpers import REPO_ROOT


def doc_code(name: str) -> str:
    """The Python block of docs/agents.md that defines ``name``."""
    text = (REPO_ROOT / "docs" / "agents.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if f"def {name}(" in c]
    return code


def doc_example(name: str) -> types.ModuleType:
    """The Python block of docs/agents.md that defines ``name``, as a module."""
    module = types.ModuleType("agents_doc_example")
    exec(compile(doc_code(name), "docs/agents.md", "exec"), module.__dict__)
    return module


def test_the_documented_workflow_runs_episodes_and_scores_them(builtin_client, tiny_tokenizer):
    workflow = doc_example("answer_after_one_tool_call").answer_after_one_tool_call
    cfg = load_config([REPO_ROOT / "configs/toy-cpu.yaml", REPO_ROOT / "configs/toy-tools.yaml"])
    services = Services(
        tiny_tokenizer, cfg.rollout, lambda text, record, ids: 1.0, Toolbox(load_tools(["calculator"]))
    )
    record = PromptSample("q", "What is 47 * 38? Use the calculator.", (1,), "math", ("\\boxed{1786}",))
    params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 3}
    result = run_group(services, workflow, builtin_client, record, params, group_size=4, timeout=60)
    assert result.rewards == [1.0] * 4 and all(len(samples) == 1 for samples in result.samples)
    assert result.counts["turns"] >= 4


def test_the_documented_agent_is_trained_through_the_endpoint(builtin_client, tiny_tokenizer):
    solve = doc_example("solve").solve
    cfg = load_config([REPO_ROOT / "configs/toy-cpu.yaml"])
    services = Services(tiny_tokenizer, cfg.rollout, lambda text, record, ids: 0.0)
    record = PromptSample("q", "What is 47 * 38? Use the calculator.", (1,), "math", ("\\boxed{1786}",))
    endpoint = Endpoint(cfg.rollout.agent_model)
    try:
        params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 3}
        result = run_group(services, function_agent(solve, endpoint), builtin_client, record, params, 4, 60)
    finally:
        endpoint.shutdown()
    assert set(result.rewards) <= {0.0, 1.0} and result.counts["turns"] >= 4 and result.counts["breaks"] == 0


def test_the_documented_agent_is_the_toys_and_offers_the_built_in_calculator():
    module = Path(toy_agent.__file__).read_text()
    assert module.endswith('"""\n\n' + doc_code("solve"))  # its docstring, then the block word for word
    assert CALCULATOR.schema() == toy_agent.CALCULATOR  # the tool set of the tiny model's warm-up
