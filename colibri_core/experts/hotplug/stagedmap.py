"""The staged copy of a hot-plugged expert, mapped under the SIGBUS guard; releasing
experts without keeping them alive.

The engine maps its private staged copy for the expert's router row and INT4 weights
(zero-copy views). A copy truncated while mapped (by the engine's own user: the staging
folder is 0700) used to make the next read a SIGBUS that killed the engine; the mapping is
now registered with ck_guard.c's handler (mapguard.py) before any byte is read, and
unregistered before it is unmapped -- when the last view of it is gone, so a view kept by
an old expert-set snapshot stays valid. A fault reads zeros and marks the copy damaged;
the expert then counts as crashed (HotExpert.alive) and the next drain() removes it.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from ... import kernels
from ...format.filemap import FileMapping
from ...kernels.mapguard import watch

log = logging.getLogger("colibri.hotplug")


class StagedMapping(FileMapping):
    """A read-only mapping of the whole file `path`, watched for truncation; no
    descriptor kept. `view(dtype, count, offset)` is a numpy view into it."""

    __slots__ = ("guard",)

    def __init__(self, path: str):
        self.guard = None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            super().__init__(fd, size)
        finally:
            os.close(fd)
        self.guard = watch(path, self.address, size)

    def view(self, dtype: str, count: int, offset: int) -> np.ndarray:
        n = count * np.dtype(dtype).itemsize
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"view of {n} bytes at {offset} past the mapping's {self.size}")
        return np.asarray(self)[offset:offset + n].view(dtype)

    @property
    def damaged(self) -> bool:
        return self.guard is not None and self.guard.damaged

    def __del__(self):
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.close()               # before the unmap: the range may be reused
        super().__del__()


_faults = None


def faults() -> int:
    """SIGBUS faults repaired in this process so far (any mapping): one integer read."""
    global _faults
    if _faults is None:
        _faults = kernels.guard_counter()
    return _faults[0]


def release_each(experts: list) -> None:
    """Unload every expert of `experts` (dlclose, helper stop), emptying the list as it
    goes: the hot-plug worker's loop keeps the list, and a removed expert left in it (or
    in a loop variable) stayed alive, mapped, until the next release."""
    while experts:
        e = experts.pop(0)
        try:
            e._release()
        except Exception:  # noqa: BLE001 - the worker must survive anything
            log.exception("unloading expert %s failed", e.name)
