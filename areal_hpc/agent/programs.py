"""Where an agent program (rollout.agent_command) runs: in mount and PID namespaces of its own (program_init.py
is their init), as a uid of its own when root, with an allowlisted environment; docs/agents.md, "What an agent
program can and cannot reach".

    jail = ProgramJail(["my-agent", "--fast"], hidden=[run_dir], isolation="required")
    with jail.seat() as seat:                      # its uid (as root), its own HOME and TMPDIR
        proc = await jail.start(seat, program_env(os.environ, ["MY_VAR"], {"OPENAI_API_KEY": key, ...}))

In its namespaces no other episode's process (its key) nor the role's is visible, the run directory (its secret)
is an empty tmpfs, and everything it started dies with it. Where the node cannot give the namespaces,
isolation="required" raises AgentIsolationError (before the run, and at the rollout role's start);
"best_effort" runs the program as it is, with a warning that says what it can reach.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import InputError
from areal_hpc.reward import own_uids_available

logger = logging.getLogger("rollout")
BASE_ENV = ("PATH", "LANG", "LC_ALL")  # what any program needs of the role's environment
ISOLATION = ("required", "best_effort")
INIT = Path(__file__).with_name("program_init.py")
# As root, programs run as uids FIRST_UID .. FIRST_UID + UIDS - 1 (the code sandbox's are 61000 .. 61255).
FIRST_UID, UIDS = 62000, 2048
UID_LOCKS = Path("/run/areal-hpc/agent-uids")
SITE_NEEDS = (
    "util-linux's unshare and setpriv, and mount and PID namespaces: as root, or through user namespaces for "
    "unprivileged users (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 on Debian's "
    "kernels; on Ubuntu >= 23.10 kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile that "
    "lets util-linux's unshare make them; containers that allow nested namespaces and a fresh /proc) "
    "(docs/agents.md)"
)
EXPOSED = (
    "each program then runs as this user in the node's PID namespace, and can read what this user can read (the "
    "run directory and its secret among it), the command lines and environments of this user's processes (other "
    "episodes' keys among them), and leave processes running after its episode that called setsid()"
)


class AgentError(RuntimeError):
    """The user's agent (a function or a program) failed its episode: its group is dropped (agent_error).
    ``cause``: the message without what differs from one episode to the next (where its output is, the value
    it returned), so that the same failure of many episodes is counted as one cause."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause or message


def program_env(environ: Mapping[str, str], names: Sequence[str], own: dict[str, str]) -> dict[str, str]:
    """An agent program's environment: the base it needs (PATH, the locale), the role's OPENAI_* variables and
    those rollout.agent_env names, then ``own`` (its endpoint, key, model, HOME and TMPDIR) over them. Nothing
    else: the role's credentials (HF_TOKEN, WANDB_API_KEY, ...) stay in the role."""
    kept = {k: v for k, v in environ.items() if k in BASE_ENV or k.startswith("OPENAI_") or k in names}
    return {**kept, **own}


class AgentIsolationError(InputError):
    """rollout.agent_isolation is required and this node cannot isolate agent programs; the message says what
    the site must allow and how to opt out."""


@dataclass(frozen=True)
class Seat:
    """One program's place: its uid (None: the role's) and its own HOME and TMPDIR."""

    uid: int | None
    home: Path
    tmp: Path


