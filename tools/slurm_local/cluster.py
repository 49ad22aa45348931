#!/usr/bin/env python3
"""A real Slurm cluster on loopback, for tests and for users: four emulated nodes with fake GPUs.

    python3 tools/slurm_local/cluster.py up [--root DIR]      # start (installs Debian packages as root)
    source /tmp/areal-slurm/env && sinfo                        # use it (SLURM_CONF)
    python3 tools/slurm_local/cluster.py status|down [--root DIR]

Daemons start in order munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd -N n1..n4 and stop in reverse,
by the PID in each pid file. Every file (configs, logs, spool, sockets, pid files, the database) lives under
one root: $AREAL_SLURM_ROOT or /tmp/areal-slurm (short: unix socket paths must stay under 108 characters).
Ports are AREAL_SLURM_PORT_BASE (default 27100) + 0..2 and + 10..13, so two clusters need two bases.
Python standard library only: `up` runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template

CLUSTER_NAME = "areal"
NODES = ("n1", "n2", "n3", "n4")
DEFAULT_ROOT = "/tmp/areal-slurm"
DEFAULT_PORT_BASE = 27100  # below Linux's ephemeral range (32768+), above the well-known services
MARKER = "cluster.json"  # says that this script made the root, so `up` may wipe it
TEMPLATES = Path(__file__).resolve().parent / "templates"
# Daemons in start order; slurmd has one pid file per node.
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
BINARIES = (
    "munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld", "slurmd",
    "sinfo", "sbatch", "srun", "sacct", "sacctmgr", "scontrol", "scancel",
)  # fmt: skip
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")
APT_INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ClusterError(RuntimeError):
    """The cluster could not be started, or is in a state that forbids the request."""


@dataclass(frozen=True)
class Cluster:
    """A cluster's root; every client command needs env() (SLURM_CONF) to find it."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """SLURM_CONF and a PATH that holds the Slurm commands: merge into os.environ for a client."""
        path = os.environ.get("PATH", "")
        extra = [d for d in SBIN_PATH.split(":") if d not in path.split(":")]
        return {"SLURM_CONF": str(self.conf), "PATH": ":".join([path, *extra]).strip(":")}

    def full_env(self) -> dict[str, str]:
        """os.environ plus env(), less the caller's other SLURM_* variables (inside a job, srun would use
        that job's allocation)."""
        return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | self.env()

    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster and return its completed process (text)."""
        return subprocess.run(
            list(args), env=self.full_env(), capture_output=True, text=True,
            timeout=timeout, check=check, stdin=subprocess.DEVNULL,
        )  # fmt: skip


def default_root() -> Path:
    return Path(os.environ.get("AREAL_SLURM_ROOT") or DEFAULT_ROOT)


def default_port_base() -> int:
    return int(os.environ.get("AREAL_SLURM_PORT_BASE") or DEFAULT_PORT_BASE)


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-root PATH often lacks.
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def can_run() -> tuple[bool, str]:
    """Whether start() can work here; else the reason, for a skip message."""
    if not sys.platform.startswith("linux"):
        return False, "a local Slurm cluster needs Linux"
    missing = missing_binaries()
    if missing and (os.geteuid() != 0 or not shutil.which("apt-get")):
        return False, f"missing {' '.join(missing)}; install them as root with: {' '.join(APT_INSTALL)}"
    if os.geteuid() != 0:
        return False, "a local Slurm cluster needs root (slurmd launches jobs; fake GPUs need mknod)"
    return True, ""


def ensure_packages() -> None:
    """Install the Debian packages when a binary is missing (root and apt-get: see can_run)."""
    if not missing_binaries():
        return
    command = " ".join(APT_INSTALL)
    print(f"slurm_local: installing {' '.join(PACKAGES)} ...", flush=True)
    if _apt(APT_INSTALL) != 0 and (_apt(["apt-get", "update"]) != 0 or _apt(APT_INSTALL) != 0):
        raise ClusterError(f"`{command}` failed (see its output above)")
    if still := missing_binaries():
        raise ClusterError(f"still missing after install: {' '.join(still)}")


def _apt(args: list[str]) -> int:
    # No systemd here: a policy-rc.d that says no keeps the packages from starting system-wide daemons.
    policy = Path("/usr/sbin/policy-rc.d")
    made = not policy.exists()
    if made:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        return subprocess.run(args, env=env, stdin=subprocess.DEVNULL, timeout=900).returncode
    finally:
        if made:
            policy.unlink()


def _pid_files(root: Path, daemon: str) -> list[Path]:
    run = root / "run"
    if daemon == "slurmd":
        return sorted(run.glob("slurmd-*.pid"))
    return [run / f"{daemon}.pid"]


def _live_pid(pid_file: Path) -> int | None:
    """The PID in pid_file if that process lives and is the daemon the file is named after."""
    try:
        pid = int(pid_file.read_text().split()[0])
        proc = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, IndexError):
        return None
    comm, state = proc[proc.index("(") + 1 : proc.rindex(")")], proc[proc.rindex(")") + 2]
    # A zombie is dead (our own children, or under a PID 1 that does not reap); a recycled PID is not ours.
    if state == "Z" or comm != pid_file.stem.split("-")[0]:
        return None
    return pid


def live_daemons(root: Path | str) -> dict[str, int]:
    """Pid-file name -> PID, for every daemon of the cluster at root that is alive."""
    root = Path(root)
    found = {}
    for daemon in DAEMONS:
        for f in _pid_files(root, daemon):
            if (pid := _live_pid(f)) is not None:
                found[f.stem] = pid
    return found


def is_running(root: Path | str | None = None) -> bool:
    """True when any daemon of a cluster made by this script at root is alive."""
    root = Path(root or default_root())
    return (root / MARKER).exists() and bool(live_daemons(root))


def config_is_current(root: Path | str) -> bool:
    """Whether the cluster at root runs the slurm.conf that the templates give now (a cluster started
    before a template changed keeps its old settings until it is restarted)."""
    root = Path(root).absolute()
    try:
        base = json.loads((root / MARKER).read_text())["port_base"]
        running = (root / "etc" / "slurm.conf").read_text()
    except (OSError, ValueError, KeyError):
        return False
    return _settings(running) == _settings(_render(root, base)["slurm.conf"])


def _settings(conf: str) -> list[str]:
    return [line for line in conf.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def start(root: Path | str | None = None, port_base: int | None = None, timeout: float = 60.0) -> Cluster:
    """Start a fresh cluster at root and wait until its four nodes are idle and sacct answers."""
    root = Path(root or default_root()).absolute()
    if live := live_daemons(root):
        pids = ", ".join(f"{name} {pid}" for name, pid in live.items())
        raise ClusterError(
            f"a Slurm cluster is already running at {root} ({pids}); "
            f"stop it first: python3 {Path(__file__).resolve()} down --root {root}"
        )
    if root.exists() and any(root.iterdir()) and not (root / MARKER).exists():
        raise ClusterError(f"{root} exists and was not made by this script; remove it or pick another --root")
    if len(str(root)) > 70:  # slurmd's step sockets add ~30 characters; the limit is 108
        raise ClusterError(
            f"root {root} is too long: unix socket paths under it must stay under 108 characters"
        )
    ok, reason = can_run()
    if not ok:
        raise ClusterError(reason)
    ensure_packages()
    base = port_base if port_base is not None else default_port_base()
    ports = _ports(base)
    _check_ports_free(ports)
    shutil.rmtree(root, ignore_errors=True)  # a stale root: its daemons are dead
    _write_files(root, base)
    cluster = Cluster(root)
    try:
        _start_munge(cluster)
        _start_mariadb(cluster, timeout)
        _start_slurmdbd(cluster, timeout)
        _start_slurm(cluster, timeout)
    except BaseException:
        stop(root)
        raise
    return cluster


def _ports(base: int) -> dict[str, int]:
    ports = {"ctld": base, "dbd": base + 1, "db": base + 2}
    ports.update({node: base + 10 + i for i, node in enumerate(NODES)})
    return ports


def _check_ports_free(ports: dict[str, int]) -> None:
    for name, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemons do: TIME_WAIT is fine
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise ClusterError(
                    f"port {port} ({name}) is taken ({e.strerror}): another cluster? "
                    "Set AREAL_SLURM_PORT_BASE to another base"
                ) from e


def _render(root: Path, base: int) -> dict[str, str]:
    """The text of each configuration file of a cluster at root on ports from base."""
    ports = _ports(base)
    values = {
        "root": str(root),
        "cluster": CLUSTER_NAME,
        "host": socket.gethostname().split(".")[0],
        "ctld_port": ports["ctld"],
        "dbd_port": ports["dbd"],
        "db_port": ports["db"],
        "node_ports": f"{ports[NODES[0]]}-{ports[NODES[-1]]}",
    }
    names = ("slurm.conf", "gres.conf", "slurmdbd.conf", "my.cnf")
    return {name: Template((TEMPLATES / name).read_text()).substitute(values) for name in names}


def _write_files(root: Path, base: int) -> None:
    for sub in ("etc", "run", "log", "db", "dev", "spool/ctld", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text(json.dumps({"cluster": CLUSTER_NAME, "port_base": base}) + "\n")
    for name, text in _render(root, base).items():
        (root / "etc" / name).write_text(text)
    (root / "etc" / "slurmdbd.conf").chmod(0o600)  # slurmdbd refuses a readable file (it holds a password)
    for i in range(2):  # fake GPUs: character devices like /dev/null; a regular file is rejected
        os.mknod(root / "dev" / f"fakegpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (root / "env").write_text(f"export SLURM_CONF={root / 'etc' / 'slurm.conf'}\n")


def _daemon(cluster: Cluster, name: str, args: list[str]) -> None:
    """Run a command that daemonizes itself; its own output goes to log/NAME.out (a pipe would hang)."""
    out = cluster.root / "log" / f"{name}.out"
    with open(out, "ab") as f:
        try:
            rc = subprocess.run(
                args, env=cluster.full_env(), stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=60
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"{' '.join(args)} did not return within 60 s{_tail(out)}") from e
    if rc.returncode != 0:
        raise ClusterError(f"{' '.join(args)} exited with {rc.returncode}{_tail(out)}")


def _wait(what: str, ok: Callable[[], bool], timeout: float, log: Path, pid_file: Path | None = None) -> None:
    """Poll ok() until it holds; fail after timeout, or at once when the daemon's process has died."""
    deadline = time.monotonic() + timeout
    while not ok():
        if pid_file is not None and pid_file.exists() and _live_pid(pid_file) is None:
            raise ClusterError(f"{pid_file.stem} died while waiting for {what}{_tail(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}{_tail(log)}")
        time.sleep(0.1)


