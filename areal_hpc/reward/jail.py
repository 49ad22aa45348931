"""The inside of a sandbox: run as the first process of fresh mount, PID, network, IPC and UTS namespaces (by
`unshare`, sandbox.py), it builds a root of its own and runs the program there without privileges.

    unshare --mount --pid --fork --kill-child --net --ipc --uts [--user --map-root-user] \\
        python -I -S -B jail.py SPEC

The root is a small tmpfs holding read-only binds of the system's program directories and the interpreter's
prefix; the program's directory (/sandbox, holding main.py) and /tmp share one tmpfs of `disk_mb`, the bytes it
may write; /proc of the new PID namespace and four device nodes: nothing of the run directory, the home
directories or the rest of the file system. The program is one process: a seccomp filter refuses every new
process (threads are allowed), so the limits of that process (address space, CPU time) are the whole
program's. `setpriv` runs it with no capabilities and no new privileges (as `uid` when started as root; else as
the user-namespace root, which maps to the caller and has no capability either).

Standard library only, and few modules of it: it runs under the bare interpreter once per test case, and
its start-up is most of a case's cost (SPEC is marshal's, as json would import `re`).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
DEVICES = ("null", "zero", "random", "urandom")
LIMITS = {  # spec key -> resource
    "cpu_secs": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "file_bytes": resource.RLIMIT_FSIZE,
    "threads": resource.RLIMIT_NPROC,  # the kernel counts threads; it does not apply it to root's (uid 0)
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


def scratch(root: str, spec: dict) -> None:
    """/sandbox (with main.py) and /tmp as two folders of one tmpfs: what the program writes, in all, is capped."""
    stage = place(root, "/.scratch", True)
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=755")
    home, tmp = stage + "/home", stage + "/tmp"
    os.mkdir(home, 0o700)
    os.mkdir(tmp)
    os.chmod(tmp, 0o1777)
    with open(home + "/main.py", "w") as f:
        f.write(spec["source"])
    if spec.get("uid") is not None:
        os.chown(home, spec["uid"], spec["uid"])
    bind(home, place(root, "/sandbox", True), writable=True)
    bind(tmp, place(root, "/tmp", True), writable=True)
    _libc.umount2(stage.encode(), MNT_DETACH)  # the two binds keep the tmpfs; its staging point goes
    os.rmdir(stage)


def build_root(spec: dict) -> str:
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for path in spec["system"]:  # /usr, /bin, ...: a symlink on the host is the same symlink here
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind(path, place(root, path, os.path.isdir(path)))
    scratch(root, spec)
    mount("proc", place(root, "/proc", True), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in DEVICES:
        mount(f"/dev/{name}", place(root, f"/dev/{name}", False), None, MS_BIND)
    return root


# --- one process a program -----------------------------------------------------------------------------------

# seccomp's view of a system call (struct seccomp_data): nr at 0, arch at 4, the first argument at 16.
_ARCHES = {  # machine -> (AUDIT_ARCH_*, system call numbers)
    "x86_64": (0xC000003E, {"clone": 56, "fork": 57, "vfork": 58, "clone3": 435}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435}),
}
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x10000
_X32_BIT = 0x40000000  # x86-64's x32 system calls: another numbering, refused


def bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One instruction of a seccomp program (struct sock_filter)."""
    return struct.pack("HBBI", code, jt, jf, k)


def _filter(arch: int, nr: dict[str, int]) -> bytes:
    """A seccomp program: clone only with CLONE_THREAD, no fork or vfork, clone3 'not implemented' (so that the
    C library falls back to clone for its threads), and no system call of another architecture."""
    ops = [bpf(_LD, 4), bpf(_JEQ, arch, jt=1), bpf(_RET, _ERRNO | _EPERM), bpf(_LD, 0)]
    ops += [bpf(_JGE, _X32_BIT, jf=1), bpf(_RET, _ERRNO | _EPERM)]
    ops += [bpf(_JEQ, nr["clone3"], jf=1), bpf(_RET, _ERRNO | _ENOSYS)]
    for name in ("fork", "vfork"):
        if name in nr:
            ops += [bpf(_JEQ, nr[name], jf=1), bpf(_RET, _ERRNO | _EPERM)]
    ops += [bpf(_JEQ, nr["clone"], jt=1), bpf(_RET, _ALLOW), bpf(_LD, 16)]
    ops += [bpf(_JSET, _CLONE_THREAD, jt=1), bpf(_RET, _ERRNO | _EPERM), bpf(_RET, _ALLOW)]
    return b"".join(ops)


class _Program(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def refuse_new_processes() -> bool:
    """From now on this process and what it executes may start threads but no process; False where the kernel or
    the architecture has no seccomp filter for it (the sandbox's probe then says the limits are per process)."""
    machine = os.uname().machine  # not the platform module: it imports re, a tenth of a case's start-up
    return machine in _ARCHES and install_filter(_filter(*_ARCHES[machine]))


def install_filter(code: bytes) -> bool:
    """Apply the seccomp program `code` (bpf instructions) to this process for good; False where refused."""
    program = _Program(len(code) // 8, code)
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which an unprivileged filter needs
        return False
    return _libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def set_limits(limits: dict) -> None:
    for key, which in LIMITS.items():
        value = limits.get(key)
        if value is not None:  # CPU: SIGXCPU at the limit, SIGKILL a second later
            resource.setrlimit(which, (value, value + 1 if key == "cpu_secs" else value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main(spec_path: str) -> None:
    with open(spec_path, "rb") as f:
        spec = marshal.load(f)
    os.chroot(build_root(spec))
    os.chdir("/sandbox")
    drop = ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if spec.get("uid") is not None:
        drop += [f"--reuid={spec['uid']}", f"--regid={spec['uid']}", "--clear-groups"]
    # The program is not this namespace's init, which the kernel spares the signals of the limits (SIGXCPU,
    # SIGXFSZ); once it ends, so does the init, and with it every thread it left.
    pid = os.fork()
    if pid == 0:
        set_limits(spec["limits"])
        refuse_new_processes()
        os.execve("/usr/bin/setpriv", ["setpriv", *drop, *spec["argv"]], spec["env"])
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1])
