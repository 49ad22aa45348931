"""The sandbox for model-written code: hostile programs are contained, end within their limits, and the sandbox
keeps serving; where namespaces cannot be made, the protections it still has are said."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_hpc.reward import Limits, Sandbox

LIMITS = Limits(time_secs=0.5, memory_mb=512, file_mb=4)
WALL = LIMITS.time_secs * 2 + 1.0 + 1.0  # the sandbox's wall-clock limit, and a second to tear down

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "infinite loop": "while True:\n    pass",
    "sleeps forever": "import time\ntime.sleep(1000)",
    "100 GB allocation": "x = bytearray(100 * 1024**3)",
    "write outside its directory": "open('/usr/lib/evil', 'w').write('x')",
    "print 1 GB": "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)",
    "open a socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
}

FORK_100 = """import os, time
started = 0
for _ in range(100):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    started += 1
print(started)"""


@pytest.fixture(scope="module", params=["as root", "in a user namespace"])
def sandbox(request) -> Sandbox:
    """Both ways in: as root (a uid of its own per run) and as users do it (a user namespace)."""
    if request.param == "as root" and os.geteuid() != 0:
        pytest.skip("needs root")
    box = Sandbox(LIMITS, user_namespace=request.param != "as root")
    if not box.protections.namespaces:
        pytest.skip(box.protections.describe())
    return box


def test_a_program_reads_its_input_and_prints_its_answer(sandbox):
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", stdin="2 40\n")
    assert result.ok and result.stdout == "42\n"
    assert "no network" in sandbox.protections.describe()


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_program_fails_within_its_limits_and_the_sandbox_keeps_serving(sandbox, name):
    result = sandbox.run(HOSTILE[name])
    assert not result.ok, result
    if name == "fork bomb" and "process limit" not in sandbox.protections.layers:
        # Root in a user namespace: the kernel exempts root's processes from the process limit, so the bomb grows
        # to thousands of processes until the wall clock kills them all (which takes a second or more).
        assert result.limit == "time", result
    else:
        assert result.secs < WALL, result
    assert len(result.stdout) <= LIMITS.file_mb * 1024 * 1024
    assert sandbox.run("print('still serving')").stdout == "still serving\n"


def test_the_process_limit_holds_where_the_sandbox_says_it_does(sandbox):
    started = int(sandbox.run(FORK_100).stdout)
    assert started < LIMITS.processes if "process limit" in sandbox.protections.layers else started == 100


def test_it_sees_neither_the_run_directory_nor_the_secret_nor_the_environment(sandbox, tmp_path, monkeypatch):
    secret = tmp_path / "run" / "secret"
    secret.parent.mkdir()
    secret.write_text("s3cr3t")
    secret.chmod(0o600)
    monkeypatch.setenv("AREAL_TEST_TOKEN", "s3cr3t")
    probe = f"""
import os
print(sorted(os.environ))
for path in ({str(secret)!r}, {str(secret.parent)!r}, os.path.expanduser('~root'), '/home', '/work'):
    try:
        print(path, open(path).read() if os.path.isfile(path) else os.listdir(path))
    except OSError as e:
        print(path, type(e).__name__)
"""
    result = sandbox.run(probe)
    assert result.ok and "s3cr3t" not in result.stdout and "AREAL_TEST_TOKEN" not in result.stdout
    assert f"{secret} FileNotFoundError" in result.stdout and "/home FileNotFoundError" in result.stdout


def test_writes_stay_in_its_own_directory_and_tmp(sandbox):
    result = sandbox.run(
        "open('a.txt', 'w').write('x')\nopen('/tmp/b', 'w').write('y')\nprint(open('a.txt').read())"
    )
    assert result.ok and result.stdout == "x\n"
    assert sandbox.run("import os\nprint(os.listdir('.'), os.listdir('/tmp'))").stdout == "['main.py'] []\n"


def test_hostile_and_honest_programs_at_once(sandbox):
    programs = [HOSTILE["fork bomb"], HOSTILE["infinite loop"]] + [f"print({i} * 2)" for i in range(6)]
    with ThreadPoolExecutor(len(programs)) as pool:
        results = list(pool.map(sandbox.run, programs))
    assert [r.stdout for r in results[2:]] == [f"{i * 2}\n" for i in range(6)]
    assert not any(r.ok for r in results[:2])


def test_without_unshare_the_limits_hold_and_the_log_says_what_is_not_isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare on it
    box = Sandbox(LIMITS)
    assert not box.protections.namespaces
    assert "NOT isolated from the network, the file system" in box.protections.describe()
    assert box.run("print(input())", stdin="hi\n").stdout == "hi\n"
    assert box.run(HOSTILE["100 GB allocation"]).limit == "memory"
    assert box.run(HOSTILE["infinite loop"]).limit == "time"
