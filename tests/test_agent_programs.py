"""Agent programs (rollout.agent_command) as real processes against the real endpoint and a real built-in server
on the tiny model: a program is trained through its environment and its output is kept; a hostile one reaches
nothing it must not (the role's credentials, another episode's key, the run's secret) and leaves nothing running.
Every test runs as root (each program as a uid of its own) and again as root in a user namespace that maps one
uid (how users, enroot and rootless podman run it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import suppress
from dataclasses import replace
from pathlib import Path

import pytest

from areal_hpc.agent import AgentIsolationError
from areal_hpc.agent.programs import FIRST_UID, UIDS
from areal_hpc.config import ConfigError, load_config
from areal_hpc.control import RunDir
from areal_hpc.control.fsio import name_of
from areal_hpc.data import PromptSample
from areal_hpc.gen.agents import command_agent
from areal_hpc.gen.endpoint import Endpoint
from areal_hpc.gen.episodes import AgentFailed, Episodes, GroupTimeout, episode_groups, run_group
from areal_hpc.launch.preflight import agent_isolation_problems
from areal_hpc.recover import ATTEMPT_ENV
from areal_hpc.reward import own_uids_available
from tests.helpers import REPO_ROOT
from tests.test_episodes import PARAMS, RECORD, services

PROGRAM = Path(__file__).parent / "plugins" / "sdk_agent_program.py"
HOSTILE = Path(__file__).parent / "plugins" / "hostile_agent_program.py"
CROWD = Path(__file__).parent / "plugins" / "crowd_agent_program.py"
TOY = REPO_ROOT / "configs" / "toy-cpu.yaml"
SECRET = "the-generation-servers-bearer-token\n"
INNER = "AREAL_AGENT_PROGRAMS_TEST_LEG"  # set in the run of this file as root in a user namespace


@pytest.fixture
def endpoint():
    endpoint = Endpoint("policy")
    yield endpoint
    endpoint.shutdown()


@pytest.fixture
def run_dir():
    """A run directory as RunDir makes it (0700, its secret 0600), where any user could walk to it (/tmp)."""
    root = Path(tempfile.mkdtemp(prefix="run-"))
    (root / "secret").write_text(SECRET)
    (root / "secret").chmod(0o600)
    yield root
    shutil.rmtree(root)


def run_hostile(args, client, tokenizer, run_dir, *overrides, record=RECORD, timeout=30):
    """The group of ``record`` (two episodes) with HOSTILE ``args`` as rollout.agent_command, as the rollout
    builds it (Episodes, logs in the run directory's logs/agents)."""
    command = shlex.join([sys.executable, str(HOSTILE), *args])
    cfg = load_config([TOY], [f"rollout.agent_command={command}", *overrides])
    episodes = Episodes(cfg, services(tokenizer), RunDir(run_dir))
    try:
        return run_group(episodes.services, episodes.workflow, client, record, PARAMS, 2, timeout)
    finally:
        episodes.close()


def printed(run_dir: Path, index: int, record=RECORD) -> dict:
    """The JSON line episode ``index``'s program printed before its reward, from its group's log."""
    log = run_dir / "logs" / "agents" / "epoch0" / f"{name_of(record.query_id)}.log"
    head = f"=== episode {index} of {record.query_id} (epoch 0, attempt 0), exit code 0: stdout\n"
    return json.loads(log.read_text().split(head)[1].splitlines()[0])


def running(word: str, within: float = 0.0) -> bool:
    """Whether a process whose command line holds ``word`` is still there after ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(word in cmdline for cmdline in _cmdlines()):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def _cmdlines() -> list[str]:
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with suppress(OSError):  # ended meanwhile
            out.append(path.read_bytes().decode(errors="replace"))
    return out


def test_an_agent_program_is_trained_through_its_environment_and_its_output_is_kept(
    builtin_client, tiny_tokenizer, endpoint, tmp_path
):
    def run_program(mode: str, timeout: float = 60, output_bytes: int = 65536):
        command = shlex.join([sys.executable, str(PROGRAM), mode])
        workflow = command_agent(command, endpoint, tmp_path, output_bytes)
        return run_group(svc, workflow, builtin_client, RECORD, PARAMS, 2, timeout)

    svc = services(tiny_tokenizer)
    result = run_program("noisy", output_bytes=1024)
    assert result.rewards == [1.0, 1.0] and result.counts["turns"] == 4 and result.counts["breaks"] == 0
    log = tmp_path / "epoch0" / f"{name_of(RECORD.query_id)}.log"
    for index in (0, 1):  # each episode's block: 5,000 bytes of stdout kept to 1,024, its stderr
        block = log.read_text().split(
            f"=== episode {index} of q1 (epoch 0, attempt 0), exit code 0: stdout\n"
        )[1]
        out, err = block.split(f"=== episode {index} of q1 (epoch 0, attempt 0), exit code 0: stderr\n")
        assert out.startswith("x" * 1000) and "[cut: " in out and len(out) < 1100
        assert err.startswith("turn 0: ") and "turn 1: " in err

    with pytest.raises(AgentFailed, match="exited with 3"):
        run_program("fail")

    start = time.monotonic()
    with pytest.raises(GroupTimeout):
        run_program("hang", timeout=3)
    assert time.monotonic() - start < 10
    assert "exit code -9: stdout\nstarted\n" in log.read_text()  # what it wrote before it was killed
    assert not running(str(PROGRAM))  # killed with the episode


@pytest.mark.parametrize("last_line", ["nan", "1.0 points"])
def test_a_program_whose_last_line_is_not_a_finite_number_fails_its_episode(
    builtin_client, tiny_tokenizer, endpoint, tmp_path, last_line
):
    command = shlex.join([sys.executable, "-c", f"print({last_line!r})"])
    workflow = command_agent(command, endpoint, tmp_path, 65536)
    with pytest.raises(AgentFailed) as failed:
        run_group(services(tiny_tokenizer), workflow, builtin_client, RECORD, PARAMS, 2, 30)
    assert (
        failed.value.cause
        == "the last line of rollout.agent_command's stdout is not a finite number (the reward)"
    )
    assert f": {last_line!r} (its output: {tmp_path / 'epoch0'}/" in str(failed.value)


def test_no_more_programs_run_at_once_than_agent_concurrency_and_their_logs_name_the_attempt(
    builtin_client, tiny_tokenizer, run_dir, monkeypatch
):
    crowd = Path(tempfile.mkdtemp(prefix="crowd-"))  # where every program's uid may write (tests/plugins)
    for folder in (crowd, crowd / "running", crowd / "seen"):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o777)
    monkeypatch.setenv("CROWD_DIR", str(crowd))
    monkeypatch.setenv(ATTEMPT_ENV, "1")  # the run's second attempt
    command = shlex.join([sys.executable, str(CROWD)])
    cfg = load_config([TOY], [f"rollout.agent_command={command}", "rollout.agent_env=[CROWD_DIR]",
                              "rollout.agent_concurrency=4", "group_size=8"])  # fmt: skip
    episodes = Episodes(cfg, services(tiny_tokenizer), RunDir(run_dir))
    prompts = [replace(RECORD, query_id=f"q{i}") for i in range(8)]
    try:
        groups, _ = episode_groups([builtin_client], episodes, prompts, epoch=0)
        seen = [int(path.read_text()) for path in (crowd / "seen").iterdir()]
    finally:
        episodes.close()
        shutil.rmtree(crowd)
    assert [g.dropped for g in groups] == [None] * 8 and len(seen) == 64
    assert max(seen) == 4  # as the programs counted themselves: never more
    log = run_dir / "logs" / "agents" / "epoch0" / f"{name_of('q3')}.log"
    assert log.read_text().count("of q3 (epoch 0, attempt 1), exit code 0: stdout\n") == 8


def test_a_program_gets_no_variable_of_the_role_but_those_it_needs_and_those_agent_env_names(
    builtin_client, tiny_tokenizer, run_dir, monkeypatch
):
    monkeypatch.setenv("HF_TOKEN", "hf_the-role-s-own")
    monkeypatch.setenv("WANDB_API_KEY", "the-role-s-own")
    monkeypatch.setenv("MY_AGENT_MODE", "fast")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-mine")
    run_hostile(["env"], builtin_client, tiny_tokenizer, run_dir, "rollout.agent_env=[MY_AGENT_MODE]")
    envs = [printed(run_dir, index) for index in (0, 1)]
    for env in envs:
        assert "HF_TOKEN" not in env and "WANDB_API_KEY" not in env
        assert env["MY_AGENT_MODE"] == "fast" and env["OPENAI_ORG_ID"] == "org-mine"
        assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "OPENAI_BASE_URL", "OPENAI_API_KEY",
                            "OPENAI_MODEL", "OPENAI_ORG_ID", "MY_AGENT_MODE"}  # fmt: skip
        # Its own HOME and TMPDIR, removed after the episode.
        assert not Path(env["HOME"]).exists() and not Path(env["TMPDIR"]).exists()
    assert envs[0]["HOME"] != envs[1]["HOME"] and envs[0]["OPENAI_API_KEY"] != envs[1]["OPENAI_API_KEY"]


def test_a_program_finds_no_other_episode_s_key_and_not_the_role_s_command_line(
    builtin_client, tiny_tokenizer, run_dir
):
    # A process with the rollout role's command line, which names the run directory.
    role = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--run-dir", str(run_dir)])
    try:
        run_hostile(["scan"], builtin_client, tiny_tokenizer, run_dir)
    finally:
        role.kill()
        role.wait()
    for index in (0, 1):
        found = printed(run_dir, index)
        assert found["own_key"] == 200
        assert all(status == 401 for status in found["other_keys"].values()) and found["other_keys"] == {}
        assert found["run_dirs"] == [] and found["secrets"] == []


def test_a_daemon_a_program_starts_dies_at_the_timeout_and_when_the_program_exits(
    builtin_client, tiny_tokenizer, run_dir
):
    token = f"daemon-{uuid.uuid4().hex}"
    with pytest.raises(GroupTimeout):
        run_hostile(["daemon", token, "hang"], builtin_client, tiny_tokenizer, run_dir, timeout=3)
    assert not running(token, within=2)

    token = f"daemon-{uuid.uuid4().hex}"
    result = run_hostile(["daemon", token], builtin_client, tiny_tokenizer, run_dir)
    assert result.rewards == [1.0, 1.0]
    assert not running(token, within=2)


def test_a_program_is_scored_when_it_exits_though_a_child_holds_its_stdout(
    builtin_client, tiny_tokenizer, run_dir
):
    token = f"holder-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_hostile(["holder", token], builtin_client, tiny_tokenizer, run_dir, timeout=20)
    assert result.rewards == [1.0, 1.0] and time.monotonic() - start < 5
    assert not running(token, within=2)


def test_a_program_cannot_read_the_run_directory_s_secret(builtin_client, tiny_tokenizer, run_dir):
    run_hostile(["secret", str(run_dir)], builtin_client, tiny_tokenizer, run_dir)
    for index in (0, 1):
        found = printed(run_dir, index)
        assert found["secret"] != SECRET and found["listing"] == []  # an empty tmpfs over the run directory
        # As root, besides, a uid of its own, which the run directory (0700) keeps out.
        assert found["uid"] >= 62000 or not own_uids_available(FIRST_UID, UIDS)
    if own_uids_available(FIRST_UID, UIDS):  # so the run directory must be private
        run_dir.chmod(0o755)
        with pytest.raises(
            AgentIsolationError,
            match="is mode 755, open to other users, the programs' own uids among them: chmod 700 it",
        ):
            run_hostile(["secret", str(run_dir)], builtin_client, tiny_tokenizer, run_dir)


@pytest.mark.parametrize("query_id", ["q" * 300, ".."], ids=["300 characters", "dot-dot"])
def test_a_prompt_id_names_its_log_file_through_name_of(builtin_client, tiny_tokenizer, run_dir, query_id):
    record = PromptSample(query_id, "What is 47 * 38?", (1, 2, 3), "math", ("\\boxed{1786}",))
    run_hostile(["reward"], builtin_client, tiny_tokenizer, run_dir, record=record)
    folder = run_dir / "logs" / "agents" / "epoch0"
    assert [p.name for p in folder.iterdir()] == [f"{name_of(query_id)}.log"]
    assert (
        f"=== episode 1 of {query_id} (epoch 0, attempt 0), exit code 0"
        in (folder / f"{name_of(query_id)}.log").read_text()
    )


def test_where_the_node_gives_no_namespaces_required_refuses_and_best_effort_runs_saying_what_is_exposed(
    builtin_client, tiny_tokenizer, run_dir, tmp_path, monkeypatch, caplog
):
    fake = tmp_path / "unshare"  # as AppArmor on Ubuntu >= 23.10, or a container that forbids nesting
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(AgentIsolationError) as refused:
        run_hostile(["reward"], builtin_client, tiny_tokenizer, run_dir)
    message = str(refused.value)
    assert "unshare failed: Operation not permitted" in message and "mount and PID namespaces" in message
    assert "rollout.agent_isolation=best_effort" in message
    cfg = load_config([TOY], [f"rollout.agent_command={sys.executable} -c pass"])
    assert agent_isolation_problems(cfg) == [f"'rollout.agent_isolation': {message}"]  # checked before a run

    result = run_hostile(
        ["reward"], builtin_client, tiny_tokenizer, run_dir, "rollout.agent_isolation=best_effort"
    )
    assert result.rewards == [1.0, 1.0]
    assert (
        "best_effort and this node cannot isolate agent programs: unshare failed" in caplog.text
        and "other episodes' keys" in caplog.text
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.agent_env=[MY-MODE]"], "'rollout.agent_env' names 'MY-MODE', which is not a variable name"),
        (["rollout.agent_env=[OPENAI_API_KEY]"], "'rollout.agent_env' names OPENAI_API_KEY, which the program gets"),
        (["rollout.workflow=tool_loop", "rollout.agent_env=[MY_MODE]"],
         "'rollout.agent_env' is set, but 'rollout.agent_command' is not"),
        (["rollout.workflow=tool_loop", "rollout.agent_isolation=best_effort"],
         "'rollout.agent_isolation' is set, but 'rollout.agent_command' is not"),
    ],
)  # fmt: skip
def test_agent_options_are_checked(overrides, message):
    command = [] if "workflow" in overrides[0] else [f"rollout.agent_command={sys.executable} -c pass"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([TOY], [*command, *overrides])


@pytest.mark.skipif(bool(os.environ.get(INNER)), reason="this is the run it starts")
def test_every_agent_program_test_passes_as_root_in_a_user_namespace():
    """enroot, pyxis and rootless podman start jobs as uid 0 of a user namespace that maps a few uids, and a
    user's job runs as the user: no uid of its own for the programs; a user namespace of their own hides the
    run directory."""
    run = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         __file__, "-k", "not as_root_in_a_user_namespace and not agent_options and not prompt_id and not no_namespaces"],
        env={**os.environ, INNER: "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and "skipped" not in summary, run.stdout[-3000:] + run.stderr[-3000:]
