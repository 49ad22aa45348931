"""Bad workflows, tools and worked conversations are refused before anything is submitted, each naming its key
(or its file and line), all at once."""

from __future__ import annotations

import json

import pytest

from areal_hpc.cli import main
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
    ],
)  # fmt: skip
def test_a_bad_workflow_or_tool_is_named_before_anything_is_written(toy, capsys, overrides, message):
    code = main(["submit", "--dry-run", TOY, *toy.overrides("bad", 2, *overrides)])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not toy.fileroot.exists() or sorted(p.name for p in toy.fileroot.iterdir()) == []


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
