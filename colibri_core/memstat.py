"""What the operating system says about memory: mincore residency of mapped ranges and of
files' page cache, dropping a file's cache, bytes really read (/proc/self/io), RSS.

Linux-specific; used by the memory budget (residency.py), the CLI's memory line, tests and
benchmarks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import mmap
import os
from typing import Optional

import numpy as np

PAGE = mmap.PAGESIZE
# madvise(2) advice (the mmap module lacks some on older Pythons): WILLNEED starts
# readahead, POPULATE_READ (Linux >= 5.14) maps the pages in, DONTNEED unmaps them,
# RANDOM turns off the read-around of a fault (read_ahead_kb around it).
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)         # no read-around on a fault
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

_libc = None


def _lib():
    """libc through ctypes: its calls release the GIL (mmap.madvise does not), so an I/O
    thread blocked in MADV_POPULATE_READ does not stall the forward loop."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.mincore.restype = ctypes.c_int
        _libc = lib
    return _libc


def madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of a failed madvise(2) on [addr, addr+length) (page aligned)."""
    if _lib().madvise(addr, length, advice) != 0:
        return ctypes.get_errno() or _errno.EINVAL
    return 0


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) (a mapping, page aligned) present in memory: mincore(2).
    For a file mapping this is the file's page-cache residency over the range, mapped by
    this process or not (the caller must be able to write the file, or own it, for
    Linux >= 5.0 to report pages it has not mapped itself)."""
    if length <= 0:
        return 0
    n = -(-length // PAGE)
    vec = np.zeros(n, np.uint8)
    if _lib().mincore(addr, length, vec.ctypes.data) != 0:
        return 0
    return int(np.count_nonzero(vec & 1)) * PAGE


def file_cache_bytes(path) -> int:
    """Page-cache residency of a whole file (mapped briefly; mapping reads nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a FIFO: no wait
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except OSError:
        return 0
    finally:
        os.close(fd)
    try:
        view = np.frombuffer(mm, np.uint8)
        n = resident_bytes(view.ctypes.data, size)
        del view
        return n
    finally:
        mm.close()


def drop_file_cache(path, offset: int = 0, length: int = 0, sync: bool = False) -> None:
    """posix_fadvise(DONTNEED): drop the file's clean, unmapped pages from the page cache.
    sync: write dirty pages first (a model written moments ago is still dirty, and dirty
    pages are not dropped)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a FIFO: no wait
    except OSError:
        return
    try:
        if sync:
            os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def proc_read_bytes() -> Optional[int]:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes: page
    cache misses, O_DIRECT reads, readahead), None where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def file_pmd_mapped() -> dict:
    """{start address: bytes mapped with 2 MB page-table entries} of this process's file
    mappings (/proc/self/smaps FilePmdMapped); {} where the kernel does not say."""
    out, start = {}, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    start = int(line.split("-", 1)[0], 16)
                elif line.startswith("FilePmdMapped:") and start is not None:
                    out[start] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def proc_memory() -> dict:
    """VmRSS, VmHWM (peak RSS), RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None          # "max": no limit


def _cgroup_dir() -> Optional[str]:
    """This process's cgroup v2 folder (None on v1 or outside a cgroup)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return "/sys/fs/cgroup" + line[3:].strip()
    except OSError:
        pass
    return None


def available_bytes() -> Optional[int]:
    """Memory a new allocation can count on now: MemAvailable, lowered to the cgroup's
    limit minus its anonymous memory (v2 `memory.max` / `memory.stat`, v1
    `memory.limit_in_bytes` / `memory.stat` rss). None where the kernel says nothing."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limits = []
    cg = _cgroup_dir()
    if cg is not None:
        limits.append((_read_int(cg + "/memory.max"), cg + "/memory.stat", "anon"))
    limits.append((_read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                   "/sys/fs/cgroup/memory/memory.stat", "rss"))
    for limit, stat, key in limits:
        if limit is None or limit >= 1 << 60:             # v1 says "no limit" this way
            continue
        used = 0
        try:
            with open(stat) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        used = int(value)
                        break
        except (OSError, ValueError):
            pass
        room = max(0, limit - used)
        avail = room if avail is None else min(avail, room)
    return avail