class ProgramJail:
    """How this rollout process starts agent programs: each in mount and PID namespaces of its own (program_init.py
    is their init), as a uid of its own when root, where the node allows; else, with best_effort, as it is."""

    def __init__(self, argv: list[str], hidden: Sequence[Path], isolation: str):
        if isolation not in ISOLATION:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION)}, got {isolation!r}")
        self.argv, self.hidden = argv, [os.path.realpath(p) for p in hidden]
        self.unshare, self.setpriv = shutil.which("unshare"), shutil.which("setpriv")
        self.uids = UidPool() if own_uids_available(FIRST_UID, UIDS) else None
        self.isolated = True  # for the probe's run
        why_not = self._probe()
        self.isolated = not why_not
        if why_not:
            why = f"this node cannot isolate agent programs: {why_not}. The rollout's nodes must allow {SITE_NEEDS}"
            _refuse_or_warn(isolation, why, EXPOSED)
        elif open_dir := self._open_run_dir():
            _refuse_or_warn(
                isolation, open_dir, "the tmpfs over it still hides it from them, not from other users"
            )

    @contextmanager
    def seat(self) -> Iterator[Seat]:
        """A uid (as root, isolated) and a fresh HOME and TMPDIR owned by it, for one program; removed after."""
        uid, lock = self.uids.take() if self.uids and self.isolated else (None, None)
        top = Path(tempfile.mkdtemp(prefix="areal-agent-"))
        try:
            seat = Seat(uid, top / "home", top / "tmp")
            for folder in (seat.home, seat.tmp):
                folder.mkdir(mode=0o700)
                if uid is not None:
                    os.chown(folder, uid, uid)
            top.chmod(0o711 if uid is not None else 0o700)  # its uid passes through to them, lists nothing
            yield seat
        finally:
            _remove(top)
            if lock is not None:
                os.close(lock)

    async def start(self, seat: Seat, env: dict[str, str]) -> asyncio.subprocess.Process:
        pipe = asyncio.subprocess.PIPE
        pipes = {"stdin": pipe, "stdout": pipe, "stderr": pipe}
        if not self.isolated:
            return await asyncio.create_subprocess_exec(*self.argv, env=env, start_new_session=True, **pipes)
        spec = self._spec_pipe(self.argv, seat, env)
        try:
            return await asyncio.create_subprocess_exec(
                *self._init(spec), env={}, start_new_session=True, pass_fds=(spec,), **pipes
            )
        finally:
            os.close(spec)

    def _init(self, spec_fd: int) -> list[str]:
        """unshare's line: new mount and PID namespaces (and a user namespace unless root with uids to give), a
        /proc of their own, the init killed with unshare; the network stays (the endpoint is on 127.0.0.1)."""
        cmd = [self.unshare, "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
        cmd += [] if self.uids else ["--user", "--map-root-user"]
        return [*cmd, sys.executable, "-I", "-S", "-B", str(INIT), str(spec_fd)]

    def _spec_pipe(self, argv: list[str], seat: Seat, env: dict[str, str]) -> int:
        """The read end of a pipe holding what program_init.py does (not on its command line, which the program
        can read): the run directory hidden; as root, the paths the program needs made reachable."""
        reveal = self._reveal(argv, seat) if seat.uid is not None else []
        data = json.dumps({"argv": argv, "env": env, "setpriv": self.setpriv, "uid": seat.uid,
                           "hide": self.hidden, "reveal": reveal}).encode()  # fmt: skip
        read, write = os.pipe()
        try:
            with suppress(OSError):  # a larger pipe where allowed (1 MiB is the default maximum)
                fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 1 << 20)
            os.set_blocking(write, False)
            if os.write(write, data) != len(data):
                raise BlockingIOError
        except BlockingIOError:
            os.close(read)
            raise AgentError(f"the agent program's environment is too large ({len(data)} bytes)") from None
        finally:
            os.close(write)
        return read

    def _reveal(self, argv: list[str], seat: Seat) -> list[str]:
        """What a program of its own uid needs to reach: this interpreter (its prefix and the venv's), the
        working directory, the files its command line names, its HOME and TMPDIR; never inside a hidden path."""
        named = [shutil.which(argv[0]) or argv[0], *argv[1:]]
        paths = [sys.prefix, sys.base_prefix, os.getcwd(), seat.home, seat.tmp]
        paths += [os.path.realpath(w) for w in named if w and os.path.exists(w)]
        real = {os.path.realpath(p) for p in paths}
        return sorted(p for p in real if not any(_under(p, h) for h in self.hidden))

    def _probe(self) -> str:
        """Why agent programs cannot be isolated here ('' when they can): one run of the init with a program that
        does nothing, as an episode's would run."""
        for tool, path in (("unshare", self.unshare), ("setpriv", self.setpriv)):
            if path is None:
                return f"util-linux's {tool} is not installed"
        probe = [sys.executable, "-I", "-S", "-c", ""]
        try:
            with self.seat() as seat:
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(seat.home)}
                spec = self._spec_pipe(probe, seat, env)
                try:
                    run = subprocess.run(self._init(spec), env={}, pass_fds=(spec,), stdin=subprocess.DEVNULL,
                                         capture_output=True, text=True, timeout=60)  # fmt: skip
                finally:
                    os.close(spec)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the namespaces could not be tried: {exc}"
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1]
            return f"unshare failed: {last}"
        return ""

    def _open_run_dir(self) -> str:
        """As root the program's own uid is kept out of the run directory by its mode (0700, as RunDir makes it),
        besides the tmpfs over it: what is wrong with that ('' when nothing)."""
        for path in self.hidden if self.uids else []:
            mode = os.stat(path).st_mode & 0o777 if os.path.isdir(path) else 0
            if mode & 0o077:
                return (
                    f"the run directory {path} is mode {mode:o}, open to other users, the programs' own uids "
                    "among them: chmod 700 it"
                )
        return ""


def _refuse_or_warn(isolation: str, why: str, anyway: str) -> None:
    if isolation == "required":
        raise AgentIsolationError(
            f"rollout.agent_isolation is required, but {why}. Or set rollout.agent_isolation=best_effort to run "
            f"the programs anyway: {anyway}"
        )
    logger.warning("rollout.agent_isolation is best_effort and %s: %s", why, anyway)


class UidPool:
    """Uids of their own for agent programs, node-wide: a uid is taken by a lock on a file of its own in a folder
    only root writes, so the programs of every rollout process on the node get distinct ones, and a lock goes
    with its holder, even a killed one."""

    def __init__(self, folder: Path = UID_LOCKS, first: int = FIRST_UID, count: int = UIDS):
        self.folder, self.first, self.count, self._next = folder, first, count, 0

    def take(self) -> tuple[int, int]:
        """(a uid, the descriptor that holds it: closing it gives the uid back)."""
        self.folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        for i in range(self.count):
            uid = self.first + (self._next + i) % self.count
            fd = os.open(self.folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._next = (self._next + i + 1) % self.count
            return uid, fd
        raise AgentError(f"more than {self.count} agent programs at once on this node")


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _remove(top: Path) -> None:
    """A program's HOME and TMPDIR: as the user (no root's override) its folders are first made ours to empty."""
    if os.geteuid() != 0:
        for folder, dirs, _ in os.walk(top):
            for name in dirs:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    with suppress(OSError):
                        os.chmod(path, 0o700)
    shutil.rmtree(top, ignore_errors=True)
