"""Running model-written programs: each as one process under limits that are the whole program's, with a clean
environment, and isolated from the host: refused where the node cannot isolate, unless asked for best effort.

    sandbox = Sandbox(Limits(time_secs=2.0))
    result = sandbox.run("print(int(input()) + 1)", stdin="41\\n")   # result.stdout == "42\\n"

Isolation (`jail.py`, entered through util-linux's `unshare`): new mount, PID, network, IPC and UTS namespaces
(through a user namespace when not root, or when root in a user namespace that maps too few uids, as under
enroot or rootless podman), a root of its own that shows the system's program directories read-only and
nothing of the run directory or the home directories (nor their paths), no network but loopback, no
capabilities; as root the program also runs as a uid of its own per concurrent run (so it cannot read the
run's secret).

Limits: the program is one process (a seccomp filter refuses new processes; threads are allowed), so its
address space and CPU time are the whole program's; the filter also refuses the memory the address-space limit
does not count (SysV IPC, POSIX message queues, memfds), io_uring, BPF, the keyrings and sockets other than
unix and IP. What it writes goes to one size-capped tmpfs (its directory and /tmp; the rest of its root is
read-only); its input is a sealed memory file, its output two memory files capped by the file-size limit
(nothing is buffered in this process); the wall-clock limit kills the namespace's every process.
`Sandbox.protections` says which layers hold here. `isolation="required"` (reward.code_isolation's default)
raises `IsolationError` where they do not all hold; "best_effort" runs programs with what holds, and the log
says what they can see.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_hpc.config import InputError
from areal_hpc.reward import jail

logger = logging.getLogger(__name__)

JAIL = Path(jail.__file__)
JAIL_SOURCE = JAIL.read_bytes()  # handed to each jail as a memory file: no host path on its command line
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/ld.so.cache", "/etc/alternatives")
# As root, concurrent runs get uids FIRST_UID, FIRST_UID + 1, ... (no real user's), SLOTS of them.
FIRST_UID, SLOTS = 61000, 256
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/sandbox", "PYTHONDONTWRITEBYTECODE": "1"}
ISOLATION = ("required", "best_effort")
# Forks once: "one process" when the seccomp filter refused it.
PROBE = "import os\ntry:\n    pid = os.fork()\nexcept OSError:\n    print('one process')\nelse:\n    if pid == 0:\n"
PROBE += "        os._exit(0)\n    print('forked')\n"
SITE_NEEDS = (
    "user namespaces for unprivileged users (sysctl user.max_user_namespaces > 0; "
    "kernel.unprivileged_userns_clone=1 on Debian's kernels; on Ubuntu >= 23.10 "
    "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile that lets util-linux's unshare "
    "make them; containers that allow nested namespaces), util-linux's unshare and setpriv, and seccomp filters "
    "(docs/cluster.md)"
)


@dataclass(frozen=True)
class Limits:
    """What one program may use, in all."""

    time_secs: float = 2.0  # CPU seconds; the wall clock allows twice that, plus start-up
    memory_mb: int = 1024  # address space
    disk_mb: int = 64  # bytes written to its directory and /tmp together (a tmpfs: memory besides memory_mb)
    file_mb: int = 16  # each file it writes, its output included
    threads: int = 32  # where the kernel applies it: not to processes of uid 0
    open_files: int = 64


@dataclass
class Result:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    secs: float
    limit: str | None = None  # "time", "memory", "output", "disk" when a limit stopped it

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.limit is None


class IsolationError(InputError):
    """reward.code_isolation is required and this node cannot isolate programs; the message says what the site
    must allow and how to opt out."""


@dataclass
class Protections:
    """Which layers a sandbox has (probed once per sandbox)."""

    namespaces: bool
    own_uid: bool
    one_process: bool
    why_not: str = ""
    layers: list[str] = field(default_factory=list)

    @property
    def isolated(self) -> bool:
        return self.namespaces and self.one_process

    def describe(self) -> str:
        active = ", ".join(self.layers)
        if self.isolated:
            return f"sandbox: {active}"
        return f"sandbox: {active}; NOT isolated: {self.why_not}"


class Sandbox:
    """Runs programs under `limits`; thread-safe, any number at once (each gets a uid slot as root)."""

    def __init__(
        self,
        limits: Limits = Limits(),
        python: str | None = None,
        workroot: str | None = None,
        user_namespace: bool | None = None,
        isolation: str = "required",
    ):
        """`user_namespace`: enter the namespaces through a user namespace (None: unless root with uids of its own
        to give). `isolation`: "required" raises IsolationError where programs cannot be isolated."""
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
        self.limits = limits
        self.python = python or os.path.realpath(sys._base_executable)  # the interpreter, not a venv's
        self.workroot = workroot or tempfile.gettempdir()
        self.user_namespace = not own_uids_available() if user_namespace is None else user_namespace
        self._unshare_path = shutil.which("unshare")  # looked up on this PATH, not the programs'
        self._slots = list(range(SLOTS))
        self._lock = threading.Lock()
        self.protections = self._probe()
        if isolation == "required" and not self.protections.isolated:
            raise IsolationError(
                f"reward.code_isolation is required, but this node cannot isolate model-written code: "
                f"{self.protections.why_not}. The nodes that score code must allow {SITE_NEEDS}. Or set "
                "reward.code_isolation=best_effort to run it anyway with the limits that hold here "
                f"({', '.join(self.protections.layers)}): it can then read what this user can read and use "
                "the network"
            )

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
        # Its standard streams are memory files: its input sealed (reopened through /proc/self/fd/0, it cannot
        # be written), its output capped by the file-size limit; none shows a host path.
        streams: list[int] = [_sealed("stdin", stdin.encode())]
        passed: list[int] = []
        try:
            for name in ("stdout", "stderr"):
                streams.append(os.memfd_create(name))
            cmd, cwd, env, preexec = self._command(work, slot, source, passed)
            start = time.monotonic()
            proc = subprocess.Popen(
                cmd, stdin=streams[0], stdout=streams[1], stderr=streams[2], cwd=cwd, env=env,
                preexec_fn=preexec, start_new_session=True, pass_fds=passed,
            )  # fmt: skip
            code = self._wait(proc)
            secs = time.monotonic() - start
            out, err = (_read(fd, self.limits.file_mb) for fd in streams[1:])
        finally:
            for fd in streams + passed:
                os.close(fd)
        return Result(code, out, err, secs, _limit_of(code, err))

    def _command(self, work: Path, slot: int, source: str, passed: list[int]) -> tuple:
        """What runs `source`: the command, its working directory, environment and preexec_fn; the descriptors
        it inherits besides its standard streams are appended to `passed`."""
        argv = [self.python, "-I", "-S", "-B", "main.py"]
        if not self.protections.namespaces:
            # best effort: a folder of the host's temporary directory, whose total size nothing caps
            box = work / "box"
            box.mkdir(mode=0o700)
            (box / "main.py").write_text(source)
            return argv, box, ENV, self._limit_fallback
        spec = {
            "root": str(work / "root"), "uid": FIRST_UID + slot if self.protections.own_uid else None,
            "argv": argv, "env": ENV, "system": [*SYSTEM, self._prefix()], "source": source,
            "disk_mb": self.limits.disk_mb, "limits": self._rlimits(),
        }  # fmt: skip
        (work / "root").mkdir()
        # jail.py and its spec as sealed memory files: its command line shows their descriptors' numbers only.
        passed.append(_sealed("jail.py", JAIL_SOURCE))
        spec["script_fd"] = passed[0]
        passed.append(_sealed("spec", marshal.dumps(spec)))
        cmd = [*self._unshare(), self.python, "-I", "-S", "-B", f"/proc/self/fd/{passed[0]}", str(passed[1])]
        return cmd, None, {"PATH": ENV["PATH"]}, None

    def _wait(self, proc: subprocess.Popen) -> int | None:
        """Its exit code; None when a timer killed it at the wall-clock limit (wait(timeout=) polls: up to 50
        ms more a run). It is reaped only after its session is killed, so that no other process can have taken
        its pid."""
        expired = threading.Event()
        wall = self.limits.time_secs * 2 + 1.0
        timer = threading.Timer(wall, lambda: (expired.set(), _kill_group(proc)))
        timer.start()
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        finally:
            timer.cancel()
            timer.join()
            _kill_group(proc)  # what is left of its session
            code = proc.wait()
        return None if expired.is_set() else code

    def _rlimits(self) -> dict:
        mb = 1024 * 1024
        lim = self.limits
        return {
            "cpu_secs": max(1, round(lim.time_secs + 0.5)),  # soft; the hard limit a second later (SIGKILL)
            "memory_bytes": lim.memory_mb * mb,
            "file_bytes": lim.file_mb * mb,
            "threads": lim.threads,
            "open_files": lim.open_files,
        }

    def _limit_fallback(self) -> None:
        """preexec_fn without namespaces: one process where seccomp allows, and no thread limit (it would count
        every process of this user)."""
        limits = self._rlimits()
        del limits["threads"]
        jail.set_limits(limits)
        jail.restrict_system_calls()

    def _unshare(self) -> list[str]:
        cmd = [self._unshare_path, "--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts"]
        return [*cmd, "--user", "--map-root-user"] if self.user_namespace else cmd

    def _prefix(self) -> str:
        """The interpreter's installation (its binary and standard library)."""
        return os.path.dirname(os.path.dirname(self.python))

    def _take_slot(self) -> int:
        with self._lock:
            if not self._slots:
                raise RuntimeError(f"more than {SLOTS} sandboxed programs at once")
            return self._slots.pop(0)

    # --- what this machine allows ----------------------------------------------------------------------------

    def _probe(self) -> Protections:
        """Try the namespaces and the seccomp filter once, with a program that forks."""
        own_uid = not self.user_namespace
        why = "util-linux's unshare is not installed"
        if self._unshare_path is not None:
            self.protections = Protections(namespaces=True, own_uid=own_uid, one_process=True)
            probe = self.run(PROBE)
            if probe.returncode == 0 and probe.stdout in ("one process\n", "forked\n"):
                return self._layers(Protections(True, own_uid, probe.stdout == "one process\n"))
            last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            why = f"unshare failed: {last}"
        self.protections = Protections(namespaces=False, own_uid=False, one_process=True)
        fallback = self.run(PROBE)
        return self._layers(Protections(False, False, fallback.stdout == "one process\n", why_not=why))

    def _layers(self, p: Protections) -> Protections:
        """`p` with its layers and, where it is not isolated, why not."""
        lim = self.limits
        p.layers = ["clean environment", f"input read-only, output {lim.file_mb} MiB a stream (memory files)"]
        if p.one_process:
            p.layers += [
                f"one process (new processes refused), so its limits are the program's: {lim.memory_mb} MiB "
                f"of memory (no shared memory, memfds or message queues besides), {lim.time_secs:g} s of CPU",
                "no io_uring, BPF or keyrings", "sockets: unix, IPv4 and IPv6 only",
            ]  # fmt: skip
        else:
            # The kernel exempts root's processes from the process limit: root in a user namespace has none.
            counted = p.own_uid or os.geteuid() != 0
            cap = (
                f"at most {lim.threads} processes" if counted else "no process limit (root's are not counted)"
            )
            p.layers.append(
                f"memory and CPU limits per process ({lim.memory_mb} MiB, {lim.time_secs:g} s), {cap}"
            )
            p.why_not = p.why_not or "new processes are not refused (no seccomp filter here)"
        if p.namespaces:
            files = lim.disk_mb * jail.INODES_PER_MB
            p.layers += [
                f"{lim.disk_mb} MiB and {files} files written in all (its directory and /tmp)",
                "own root file system (read-only but for those two)",
                "no host path in sight but the interpreter's", "no network", "own PID namespace",
                "no capabilities", *(["own uid"] if p.own_uid else []),
            ]  # fmt: skip
        else:
            p.layers.append(f"a fresh directory, {lim.file_mb} MiB a file written (no cap on the total)")
            p.why_not += (
                "; the programs see the network, the file system (the run directory, home) and this user's "
                "processes"
            )
        return p


