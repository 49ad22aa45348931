"""Bad workflows, tools, agents and worked conversations are refused before anything is submitted, each naming
its key (or its file and line), all at once."""

from __future__ import annotations

import json
import sys

import pytest

from areal_hpc.cli import main
from areal_hpc.launch.preflight import check_inputs
from tests.helpers import REPO_ROOT

TOY = str(REPO_ROOT / "configs" / "toy-cpu.yaml")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.workflow=chat_loop"], "'rollout.workflow' is 'chat_loop': not a registered name (registered: "
                                         "single_turn, tool_loop)"),
        (["rollout.workflow=json:dumps"], "'rollout.workflow' is 'json:dumps', which is not an async function"),
        (["rollout.workflow=no_such_module:run"], "'rollout.workflow' is 'no_such_module:run': importing"),
        (["rollout.workflow=tool_loop", "rollout.tools=[]"], "'rollout.tools' is empty"),
        (["rollout.workflow=tool_loop", "rollout.tools=[calculator,calculator]"], "names a tool twice"),
        (["rollout.workflow=tool_loop", "rollout.tools=[abacus]"], "'rollout.tools' is 'abacus': not a registered"),
        (["rollout.workflow=tool_loop", "rollout.tools=[json:dumps]"], "a function, not an areal_hpc.agent.tools.Tool"),
        (["rollout.max_turns=3"], "'rollout.max_turns' does nothing here"),
        (["rollout.workflow=tool_loop", "rollout.export=per_step"], "'rollout.export'"),
        (["rollout.agent=solve"], "'rollout.agent' is 'solve': not a registered name (registered: none)"),
        (["rollout.agent=my agents:solve"], "'rollout.agent' is 'my agents:solve'; write 'module.path:attribute'"),
        (["rollout.agent=agent_fns:NOT_A_FUNCTION"],
         "'rollout.agent' is 'agent_fns:NOT_A_FUNCTION', which is not a function: write "
         "`async def NOT_A_FUNCTION(base_url, api_key, record)`"),
        (["rollout.agent=agent_fns:takes_two"],
         "'rollout.agent' is 'agent_fns:takes_two'(base_url, record), which does not take (base_url, api_key, "
         "record)"),
        (["rollout.agent_command=python -c \"print(1)"],
         "'rollout.agent_command' is 'python -c \"print(1)', which does not split into words like a shell line"),
        (["rollout.agent_command= "], "'rollout.agent_command' is empty"),
        (["rollout.agent_command=no-such-agent --fast"],
         "'rollout.agent_command': program 'no-such-agent' is not found (not on PATH, or not executable)"),
        (["rollout.agent=agent_fns:solve", "rollout.agent_model=my model"],
         "'rollout.agent_model' is 'my model'; give a model name without whitespace"),
        (["rollout.agent_model=gpt-4o"], "'rollout.agent_model' does nothing here"),
        (["rollout.agent=agent_fns:solve", "rollout.agent_output_bytes=4096"],
         "'rollout.agent_output_bytes' does nothing here"),
        (["experiment_type=sft", "actor.interface=sft", "rollout.agent=agent_fns:solve"],
         "'rollout.agent' does nothing here: a supervised warm-up"),
    ],
)  # fmt: skip
def test_a_bad_workflow_tool_or_agent_is_named_before_submit(plugins, toy, capsys, overrides, message):
    code = main(["submit", "--dry-run", TOY, *toy.overrides("bad", 2, *overrides)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not toy.fileroot.exists() or sorted(p.name for p in toy.fileroot.iterdir()) == []


def test_an_agent_with_a_workflow_or_another_agent_is_refused_all_at_once(toy, capsys):
    overrides = [
        "rollout.workflow=tool_loop",
        "rollout.agent=agents:solve",
        f"rollout.agent_command={sys.executable}",
        "rollout.agent_model=",
    ]
    assert main(["submit", "--dry-run", TOY, *toy.overrides("bad", 2, *overrides)]) == 2
    err = capsys.readouterr().err
    assert "'rollout.agent' and 'rollout.agent_command' are both set: set one" in err
    assert "'rollout.agent_model' is ''; give a model name without whitespace" in err
    assert (
        "'rollout.workflow' is 'tool_loop', but 'rollout.agent' and 'rollout.agent_command' are set: the agent "
        "replaces the workflow; set rollout.workflow=single_turn (its default)"
    ) in err


@pytest.mark.parametrize(
    "agent",
    ["rollout.agent=agent_fns:solve", f"rollout.agent_command={sys.executable} -c 'print(1)'"],
)
def test_an_agent_function_or_program_is_accepted_with_its_options(plugins, toy, agent):
    cfg = toy.config("agent", 2, agent, "rollout.agent_model=my-policy", "rollout.episode_timeout_secs=30")
    check_inputs(cfg)
    assert cfg.rollout.agent_model == "my-policy"
    assert cfg.rollout.episode_timeout_secs == 30


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "'messages' must be a non-empty list"),
        ([{"role": "robot", "content": "hi"}], "'messages'[0] must be an object with a role"),
        ([{"role": "assistant", "content": "\\\\boxed{1}"}, {"role": "tool", "content": "1"}],
         "'messages' must end with the assistant's turn"),
    ],
)  # fmt: skip
def test_a_malformed_worked_conversation_is_named_with_its_line(toy, tmp_path, capsys, messages, message):
    lines = (toy.data / "train.jsonl").read_text().splitlines()
    bad = json.loads(lines[1]) | {"messages": messages}
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    code = main(["submit", "--dry-run", TOY, *toy.overrides("bad", 2, f"dataset.path={path}")])
    assert code == 2
    assert f"{path}:2: {message}" in capsys.readouterr().err
