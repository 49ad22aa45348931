"""Running model-written programs: each in a fresh empty directory, with a clean environment, under CPU, memory,
file-size, process and open-file limits, and where the operating system allows it isolated from the host.

    sandbox = Sandbox(Limits(time_secs=2.0))
    result = sandbox.run("print(int(input()) + 1)", stdin="41\\n")   # result.stdout == "42\\n"

Isolation (`jail.py`, entered through util-linux's `unshare`): new mount, PID, network, IPC and UTS namespaces
(as a user namespace when not root), a root of its own that shows the system's program directories read-only
and nothing of the run directory or the home directories, no network but loopback, and no capabilities; as
root the program also runs as a uid of its own per concurrent run (so it cannot read the run's secret, and
the process limit counts its processes only). `Sandbox.protections` says which layers are active; where the
namespaces cannot be made, programs still run with the limits, the fresh directory and the clean environment,
and the log says that the network and the file system are visible to them.

Output goes to files capped by the file-size limit (a program printing a gigabyte is stopped at the cap, and
nothing is buffered in this process); the wall-clock limit kills the namespace's every process.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

JAIL = Path(__file__).with_name("jail.py")
SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/ld.so.cache", "/etc/alternatives")
FIRST_UID = (
    61000  # as root, concurrent runs get uids FIRST_UID, FIRST_UID + 1, ... (none of them a real user)
)
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    time_secs: float = 2.0  # CPU seconds; the wall clock allows twice that, plus start-up
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # each file it writes, its output included
    processes: int = 32
    open_files: int = 64
    tmp_mb: int = 64  # its /tmp


@dataclass
class Result:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    secs: float
    limit: str | None = None  # "time", "memory", "output" when a limit stopped it

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.limit is None


@dataclass
class Protections:
    """Which layers a sandbox has (probed once per process)."""

    namespaces: bool
    own_uid: bool
    why_not: str = ""
    layers: list[str] = field(default_factory=list)

    def describe(self) -> str:
        active = ", ".join(self.layers)
        if self.namespaces:
            return f"sandbox: {active}"
        return (
            f"sandbox: {active}; NOT isolated from the network, the file system (the run directory, home) or "
            f"this user's processes: {self.why_not}"
        )


class Sandbox:
    """Runs programs under `limits`; thread-safe, any number at once (each gets a uid slot as root)."""

    def __init__(
        self,
        limits: Limits = Limits(),
        python: str | None = None,
        workroot: str | None = None,
        user_namespace: bool | None = None,
    ):
        """`user_namespace`: enter the namespaces through a user namespace (None: unless root, who needs none)."""
        self.limits = limits
        self.python = python or os.path.realpath(sys._base_executable)  # the interpreter, not a venv's
        self.workroot = workroot or tempfile.gettempdir()
        self.user_namespace = os.geteuid() != 0 if user_namespace is None else user_namespace
        self._slots = list(range(256))
        self._lock = threading.Lock()
        self.protections = self._probe()

    def run(self, source: str, stdin: str = "") -> Result:
        """Run Python `source` with `stdin`; what it printed, how it ended, and which limit stopped it."""
        slot = self._take_slot()
        work = Path(tempfile.mkdtemp(prefix="sandbox-", dir=self.workroot))
        try:
            return self._run(work, slot, source, stdin)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            with self._lock:
                self._slots.append(slot)

    # --- one run ------------------------------------------------------------------------------------------

    def _run(self, work: Path, slot: int, source: str, stdin: str) -> Result:
        box, root = work / "box", work / "root"
        box.mkdir(mode=0o700)
        root.mkdir()
        (box / "main.py").write_text(source)
        (work / "stdin").write_text(stdin)
        uid = FIRST_UID + slot if self.protections.own_uid else None
        if uid is not None:
            os.chown(box, uid, uid)
            os.chown(box / "main.py", uid, uid)
        argv = [self.python, "-I", "-S", "-B", "main.py"]
        spec = {
            "root": str(root), "workdir": str(box), "uid": uid, "argv": argv, "env": ENV,
            "system": [*SYSTEM, self._prefix()], "tmp_mb": self.limits.tmp_mb, "limits": self._rlimits(),
        }  # fmt: skip
        (work / "spec").write_bytes(marshal.dumps(spec))  # what jail.py reads: a node-local file of this run
        if self.protections.namespaces:
            cmd = [*self._unshare(), self.python, "-I", "-S", "-B", str(JAIL), str(work / "spec")]
            cwd, preexec = None, None
        else:
            cmd, cwd, preexec = argv, box, self._apply_limits
        start = time.monotonic()
        with open(work / "stdin") as i, open(work / "stdout", "w") as o, open(work / "stderr", "w") as e:
            proc = subprocess.Popen(
                cmd, stdin=i, stdout=o, stderr=e, cwd=cwd, env=ENV if preexec else {"PATH": ENV["PATH"]},
                preexec_fn=preexec, start_new_session=True,
            )  # fmt: skip
            # A timer kills it at the wall-clock limit (wait(timeout=) polls: up to 50 ms more a run). It is
            # reaped only after its session is killed, so that no other process can have taken its pid.
            expired = threading.Event()
            wall = self.limits.time_secs * 2 + 1.0
            timer = threading.Timer(wall, lambda: (expired.set(), _kill_group(proc)))
            timer.start()
            try:
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            finally:
                timer.cancel()
                timer.join()
                _kill_group(proc)  # what is left of its session (the fallback's children)
                code = proc.wait()
            code = None if expired.is_set() else code
        secs = time.monotonic() - start
        out, err = (_read(work / name, self.limits.file_mb) for name in ("stdout", "stderr"))
        return Result(code, out, err, secs, _limit_of(code, err))

    def _rlimits(self) -> dict:
        mb = 1024 * 1024
        lim = self.limits
        return {
            "cpu_secs": max(1, round(lim.time_secs + 0.5)),  # soft; the hard limit a second later (SIGKILL)
            "memory_bytes": lim.memory_mb * mb,
            "file_bytes": lim.file_mb * mb,
            "processes": lim.processes,
            "open_files": lim.open_files,
        }

    def _apply_limits(self) -> None:  # the fallback's preexec_fn
        keys = {"cpu_secs": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_AS,
                "file_bytes": resource.RLIMIT_FSIZE, "open_files": resource.RLIMIT_NOFILE}  # fmt: skip
        for key, value in self._rlimits().items():
            if key in keys:  # not NPROC: without a namespace it would count this user's every process
                resource.setrlimit(keys[key], (value, value))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def _unshare(self) -> list[str]:
        cmd = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts"]
        return [*cmd, "--user", "--map-root-user"] if self.user_namespace else cmd

    def _prefix(self) -> str:
        """The interpreter's installation (its binary and standard library)."""
        return os.path.dirname(os.path.dirname(self.python))

    def _take_slot(self) -> int:
        with self._lock:
            if not self._slots:
                raise RuntimeError("more than 256 sandboxed programs at once")
            return self._slots.pop(0)

    # --- what this machine allows ----------------------------------------------------------------------------

    def _probe(self) -> Protections:
        """Try the namespaces once: where `unshare` is refused, programs run with the base layers only."""
        base = ["fresh empty directory", "clean environment", "CPU, memory, file-size and open-file limits"]
        if shutil.which("unshare") is None:
            return Protections(False, False, why_not="util-linux's unshare is not installed", layers=base)
        root = os.geteuid() == 0 and not self.user_namespace  # as root, each run gets a uid of its own
        self.protections = Protections(namespaces=True, own_uid=root)
        probe = self.run("print('ok')")
        if probe.ok and probe.stdout == "ok\n":
            # The kernel exempts root's processes from the process limit: root in a user namespace has none.
            nproc = root or os.geteuid() != 0
            isolated = [*(["process limit"] if nproc else []), "own root file system (system directories "
                        "read-only)", "no network", "own PID namespace", "no capabilities",
                        *(["own uid"] if root else [])]  # fmt: skip
            return Protections(True, root, layers=[*base, *isolated])
        why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return Protections(False, False, why_not=f"unshare failed ({why})", layers=base)


def _kill_group(proc: subprocess.Popen) -> None:
    """The whole session: unshare (whose --kill-child ends the namespace) or the bare program and its children."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _read(path: Path, cap_mb: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap_mb * 1024 * 1024).decode(errors="replace")


def _limit_of(code: int | None, stderr: str) -> str | None:
    """Which limit ended a program, from how it ended."""
    if code is None or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
        return "time"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
        return "output"
    if "MemoryError" in stderr:
        return "memory"
    return None
