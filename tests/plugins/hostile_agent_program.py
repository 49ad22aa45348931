"""An agent program that does what a rollout must not let one do (tests/test_agent_programs.py). Standard library
only; what it finds goes to stdout as one JSON line, then its reward.

    python hostile_agent_program.py env                   its environment
    python hostile_agent_program.py scan                  other episodes' keys and the role's command line, from
                                                          /proc; each key it finds used on the endpoint
    python hostile_agent_program.py secret RUN_DIR        the run directory's secret
    python hostile_agent_program.py daemon TOKEN [hang]   a grandchild in a session of its own (TOKEN on its
                                                          command line), then exits (or hangs)
    python hostile_agent_program.py holder TOKEN          a child holding stdout, then exits at once
    python hostile_agent_program.py reward                its reward, nothing else
"""

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

KEY = re.compile(rb"sk-episode-[A-Za-z0-9_-]+")
SLEEP = [sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"]


def status_with(key: str) -> int:
    """The endpoint's answer to a call made with ``key``."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/models", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def proc_files(name: str) -> list[bytes]:
    """``name`` (environ, cmdline) of every process this program can read."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                out.append(f.read())
        except OSError:
            pass
    return out


def scan() -> dict:
    """For up to 1.5 s (while the other episode runs): keys not its own, and command lines naming a run
    directory, whose secret it then tries to read."""
    own = os.environ["OPENAI_API_KEY"]
    keys, run_dirs = set(), set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and not keys:
        keys |= {k.decode() for text in proc_files("environ") for k in KEY.findall(text)} - {own}
        for argv in (c.split(b"\0") for c in proc_files("cmdline")):
            run_dirs |= {argv[i + 1].decode() for i, a in enumerate(argv[:-1]) if a == b"--run-dir"}
        time.sleep(0.05)
    return {
        "own_key": status_with(own),
        "other_keys": {key: status_with(key) for key in keys},
        "run_dirs": sorted(run_dirs),
        "secrets": [read(os.path.join(d, "secret")) for d in sorted(run_dirs)],
    }


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return type(exc).__name__


def listing(path: str) -> list[str] | str:
    try:
        return os.listdir(path)
    except OSError as exc:
        return type(exc).__name__


def daemon(token: str) -> None:
    """A grandchild that leaves the program's session (as a daemon does), its output nowhere; returns once it
    runs."""
    started = os.pipe()  # closed on exec
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execv(SLEEP[0], [*SLEEP, token])
        os._exit(0)
    os.wait()
    wait_exec(*started)


def holder(token: str) -> None:
    """A child that keeps the program's stdout open, and lives on; returns once it runs."""
    started = os.pipe()
    if os.fork() == 0:
        os.execv(SLEEP[0], [*SLEEP, token])
    wait_exec(*started)


def wait_exec(read_end: int, write_end: int) -> None:
    """Until every process but this one that held ``write_end`` (not inherited by exec) has executed or ended."""
    os.close(write_end)
    os.read(read_end, 1)
    os.close(read_end)


mode = sys.argv[1]
sys.stdin.read()  # the record
if mode == "env":  # as it was given (Python adds LC_CTYPE to os.environ under the C locale)
    with open("/proc/self/environ", "rb") as f:
        given = dict(v.decode().split("=", 1) for v in f.read().split(b"\0") if v)
    print(json.dumps(given))
elif mode == "scan":
    print(json.dumps(scan()))
elif mode == "secret":
    print(
        json.dumps(
            {
                "uid": os.getuid(),
                "secret": read(os.path.join(sys.argv[2], "secret")),
                "listing": listing(sys.argv[2]),
            }
        )
    )
elif mode == "daemon":
    daemon(sys.argv[2])
    if sys.argv[3:] == ["hang"]:
        time.sleep(3600)
elif mode == "holder":
    holder(sys.argv[2])
print(1.0, flush=True)
