"""The expert cache's I/O (expertcache.py): the I/O threads, where demand loads go before
guesses; reading a mapped expert file in (MADV_POPULATE_READ: a file truncated under its
mapping is damaged for good); reading an expert's bytes into a copy-in frame (preadv,
O_DIRECT where possible, else the range dropped from the page cache after); and glibc's
malloc thresholds pinned, so that a budget's activation share is what RSS shows.
"""
from __future__ import annotations

import errno as _errno
import itertools
import os
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from ..errors import ModelFileDamaged, ModelFormatError
from ..files import open_regular
from ..memstat import PAGE, _lib


class IOPool:
    """Worker threads taking (priority, fifo) ordered jobs: demand loads before guesses."""

    def __init__(self, n: int):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"colibri-io-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, prio: int, fn, *args) -> Future:
        fut: Future = Future()
        self._q.put((prio, next(self._seq), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self._q.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:      # handed to whoever waits on the future
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put((1 << 30, next(self._seq), None, None, None))
        for t in self._threads:
            t.join(timeout=10)


def populate(f):
    """Read a mapped expert file `f` (a ContainerFile) in and map it; a file shorter than
    its mapping (truncated in place) is damaged for good. (Asking for the whole file
    first with POSIX_FADV_WILLNEED made one cold 4.7 MB expert 0.75 against 0.64 GB/s in
    isolation, but did not help a half-model budget's decode: 109 / 82 ms a token with
    it, 74 / 79 without, the disk's own rate moving 0.4-1.2 GB/s; not kept.)"""
    err = f.populate()
    if err == _errno.EFAULT:
        if f.guard is not None:
            f.guard.mark_damaged()          # every later use fails the same way
        raise ModelFileDamaged(f.path)
    if err:
        raise ModelFormatError(f"{f.path}: cannot read expert ({os.strerror(err)})")


def read_into(path: Path, view: memoryview, offset: int, direct: bool) -> None:
    """Fill `view` with the file's bytes from `offset` (os.preadv). O_DIRECT bypasses the
    page cache; without it the range is dropped from the cache after the read."""
    fd = open_regular(path, flags=getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        got, n = 0, len(view)
        while got < n:
            k = os.preadv(fd, [view[got:]], offset + got)
            if k == 0:         # truncated while the engine uses it: as in mmap mode
                raise ModelFileDamaged(path)
            got += k
        if not direct:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read expert ({e.strerror})") from None
    finally:
        os.close(fd)


def direct_reads_work(path: Path, offset: int) -> bool:
    """Whether `path` reads with O_DIRECT (one page at `offset`): not on every filesystem
    (tmpfs refuses it), nor on every platform."""
    if not hasattr(os, "O_DIRECT"):
        return False
    raw = np.empty(2 * PAGE, np.uint8)
    off = (-raw.ctypes.data) % PAGE
    try:
        fd = open_regular(path, flags=os.O_DIRECT)
    except ModelFormatError:          # O_DIRECT refused (EINVAL), or not a regular file
        return False
    try:
        os.preadv(fd, [memoryview(raw[off:off + PAGE])], offset)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def fix_malloc() -> None:
    """glibc raises its mmap threshold after large frees, after which freed activations stay
    in the heap (RSS) instead of going back to the system. Pin it (and the trim threshold)
    so the budget's activation share is what RSS shows."""
    try:
        lib = _lib()
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        lib.mallopt(M_MMAP_THRESHOLD, 256 << 10)
        lib.mallopt(M_TRIM_THRESHOLD, 1 << 20)
    except (AttributeError, OSError):
        pass
