"""The inside of a sandbox: run as the first process of fresh mount, PID, network, IPC and UTS namespaces (by
`unshare`, sandbox.py), it builds a root of its own and runs the program there without privileges.

    unshare --mount --pid --fork --kill-child --net --ipc --uts [--user --map-root-user] \\
        python -I -S -B /proc/self/fd/SCRIPT SPEC_FD

Its source and its SPEC come as sealed memory files (SCRIPT, SPEC_FD), so that no host path is on its command
line, which the program can read (/proc/1/cmdline); it closes both before the program starts.

The root is a small tmpfs, read-only once built, holding read-only binds of the system's program directories
and the interpreter's prefix; the program's directory (/sandbox, holding main.py) and /tmp share one tmpfs of
`disk_mb`, the only place it may write; /proc of the new PID namespace (its /proc/sys read-only) and four
device nodes: nothing of the run directory, the home directories or the rest of the file system. The program
is one process: a seccomp filter refuses every new process (threads are allowed), so the limits of that
process (address space, CPU time) are the whole program's; it also refuses the memory that the address-space
limit does not count (SysV IPC, POSIX message queues, memfds), io_uring, BPF and the keyrings, and sockets
other than unix, IPv4 and IPv6. `setpriv` runs it with no capabilities and no new privileges (as `uid` when
started as root; else as the user-namespace root, which maps to the caller and has no capability either).

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
# A file costs kernel memory that tmpfs's size does not count, about a KiB (its inode, dentry and extended
# attributes, links too); 64 a MiB of disk_mb keep that within a sixteenth of it.
INODES_PER_MB = 64
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
    """/sandbox (with main.py) and /tmp as two folders of one tmpfs: what the program writes, in all, is
    capped, and so is the number of its files."""
    stage = place(root, "/.scratch", True)
    size = spec["disk_mb"]
    options = f"size={size}m,nr_inodes={size * INODES_PER_MB},mode=755"
    mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, options)
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
    proc = place(root, "/proc", True)
    mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    bind(proc + "/sys", proc + "/sys")  # a user namespace's root could set its namespaces' sysctls
    for name in DEVICES:
        mount(f"/dev/{name}", place(root, f"/dev/{name}", False), None, MS_BIND)
    # Read-only for good: a user namespace's root owns it, and would write it outside disk_mb.
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return root


# --- one process a program, and the system calls it may not make ------------------------------------------

# seccomp's view of a system call (struct seccomp_data): nr at 0, arch at 4, the first argument's low 32 bits
# at 16 (both architectures are little-endian; the kernel reads a socket's family and clone's flag from them).
# Numbers from each architecture's table (asm/unistd_64.h; asm-generic/unistd.h for aarch64).
_ARCHES = {  # machine -> (AUDIT_ARCH_*, system call numbers)
    "x86_64": (0xC000003E, {
        "clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "socket": 41, "socketpair": 53,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
        "mq_getsetattr": 245, "memfd_create": 319, "memfd_secret": 447, "bpf": 321,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "add_key": 248, "request_key": 249, "keyctl": 250,
    }),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199,
        "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "memfd_create": 279, "memfd_secret": 447, "bpf": 280,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "add_key": 217, "request_key": 218, "keyctl": 219,
    }),
}  # fmt: skip
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..., BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97  # the same on both architectures
_CLONE_THREAD = 0x10000
_X32_BIT = 0x40000000  # x86-64's x32 system calls: another numbering, refused
_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6: not AF_VSOCK (the hypervisor), netlink, ...
# Refused outright, by the system call alone (robust on every kernel, where IPC-namespace sysctls are not):
_REFUSED = {
    "clone3": _ENOSYS,  # 'not implemented', so that the C library falls back to clone for its threads
    "fork": _EPERM,
    "vfork": _EPERM,
    # Memory the address-space limit does not count: SysV IPC, POSIX message queues, memory files, BPF maps.
    **dict.fromkeys(
        ("shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop"), _EPERM
    ),
    **dict.fromkeys(("msgget", "msgsnd", "msgrcv", "msgctl"), _EPERM),
    **dict.fromkeys(("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify"), _EPERM),
    **dict.fromkeys(("mq_getsetattr", "memfd_create", "memfd_secret", "bpf"), _EPERM),
    # io_uring's operations (sockets among them) go around this filter; EPERM as where the kernel disables it.
    **dict.fromkeys(("io_uring_setup", "io_uring_enter", "io_uring_register"), _EPERM),
    # A uid's keyring outlives its program, and the session keyring is the host's: channels between programs.
    **dict.fromkeys(("add_key", "request_key", "keyctl"), _EPERM),
}


def bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One instruction of a seccomp program (struct sock_filter)."""
    return struct.pack("HBBI", code, jt, jf, k)


def _filter(arch: int, nr: dict[str, int]) -> bytes:
    """A seccomp program: no system call of another architecture, none of _REFUSED, clone only with
    CLONE_THREAD, sockets of _FAMILIES only."""
    ops = [bpf(_LD, 4), bpf(_JEQ, arch, jt=1), bpf(_RET, _ERRNO | _EPERM), bpf(_LD, 0)]
    ops += [bpf(_JGE, _X32_BIT, jf=1), bpf(_RET, _ERRNO | _EPERM)]
    for name, err in _REFUSED.items():
        if name in nr:
            ops += [bpf(_JEQ, nr[name], jf=1), bpf(_RET, _ERRNO | err)]
    threads_only = [bpf(_JSET, _CLONE_THREAD, jt=1), bpf(_RET, _ERRNO | _EPERM), bpf(_RET, _ALLOW)]
    ops += _by_first_argument(nr["clone"], threads_only)
    for name in ("socket", "socketpair"):
        ops += _by_first_argument(nr[name], _one_of(_FAMILIES, _EAFNOSUPPORT))
    return b"".join([*ops, bpf(_RET, _ALLOW)])


def _by_first_argument(number: int, checks: list[bytes]) -> list[bytes]:
    """`checks` (each path ending in a return) on the first argument of system call `number`; other calls jump
    past them, still holding their number."""
    return [bpf(_JEQ, number, jf=len(checks) + 1), bpf(_LD, 16), *checks]


def _one_of(values: tuple[int, ...], err: int) -> list[bytes]:
    """Allow when the loaded value is one of `values`, else fail with `err`."""
    n = len(values)
    return [
        *(bpf(_JEQ, v, jt=n - i) for i, v in enumerate(values)),
        bpf(_RET, _ERRNO | err),
        bpf(_RET, _ALLOW),
    ]


class _Program(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def restrict_system_calls() -> bool:
    """From now on this process and what it executes may start threads but no process, nor make the calls of
    _REFUSED or sockets beyond _FAMILIES; False where the kernel or the architecture has no seccomp filter for
    it (the sandbox's probe then says the limits are per process)."""
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


def main(spec_fd: int) -> None:
    with open(spec_fd, "rb") as f:
        spec = marshal.load(f)
    os.close(spec["script_fd"])  # this file, which the interpreter has read: the program inherits neither
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
        restrict_system_calls()
        os.execve("/usr/bin/setpriv", ["setpriv", *drop, *spec["argv"]], spec["env"])
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
