"""The sandbox for model-written code: hostile programs are contained, end within limits that are the whole
program's, and the sandbox keeps serving; every way in: as root (a uid of its own per run), through a user
namespace (as users do it) and as root in a user namespace that maps one uid (enroot, rootless podman). Where
the node cannot isolate, the sandbox refuses unless asked for best effort, and says what is not isolated."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from areal_hpc.reward import IsolationError, Limits, Sandbox

LIMITS = Limits(time_secs=0.5, memory_mb=256, disk_mb=16, file_mb=4)
WALL = LIMITS.time_secs * 2 + 1.0 + 1.0  # the sandbox's wall-clock limit, and a second to tear down
INNER = "AREAL_SANDBOX_TEST_LEG"  # set in the run of this file as root in a user namespace
HOSTILE_SUITE = Path(__file__).with_name("test_sandbox_hostile.py")  # run there too

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "infinite loop": "while True:\n    pass",
    "sleeps forever": "import time\ntime.sleep(1000)",
    "100 GB allocation": "x = bytearray(100 * 1024**3)",
    "write outside its directory": "open('/usr/lib/evil', 'w').write('x')",
    "print 1 GB": "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(block)",
    "open a socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
    # What per-process limits let through: each child, thread or file under the limit, the whole far above it.
    "six children of 150 MB": "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
    "        x = bytearray(150 * 2**20)\n        time.sleep(5)\n        os._exit(0)\ntime.sleep(5)",
    "six threads of 150 MB": "import threading\nkept = []\nthreads = [threading.Thread(target=lambda: "
    "kept.append(bytearray(150 * 2**20))) for _ in range(6)]\nfor t in threads:\n    t.start()\n"
    "for t in threads:\n    t.join()\nassert len(kept) == 6",
    "sixty files of 4 MB": "for i in range(60):\n    open(f'f{i}', 'wb').write(bytes(4 * 2**20 - 1))",
    "sixty files of 4 MB in /tmp": "for i in range(60):\n    open(f'/tmp/f{i}', 'wb').write(bytes(4 * 2**20 - 1))",
    "four busy processes": "import os\nfor _ in range(3):\n    try:\n        if os.fork() == 0:\n            break\n"
    "    except OSError:\n        pass\nwhile True:\n    pass",
    "run a shell": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'echo escaped'], check=True)",
}
STOPPED_BY = {
    "six threads of 150 MB": "memory",
    "sixty files of 4 MB": "disk",
    "sixty files of 4 MB in /tmp": "disk",
    "four busy processes": "time",
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

LEGS = ["as root in a user namespace"] if os.environ.get(INNER) else ["as root", "in a user namespace"]


@pytest.fixture(scope="module", params=LEGS)
def sandbox(request) -> Sandbox:
    """The ways in: as root (a uid of its own per run), and as users do it (a user namespace); the third,
    root in a user namespace, is this file run again by the last test (the sandbox finds its way in itself)."""
    if request.param == "as root" and os.geteuid() != 0:
        pytest.skip("needs root")
    if request.param == "as root in a user namespace":
        box = Sandbox(LIMITS)
        assert box.user_namespace and not box.protections.own_uid
        return box
    return Sandbox(LIMITS, user_namespace=request.param != "as root")


def test_a_program_reads_its_input_and_prints_its_answer(sandbox):
    result = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", stdin="2 40\n")
    assert result.ok and result.stdout == "42\n"
    assert sandbox.protections.isolated and "no network" in sandbox.protections.describe()


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_program_fails_within_its_limits_and_the_sandbox_keeps_serving(sandbox, name):
    result = sandbox.run(HOSTILE[name])
    assert not result.ok, result
    assert result.secs < WALL, result
    assert result.limit == STOPPED_BY.get(name, result.limit), result
    assert len(result.stdout) <= LIMITS.file_mb * 1024 * 1024
    assert "escaped" not in result.stdout
    assert sandbox.run("print('still serving')").stdout == "still serving\n"


def test_a_program_is_one_process_and_may_have_threads(sandbox):
    assert sandbox.run(FORK_100).stdout == "0\n"
    threads = (
        "import threading\nt = threading.Thread(target=print, args=('from a thread',))\nt.start()\nt.join()"
    )
    assert sandbox.run(threads).stdout == "from a thread\n"


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


@pytest.mark.skipif(bool(os.environ.get(INNER)), reason="this is the run it starts")
def test_every_sandbox_test_passes_as_root_in_a_user_namespace():
    """enroot, pyxis and rootless podman start jobs as uid 0 of a user namespace that maps a few uids: the
    sandbox gives no uid of its own there (chown to an unmapped uid fails) and enters a user namespace again.
    The hostile-program suite runs there too (one start-up of pytest for both)."""
    run = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         __file__, str(HOSTILE_SUITE), "-k",
         "not as_root_in_a_user_namespace and not without_unshare and not where_unshare_is_refused"],
        env={**os.environ, INNER: "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and "skipped" not in summary, run.stdout[-3000:] + run.stderr[-3000:]


def test_without_unshare_a_required_sandbox_refuses_and_says_what_the_site_must_allow(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare on it
    with pytest.raises(IsolationError) as refused:
        Sandbox(LIMITS)
    message = str(refused.value)
    assert "unshare is not installed" in message and "user namespaces for unprivileged users" in message
    assert "reward.code_isolation=best_effort" in message


def test_where_unshare_is_refused_best_effort_runs_one_process_under_the_limits_and_says_so(
    tmp_path, monkeypatch
):
    """AppArmor on Ubuntu >= 23.10, or a container that forbids nesting: unshare exists and fails."""
    fake = tmp_path / "unshare"
    fake.write_text(
        "#!/bin/sh\necho 'unshare: write failed /proc/self/uid_map: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(IsolationError, match="uid_map: Operation not permitted"):
        Sandbox(LIMITS)
    box = Sandbox(LIMITS, isolation="best_effort")
    assert not box.protections.isolated and box.protections.one_process
    assert "NOT isolated: unshare failed" in box.protections.describe()
    assert "see the network, the file system" in box.protections.describe()
    assert box.run("print(input())", stdin="hi\n").stdout == "hi\n"
    assert box.run(FORK_100).stdout == "0\n"
    assert box.run(HOSTILE["six threads of 150 MB"]).limit == "memory"
    assert box.run(HOSTILE["100 GB allocation"]).limit == "memory"
    assert box.run(HOSTILE["infinite loop"]).limit == "time"