def _tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"\n(no log at {log})"
    return f"\n--- last lines of {log}:\n" + "\n".join(text)


def _succeeds(cluster: Cluster, *args: str) -> bool:
    try:
        return cluster.run(*args, timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _start_munge(cluster: Cluster) -> None:
    root = cluster.root
    key = root / "etc" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (root / "munge").mkdir(mode=0o711)
    (root / "munge").chmod(0o711)  # munged refuses a socket folder that is not world-executable
    args = [_which("munged"), f"--socket={root}/munge/munge.sock", f"--key-file={key}"]
    args += [f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log"]
    args += [f"--seed-file={root}/munge/munged.seed"]
    _daemon(cluster, "munged", args)


def _start_mariadb(cluster: Cluster, timeout: float) -> None:
    root = cluster.root
    cnf = f"--defaults-file={root}/etc/my.cnf"  # must be the first option
    log = root / "log" / "mariadbd.log"
    _daemon(cluster, "mariadb-install-db", [_which("mariadb-install-db"), cnf, "--skip-test-db"])
    # mariadbd stays in the foreground: setsid -f detaches it from us (and from pytest).
    _daemon(cluster, "mariadbd", ["setsid", "-f", _which("mariadbd"), cnf])
    pid_file = root / "run" / "mariadbd.pid"
    ping = ("mariadb", cnf, "-e", "SELECT 1")
    _wait("mariadbd to answer", lambda: _succeeds(cluster, *ping), timeout, log, pid_file)
    sql = (
        "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';"
        "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    )
    if not _succeeds(cluster, "mariadb", cnf, "-e", sql):
        raise ClusterError(f"could not create the slurm database user{_tail(log)}")


def _start_slurmdbd(cluster: Cluster, timeout: float) -> None:
    log = cluster.root / "log" / "slurmdbd.log"
    pid_file = cluster.root / "run" / "slurmdbd.pid"
    _daemon(cluster, "slurmdbd", [_which("slurmdbd")])
    # slurmctld registers with the database only when the cluster is known there; this also waits for slurmdbd.
    add = ("sacctmgr", "-i", "add", "cluster", CLUSTER_NAME)
    _wait("`sacctmgr add cluster`", lambda: _succeeds(cluster, *add), timeout, log, pid_file)


def _start_slurm(cluster: Cluster, timeout: float) -> None:
    log = cluster.root / "log" / "slurmctld.log"
    _daemon(cluster, "slurmctld", [_which("slurmctld")])
    for node in NODES:  # slurmd retries until slurmctld listens: no need to wait in between
        _daemon(cluster, f"slurmd-{node}", [_which("slurmd"), "-N", node])
    pid_file = cluster.root / "run" / "slurmctld.pid"
    _wait(f"sinfo to show {', '.join(NODES)} idle", lambda: _nodes_idle(cluster), timeout, log, pid_file)
    _wait("sacct to answer", lambda: _succeeds(cluster, "sacct", "-n", "-X"), timeout, log)


def _nodes_idle(cluster: Cluster) -> bool:
    try:
        out = cluster.run("sinfo", "-h", "-N", "-p", "all", "-o", "%N %t", timeout=30, check=False).stdout
    except subprocess.TimeoutExpired:
        return False
    states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
    return all(states.get(node) == "idle" for node in NODES)


def stop(root: Path | str | None = None, timeout: float = 10.0) -> list[str]:
    """Stop every daemon at root in reverse start order (TERM, then KILL after timeout); idempotent."""
    root = Path(root or default_root())
    stopped = []
    for daemon in reversed(DAEMONS):
        files = _pid_files(root, daemon)
        live = {f: pid for f in files if (pid := _live_pid(f)) is not None}
        _signal(live.values(), signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(_live_pid(f) for f in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal([pid for f, pid in live.items() if _live_pid(f)], signal.SIGKILL)
        stopped += [f.stem for f in live]
        for f in files:
            f.unlink(missing_ok=True)
    return stopped


def _signal(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended in between
            os.kill(pid, sig)


UP_MESSAGE = """Slurm cluster '{name}' is up at {root} in {seconds:.1f} s:
  nodes n1-n4 (4 CPUs, 4096 MB, gpu:2 each); partitions gen=n[1-2] (default), train=n[3-4], all=n[1-4],
  urgent=n[1-4] (PriorityTier=10)
Use it:  source {root}/env && sinfo
Stop it: python3 {me} down --root {root}"""


def status(root: Path | str | None = None) -> str:
    """Which daemons are alive, then sinfo when slurmctld is."""
    root = Path(root or default_root())
    live = live_daemons(root)
    names = ["munged", "mariadbd", "slurmdbd", "slurmctld", *(f"slurmd-{n}" for n in NODES)]
    lines = [
        f"{name:12} " + (f"alive, pid {live[name]}" if name in live else "not running") for name in names
    ]
    if live and not config_is_current(root):
        lines += ["", f"slurm.conf is older than {TEMPLATES}: restart the cluster (down, then up)"]
    if "slurmctld" in live:
        result = Cluster(root).run("sinfo", timeout=30, check=False)
        lines += ["", (result.stdout + result.stderr).rstrip()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--root", type=Path, default=None, help=f"cluster root (default: {default_root()})")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for each wait of `up`")
    args = parser.parse_args(argv)
    root = (args.root or default_root()).absolute()
    t0 = time.monotonic()
    try:
        if args.command == "up":
            start(root, timeout=args.timeout)
            seconds = time.monotonic() - t0
            print(
                UP_MESSAGE.format(name=CLUSTER_NAME, root=root, seconds=seconds, me=Path(__file__).resolve())
            )
        elif args.command == "down":
            stopped = ", ".join(stop(root)) or "nothing was running"
            print(f"stopped at {root} in {time.monotonic() - t0:.1f} s: {stopped}")
        else:
            print(status(root))
    except (ClusterError, subprocess.TimeoutExpired) as e:
        print(f"slurm_local: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
