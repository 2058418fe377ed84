"""Read-only mappings of whole model files that hold no file descriptor, and the check
that a model's mappings fit in vm.max_map_count.

Python's mmap.mmap keeps a dup() of the descriptor for the mapping's life (until Python
3.13's trackfd=False). A model maps one file per expert -- DeepSeek-V3's 58 x 256 =
14,848 -- so under the usual RLIMIT_NOFILE of 1,024 (whose hard limit an unprivileged
process cannot raise) loading failed with EMFILE at about the 1,000th expert. mmap(2)
needs no descriptor once it has returned: `FileMapping` maps through libc, and the
caller closes its descriptor at once. The mapping is unmapped when the last numpy view
of it is gone (numpy keeps the object exporting `__array_interface__` as the views' base).

Every mapped file is one entry of the kernel's per-process map table, capped by
vm.max_map_count (65,530 by default). `check_map_count` refuses, before anything is
mapped, a model that would not fit, in one line naming the limit and the ways out.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Optional

from ..errors import ModelFormatError
from ..memstat import _lib, madvise

_MAP_FAILED = ctypes.c_void_p(-1).value
# mappings the process makes besides the model's files (libraries, arenas, thread
# stacks, the budget's frames, hot-plugged experts): kept free under vm.max_map_count
MAP_HEADROOM = 4096


def _libc():
    lib = _lib()
    if not getattr(lib, "_colibri_mmap", False):
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.munmap.restype = ctypes.c_int
        lib._colibri_mmap = True
    return lib


class FileMapping:
    """A shared read-only mapping of `size` bytes of the file open as `fd` (the
    descriptor may be closed right after). np.asarray(mapping) is a uint8 view of it;
    `madvise(advice)` advises the whole range; it is unmapped once neither this object
    nor any view of it is referenced."""

    __slots__ = ("address", "size", "__array_interface__")

    def __init__(self, fd: int, size: int):
        addr = _libc().mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            e = ctypes.get_errno() or errno.EINVAL
            raise OSError(e, os.strerror(e))
        self.address, self.size = int(addr), int(size)
        self.__array_interface__ = {"data": (self.address, True), "shape": (self.size,),
                                    "typestr": "|u1", "version": 3}

    def madvise(self, advice: int) -> None:
        """Best effort, like mmap.mmap.madvise's callers here (old kernels lack some)."""
        madvise(self.address, -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE, advice)

    def __del__(self):
        if self.address:
            _libc().munmap(self.address, self.size)
            self.address = 0


def max_map_count() -> Optional[int]:
    """vm.max_map_count (None where it cannot be read: not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def map_count() -> Optional[int]:
    """The mappings this process has now (lines of /proc/self/maps)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def check_map_count(files: int, what: str, limit: Optional[int] = None,
                    used: Optional[int] = None) -> None:
    """Raise ModelFormatError (one line) when mapping `files` more files, beside the
    process's current mappings and MAP_HEADROOM, would exceed vm.max_map_count."""
    limit = max_map_count() if limit is None else limit
    used = map_count() if used is None else used
    if limit is None or used is None:
        return
    need = used + files + MAP_HEADROOM
    if need > limit:
        raise ModelFormatError(
            f"{what}: mapping its {files:,} files needs about {need:,} memory mappings "
            f"(the process has {used:,}, plus {MAP_HEADROOM:,} kept free) but "
            f"vm.max_map_count is {limit:,}; raise it (sysctl -w vm.max_map_count="
            f"{max(need * 2, 65530)}), or load with load_mode 'copy' and a memory budget "
            f"(max_resident_mb), which maps no expert file")
