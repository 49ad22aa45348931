"""Hostile programs against the sandbox's finer walls: memory the address-space limit does not count (SysV
shared memory, memfds, message queues, files beyond what a tmpfs's size counts), socket families beyond unix
and IP, io_uring, the keyrings, the root file system, its standard streams and the host's paths. Each escape
fails and the sandbox keeps serving, every way in: as root (a uid of its own per run), through a user
namespace, and as root in a user namespace (tests/test_sandbox.py runs this file again under `unshare --user
--map-root-user`, with its own)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from areal_hpc.reward import Limits, Sandbox

LIMITS = Limits(time_secs=1.0, memory_mb=64, disk_mb=8, file_mb=2, open_files=64)
MB = 1024 * 1024
REPO = str(Path(__file__).resolve().parents[1])
INNER = "AREAL_SANDBOX_TEST_LEG"  # set where tests/test_sandbox.py runs this file as root in a user namespace
LEGS = ["as root in a user namespace"] if os.environ.get(INNER) else ["as root", "in a user namespace"]
# The system calls the programs make by number (glibc wraps neither keys nor io_uring).
SYSCALLS = {
    "x86_64": {"add_key": 248, "keyctl": 250, "io_uring_setup": 425},
    "aarch64": {"add_key": 217, "keyctl": 219, "io_uring_setup": 425},
}[platform.machine()]

PRELUDE = """import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
"""

SYSV_SHM = f"""{PRELUDE}
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
held, chunk = 0, 32 * 2**20
for _ in range({2 * LIMITS.memory_mb // 32}):  # each segment filled, detached and kept: twice memory_mb
    shm = libc.shmget(0, chunk, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if shm < 0:
        break
    at = libc.shmat(shm, None, 0)
    ctypes.memset(at, 1, chunk)
    libc.shmdt(at)
    held += chunk
print('held', held >> 20, errno.errorcode.get(ctypes.get_errno()))
"""

MEMFDS = f"""import os
held, kept, block = 0, [], bytes({LIMITS.file_mb} * 2**20)
try:
    for _ in range({LIMITS.open_files}):  # one file_mb each, as many as open_files allows
        kept.append(os.memfd_create('hoard'))
        held += os.write(kept[-1], block)
except OSError as e:
    print(e.strerror)
print('held', held >> 20)
"""

EMPTY_FILES = f"""import os
made = 0  # each a KiB of kernel memory or so, which the size of a tmpfs does not count
try:
    while made < {2 * LIMITS.disk_mb * 1024}:
        os.close(os.open(f'/tmp/{{made}}', os.O_CREAT | os.O_WRONLY))
        made += 1
except OSError as e:
    print(e.strerror)
print('held', made >> 10)
"""

MESSAGE_QUEUES = f"""{PRELUDE}
mq_open = getattr(libc, 'mq_open', None) or ctypes.CDLL('librt.so.1', use_errno=True).mq_open
print('posix', mq_open(b'/hoard', os.O_CREAT | os.O_RDWR, 0o600, None))
print('sysv', libc.msgget(0, 0o1600))  # IPC_PRIVATE, IPC_CREAT | 0600
"""

SOCKETS = f"""{PRELUDE}
for family, kind in ((socket.AF_VSOCK, socket.SOCK_STREAM), (socket.AF_NETLINK, socket.SOCK_RAW)):
    for make in (socket.socket, socket.socketpair):
        try:
            make(family, kind)
            print(family, make.__name__, 'opened')
        except OSError as e:
            print(family, make.__name__, errno.errorcode[e.errno])
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
a, b = socket.socketpair(socket.AF_UNIX)
a.sendall(b'unix and IP sockets still work')
print(b.recv(100).decode())
"""

IO_URING = f"""{PRELUDE}
params = ctypes.create_string_buffer(120)  # struct io_uring_params
print('io_uring', libc.syscall(L({SYSCALLS["io_uring_setup"]}), L(8), params))
"""

KEY_LEFT = f"""{PRELUDE}
for ring in (-4, -3):  # the user keyring (its uid's), the session keyring (inherited)
    key = libc.syscall(L({SYSCALLS["add_key"]}), b'user', b'areal-hostile', b'from A', L(6), L(ring))
    if key > 0:  # gone in 30 s, should it be kept
        libc.syscall(L({SYSCALLS["keyctl"]}), L(15), L(key), L(30))  # KEYCTL_SET_TIMEOUT
    print('added', key)
"""

KEY_FOUND = f"""{PRELUDE}
for ring in (-4, -3):  # KEYCTL_SEARCH
    print('found', libc.syscall(L({SYSCALLS["keyctl"]}), L(10), L(ring), b'user', b'areal-hostile', L(0)))
"""

ROOT_WRITES = """import os
for path in ('/x', '/dev/x', '/usr/x', '/proc/x'):
    try:
        open(path, 'w').write('x')
        print(path, 'written')
    except OSError as e:
        print(path, type(e).__name__)
try:
    os.mkdir('/y')
    print('/y made')
except OSError as e:
    print('/y', type(e).__name__)
"""

STREAMS = f"""import os, sys
for flags in (os.O_WRONLY, os.O_RDWR):
    try:
        print('stdin written', os.write(os.open('/proc/self/fd/0', flags), b'x'))
    except OSError as e:
        print('stdin', e.strerror)
print('read', input())
sys.stdout.flush()
out = os.open('/proc/self/fd/1', os.O_WRONLY | os.O_APPEND)
for _ in range({2 * LIMITS.file_mb}):
    os.write(out, b'y' * 2**20)
"""

HOST_PATHS = """import os, sys
seen = [sys.executable, *sys.argv, *sys.path]
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    for name in ('cmdline', 'environ', 'mountinfo', 'maps'):
        try:
            seen.append(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace'))
        except OSError:
            pass
    links = ['cwd', 'root', 'exe']
    try:
        links += [f'fd/{fd}' for fd in os.listdir(f'/proc/{pid}/fd')]
    except OSError:
        pass
    for link in links:
        try:
            seen.append(os.readlink(f'/proc/{pid}/{link}'))
        except OSError:
            pass
print('\\n'.join(seen))
"""


@pytest.fixture(scope="module", params=LEGS)
def sandbox(request, tmp_path_factory) -> Sandbox:
    """The ways in, as tests/test_sandbox.py's; its work directories in a folder whose name tells."""
    if request.param == "as root" and os.geteuid() != 0:
        pytest.skip("needs root")
    work = str(tmp_path_factory.mktemp("hostile-work"))
    if request.param == "as root in a user namespace":
        box = Sandbox(LIMITS, workroot=work)
        assert box.user_namespace and not box.protections.own_uid
        return box
    return Sandbox(LIMITS, workroot=work, user_namespace=request.param != "as root")


def still_serving(sandbox: Sandbox) -> bool:
    return sandbox.run("print('still serving')").stdout == "still serving\n"


def held_mb(stdout: str) -> int:
    return int(next(line for line in stdout.splitlines() if line.startswith("held")).split()[1])


def test_sysv_shared_memory_cannot_hold_more_than_memory_mb(sandbox):
    result = sandbox.run(SYSV_SHM)
    assert held_mb(result.stdout) < LIMITS.memory_mb, result
    assert still_serving(sandbox)


def test_memfds_cannot_hold_more_than_memory_mb(sandbox):
    result = sandbox.run(MEMFDS)
    assert held_mb(result.stdout) < LIMITS.memory_mb, result
    assert still_serving(sandbox)


def test_empty_files_cannot_hold_more_kernel_memory_than_disk_mb(sandbox):
    result = sandbox.run(EMPTY_FILES)
    assert held_mb(result.stdout) < LIMITS.disk_mb, result
    assert still_serving(sandbox)


def test_no_message_queue_can_be_made(sandbox):
    result = sandbox.run(MESSAGE_QUEUES)
    assert result.stdout == "posix -1\nsysv -1\n", result
    assert still_serving(sandbox)


def test_sockets_are_unix_and_ip_only_no_vsock_to_the_hypervisor(sandbox):
    result = sandbox.run(SOCKETS)
    assert result.ok and "opened" not in result.stdout, result
    assert result.stdout.count("EAFNOSUPPORT") == 4, result
    assert result.stdout.endswith("unix and IP sockets still work\n")
    assert still_serving(sandbox)


def test_io_uring_is_refused(sandbox):
    assert sandbox.run(IO_URING).stdout == "io_uring -1\n"
    assert still_serving(sandbox)


def test_the_keyrings_are_refused_and_carry_nothing_to_the_next_program(sandbox):
    added = sandbox.run(KEY_LEFT)
    found = sandbox.run(KEY_FOUND)
    assert added.stdout == "added -1\nadded -1\n", added
    assert found.stdout == "found -1\nfound -1\n", found
    assert still_serving(sandbox)


def test_its_root_is_read_only_but_for_its_directory_and_tmp(sandbox):
    result = sandbox.run(ROOT_WRITES)
    assert result.ok and "written" not in result.stdout and "made" not in result.stdout, result
    assert sandbox.run("open('/tmp/a', 'w').write('x')\nopen('b', 'w').write('y')").ok
    assert still_serving(sandbox)


def test_its_standard_streams_reopened_reach_nothing_more(sandbox):
    """stdin cannot be written through /proc/self/fd/0; stdout reopened stops at file_mb as stdout does."""
    result = sandbox.run(STREAMS, stdin="given\n")
    assert "stdin written" not in result.stdout and "read given\n" in result.stdout, result
    assert len(result.stdout) <= LIMITS.file_mb * MB
    assert still_serving(sandbox)


def test_no_host_path_is_in_sight(sandbox):
    """Neither the checkout nor the work directories, in /proc's every command line, mount table, memory map
    and open file; the interpreter's prefix, bound read-only at its path, is the one host path it sees."""
    result = sandbox.run(HOST_PATHS)
    assert result.ok and "main.py" in result.stdout, result  # its own command line, read
    seen = result.stdout.replace(os.path.dirname(os.path.dirname(sandbox.python)), "<prefix>")
    for host in (REPO, sandbox.workroot, "sandbox-"):
        assert host not in seen, (host, seen)
    assert still_serving(sandbox)
