"""The isolated helper's sandbox: a seccomp filter installed before the expert is loaded
(so its constructors run under it too), and no descriptor it does not need.

The filter is a small BPF program built here and installed with prctl/seccomp through
ctypes (no library, nothing to compile). It is a deny list, so that the helper's own
interpreter and an expert's ordinary code (memory, threads, futexes, reading its own
file) are untouched; what it denies kills the helper with SIGSYS (SECCOMP_RET_KILL_PROCESS:
no handler can catch or skip it), the engine reads that as the expert's death and
removes it ("killed by SIGSYS: the sandbox refused a system call").

Denied: signals to any other process (kill, tkill, tgkill but to itself, sigqueue,
pidfd_*), ptrace and
reading or writing another process's memory, every socket call, new processes (fork,
vfork, execve, clone without CLONE_THREAD; clone3 answers ENOSYS so that threads fall
back to clone), creating, renaming, deleting or changing files and folders, mounts and
namespaces, modules, bpf, perf, io_uring, keys, userfaultfd, TIOCSTI. Opening files: while
the expert is loaded only the way dlopen opens a library (openat with exactly
O_RDONLY|O_CLOEXEC, which also lets it load the libraries it links); once it is loaded,
a second filter denies every open. Limits: docs/HOTPLUG.md, section 5.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
CLONE_THREAD = 0x00010000
TIOCSTI = 0x5412
O_RDONLY_CLOEXEC = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0o2000000)
ENOSYS = 38

RET_KILL = 0x80000000            # SECCOMP_RET_KILL_PROCESS
RET_ALLOW = 0x7FFF0000
RET_ENOSYS = 0x00050000 | ENOSYS  # SECCOMP_RET_ERRNO | ENOSYS

# x86-64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl)
NR = {
    "open": 2, "ioctl": 16, "socket": 41, "connect": 42, "accept": 43, "sendto": 44,
    "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "bind": 49, "listen": 50,
    "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62,
    "truncate": 76, "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86,
    "unlink": 87, "symlink": 88, "chmod": 90, "chown": 92, "lchown": 94, "ptrace": 101,
    "rt_sigqueueinfo": 129, "mknod": 133, "personality": 135, "pivot_root": 155,
    "chroot": 161, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168,
    "reboot": 169, "init_module": 175, "delete_module": 176, "tkill": 200, "tgkill": 234,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "mkdirat": 258,
    "mknodat": 259, "fchownat": 260, "unlinkat": 263, "renameat": 264, "linkat": 265,
    "symlinkat": 266, "fchmodat": 268, "unshare": 272, "openat": 257, "accept4": 288,
    "rt_tgsigqueueinfo": 297, "perf_event_open": 298, "recvmmsg": 299,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "sendmmsg": 307, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
    "renameat2": 316, "seccomp": 317, "bpf": 321, "execveat": 322, "userfaultfd": 323,
    "pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "pidfd_open": 434, "clone3": 435, "openat2": 437,
    "pidfd_getfd": 438,
}
SPECIAL = {"clone", "openat", "ioctl", "clone3", "openat2", "seccomp", "kill", "tkill",
           "tgkill"}
DENIED = sorted(set(NR) - SPECIAL)


def supported() -> bool:
    """The filter is written for Linux on x86-64 (elsewhere the helper runs without it,
    and says so: docs/HOTPLUG.md)."""
    return os.name == "posix" and platform.system() == "Linux" and \
        platform.machine() in ("x86_64", "AMD64")


# ----------------------------------------------------------------------------- BPF
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_NR_OFF, _ARCH_OFF = 0, 4


def _arg_off(i: int) -> int:
    return 16 + 8 * i            # low 32 bits of seccomp_data.args[i] (little-endian)


def _program(after_load: bool) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) instructions. Jumps are relative; every branch ends in a return."""
    p = [(_LD_W_ABS, 0, 0, _ARCH_OFF), (_JEQ_K, 1, 0, AUDIT_ARCH_X86_64), (_RET_K, 0, 0, RET_KILL),
         (_LD_W_ABS, 0, 0, _NR_OFF), (_JGE_K, 0, 1, X32_SYSCALL_BIT), (_RET_K, 0, 0, RET_KILL)]
    if after_load:               # stacked on the first: no file is opened any more
        p += [(_JEQ_K, 0, 1, NR["openat"]), (_RET_K, 0, 0, RET_KILL)]
        return p + [(_RET_K, 0, 0, RET_ALLOW)]

    def arg_rule(nr: int, arg: int, test: int, value: int, hit: int, miss: int):
        # if nr: load args[arg]; (test value) ? hit : miss; the next rule reloads nr
        return [(_JEQ_K, 0, 4, nr), (_LD_W_ABS, 0, 0, _arg_off(arg)),
                (test, 0, 1, value), (_RET_K, 0, 0, hit), (_RET_K, 0, 0, miss)]
    p += arg_rule(NR["clone"], 0, _JSET_K, CLONE_THREAD, RET_ALLOW, RET_KILL)
    p.append((_LD_W_ABS, 0, 0, _NR_OFF))
    p += arg_rule(NR["openat"], 2, _JEQ_K, O_RDONLY_CLOEXEC, RET_ALLOW, RET_KILL)
    p.append((_LD_W_ABS, 0, 0, _NR_OFF))
    p += arg_rule(NR["ioctl"], 1, _JEQ_K, TIOCSTI, RET_KILL, RET_ALLOW)
    p.append((_LD_W_ABS, 0, 0, _NR_OFF))
    # signals to itself only (abort() is tgkill(own pid): it still dies of SIGABRT, with
    # that reason); any other pid, 0 (its group) or -1 (everyone) is denied
    for name in ("kill", "tkill", "tgkill"):
        p += arg_rule(NR[name], 0, _JEQ_K, os.getpid(), RET_ALLOW, RET_KILL)
        p.append((_LD_W_ABS, 0, 0, _NR_OFF))
    for name in ("clone3", "openat2"):
        p += [(_JEQ_K, 0, 1, NR[name]), (_RET_K, 0, 0, RET_ENOSYS)]
    for name in DENIED:
        p += [(_JEQ_K, 0, 1, NR[name]), (_RET_K, 0, 0, RET_KILL)]
    return p + [(_RET_K, 0, 0, RET_ALLOW)]


def _install(program: list) -> None:
    raw = b"".join(struct.pack("<HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(program), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:                   # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(NR["seccomp"]), ctypes.c_long(1), ctypes.c_long(0),
                    ctypes.byref(prog)) != 0:              # SECCOMP_SET_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER) failed")


def install_before_load() -> None:
    """The first filter: what the expert may never do; opening files only as dlopen does."""
    _install(_program(after_load=False))


def install_after_load() -> None:
    """The second filter, once the expert is loaded: no more opens at all."""
    _install(_program(after_load=True))


def close_other_fds(keep: set) -> None:
    """Close every descriptor but `keep` (the helper's pipes, the shared buffer, stderr)."""
    for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass                 # the listing's own descriptor, closed already
