"""The first process of an agent program's namespaces (agent.programs starts it per episode, through `unshare`):

    unshare --mount --pid --fork --kill-child --mount-proc [--user --map-root-user] \\
        python -I -S -B program_init.py FD         # FD: a pipe that holds the spec, JSON

It covers each of the spec's ``hide`` paths (the run directory) with an empty read-only tmpfs; as root, makes
each ``reveal`` path (the interpreter, the program, its HOME) reachable by the program's own ``uid`` where a
private directory above it (/root) bars the way; then runs the program under `setpriv`, without capabilities
or new privileges (as ``uid`` when given), waits for it and exits with its exit code. It is the PID namespace's
init: when it exits the kernel kills every process left in the namespace, so nothing the program started
outlives it. The program is not the init, whose default-action signals the kernel ignores.

Standard library only: it runs under the bare interpreter once per episode.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC = 1, 2, 4, 8, 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def hide(path: str) -> None:
    """An empty read-only tmpfs over ``path``: the mounts the program inherits from here are locked to it."""
    if os.path.isdir(path):
        mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")


def reveal(path: str, fd: int) -> None:
    """Make ``path`` reachable by any uid: the first directory above it that others cannot search is covered by
    a small tmpfs in which the way down is made, and ``path`` is bound there from ``fd`` (opened before any
    cover). Only the way is opened: what ``path`` holds keeps its own permissions."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts)):
        above = "/" + "/".join(parts[:depth])
        if not os.path.lexists(above):  # under a cover made here
            os.mkdir(above, 0o755)
        elif not os.stat(above).st_mode & stat.S_IXOTH:
            mount("tmpfs", above, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    if os.path.lexists(path):  # no cover on the way: reachable as it is
        return
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.mkdir(path, 0o755)
    else:
        open(path, "w").close()  # noqa: SIM115 (a mount point)
    mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)


def drop(uid: int | None) -> list[str]:
    """setpriv's options: no capability, no new privilege, and ``uid`` with no groups when given."""
    out = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    return out + [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else out


def main(spec_fd: int) -> None:
    with os.fdopen(spec_fd) as f:
        spec = json.load(f)
    fds = {path: os.open(path, os.O_PATH) for path in spec["reveal"] if os.path.exists(path)}
    for path in spec["hide"]:
        hide(path)
    for path, fd in fds.items():
        reveal(path, fd)
        os.close(fd)
    try:  # the role's working directory, seen through the mounts above (unless hidden: then HOME)
        os.chdir(os.getcwd())
    except OSError:
        os.chdir(spec["env"]["HOME"])
    pid = os.fork()
    if pid == 0:
        os.execve(spec["setpriv"], ["setpriv", *drop(spec["uid"]), *spec["argv"]], spec["env"])
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]))
    except OSError as exc:  # the program never ran: say why in its stderr, which the episode's log keeps
        print(f"program_init: {exc}", file=sys.stderr)
        os._exit(125)
