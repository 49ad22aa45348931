"""The inside of a sandbox: run as the first process of fresh mount, PID, network, IPC and UTS namespaces (by
`unshare`, sandbox.py), it builds a root of its own and runs the program there without privileges.

    unshare --mount --pid --fork --kill-child --net --ipc --uts [--user --map-root-user] \\
        python -I -S -B jail.py SPEC

The root is a small tmpfs holding read-only binds of the system's program directories and the interpreter's
prefix, the program's directory read-write at /sandbox, a tmpfs /tmp, /proc of the new PID namespace and four
device nodes: nothing of the run directory, the home directories or the rest of the file system. Then the
resource limits, and `setpriv` runs the program with no capabilities and no new privileges (as `uid` when
started as root; else as the user-namespace root, which maps to the caller and has no capability either).

Standard library only, and few modules of it: it runs under the bare interpreter once per test case, and
its start-up is most of a case's cost (SPEC is marshal's, as json would import `re`).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
DEVICES = ("null", "zero", "random", "urandom")
LIMITS = {  # spec key -> resource
    "cpu_secs": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "file_bytes": resource.RLIMIT_FSIZE,
    "processes": resource.RLIMIT_NPROC,
    "open_files": resource.RLIMIT_NOFILE,
}
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def bind(source: str, target: str, writable: bool = False) -> None:
    """`source` at `target`; read-only unless `writable` (a remount, keeping the flags user namespaces lock)."""
    mount(source, target, None, MS_BIND | MS_REC)
    locked = os.statvfs(source).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC)  # ST_* match MS_* here
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | locked | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def place(root: str, path: str, is_dir: bool) -> str:
    """`path` made inside `root` (a directory or an empty file to mount over); returns it."""
    target = root + path
    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not is_dir and not os.path.exists(target):
        open(target, "w").close()  # noqa: SIM115
    return target


def build_root(spec: dict) -> str:
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for path in spec["system"]:  # /usr, /bin, ...: a symlink on the host is the same symlink here
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind(path, place(root, path, os.path.isdir(path)))
    bind(spec["workdir"], place(root, "/sandbox", True), writable=True)
    mount(
        "tmpfs", place(root, "/tmp", True), "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['tmp_mb']}m,mode=1777"
    )
    mount("proc", place(root, "/proc", True), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in DEVICES:
        mount(f"/dev/{name}", place(root, f"/dev/{name}", False), None, MS_BIND)
    return root


def main(spec_path: str) -> None:
    with open(spec_path, "rb") as f:
        spec = marshal.load(f)
    os.chroot(build_root(spec))
    os.chdir("/sandbox")
    for key, which in LIMITS.items():
        value = spec["limits"].get(key)
        if value is not None:  # CPU: SIGXCPU at the limit, SIGKILL a second later
            resource.setrlimit(which, (value, value + 1 if key == "cpu_secs" else value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    drop = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if spec.get("uid") is not None:
        drop += [f"--reuid={spec['uid']}", f"--regid={spec['uid']}", "--clear-groups"]
    # The program is not this namespace's init, which the kernel spares the signals of the limits (SIGXCPU,
    # SIGXFSZ); once it ends, so does the init, and with it every process it left.
    pid = os.fork()
    if pid == 0:
        os.execve("/usr/bin/setpriv", ["setpriv", *drop, *spec["argv"]], spec["env"])
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1])