def own_uids_available(first: int = FIRST_UID, count: int = SLOTS) -> bool:
    """Whether this process may give programs the uids ``first`` .. ``first + count - 1``: root, with those uids
    mapped (not so for root in a user namespace that maps a few uids: enroot, rootless podman)."""
    if os.geteuid() != 0:
        return False
    return all(_mapped(Path(f"/proc/self/{ids}_map"), first, count) for ids in ("uid", "gid"))


def _mapped(map_file: Path, first: int, count: int) -> bool:
    """Whether ids first .. first + count - 1 are all inside one range of a /proc uid_map or gid_map."""
    for line in map_file.read_text().splitlines():
        inside, _, length = map(int, line.split())
        if inside <= first and first + count <= inside + length:
            return True
    return False


def _kill_group(proc: subprocess.Popen) -> None:
    """The whole session: unshare (whose --kill-child ends the namespace) or the bare program."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _sealed(name: str, data: bytes) -> int:
    """A memory file holding `data`, sealed: read from its start, it can never be written, grown or shrunk."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def _read(fd: int, cap_mb: int) -> str:
    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        return f.read(cap_mb * 1024 * 1024).decode(errors="replace")


def _limit_of(code: int | None, stderr: str) -> str | None:
    """Which limit ended a program, from how it ended."""
    if code is None or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
        return "time"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
        return "output"
    if "No space left on device" in stderr:
        return "disk"
    if "MemoryError" in stderr:
        return "memory"
    return None
