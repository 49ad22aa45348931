"""docs/agents.md's example workflow, run as written on the tiny model through a real built-in server."""

from __future__ import annotations

import re
import threading
import types

from areal_hpc.agent import Toolbox, load_tools
from areal_hpc.config import load_config
from areal_hpc.data import PromptSample
from areal_hpc.gen.backends.builtin.engine import Engine
from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer
from areal_hpc.gen.client import GenClient
from areal_hpc.gen.episode import Services
from areal_hpc.gen.episodes import run_group
from tests.helpers import REPO_ROOT


def doc_example() -> types.ModuleType:
    """The first Python block of docs/agents.md, as a module."""
    text = (REPO_ROOT / "docs" / "agents.md").read_text()
    (code, *_) = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    module = types.ModuleType("agents_doc_example")
    exec(compile(code, "docs/agents.md", "exec"), module.__dict__)
    return module


def test_the_documented_workflow_runs_episodes_and_scores_them(tiny_model_dir, tiny_tokenizer):
    workflow = doc_example().answer_after_one_tool_call
    cfg = load_config([REPO_ROOT / "configs/toy-cpu.yaml", REPO_ROOT / "configs/toy-tools.yaml"])
    services = Services(
        tiny_tokenizer, cfg.rollout, lambda text, record, ids: 1.0, Toolbox(load_tools(["calculator"]))
    )
    record = PromptSample("q", "What is 47 * 38? Use the calculator.", (1,), "math", ("\\boxed{1786}",))
    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=8).start()
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), "t")
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        client = GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", "t", timeout=60)
        params = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 3}
        result = run_group(services, workflow, client, record, params, group_size=4, timeout=60)
    finally:
        httpd.shutdown()
        engine.stop()
    assert result.rewards == [1.0] * 4 and all(len(samples) == 1 for samples in result.samples)
    assert result.counts["turns"] >= 4
