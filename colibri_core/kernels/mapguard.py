"""Model files truncated while mapped: the Python side of the SIGBUS guard (ck_guard.c).

A model file truncated in place (`truncate`, a copy tool rewriting it, a full disk)
loses the pages past its new end, and the next read of one of them raises SIGBUS, which
kills the process by default. With this module imported:

- every mapping modelfile.ContainerFile makes is registered with the C handler before
  its bytes are read (`watch`, installed as modelfile's map watcher at import) and
  unregistered before it is unmapped;
- a fault inside a registered mapping is repaired by the handler (the lost pages read as
  zeros from then on) and counted; the file's handle reports `damaged`;
- `FileCheck`, called by the model after each forward step and decode step (and the
  expert cache after each load), turns that into ModelFileDamaged naming the file: the
  request in flight fails, and so does every later one on that model, until it is
  reloaded. Zeros are never returned as a result.

Faults anywhere else go to the previous SIGBUS handler (faulthandler, or the default
action). The check costs one integer read while nothing has happened.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Optional

from .. import kernels
from ..format import modelfile
from ..errors import ModelFileDamaged

log = logging.getLogger("colibri")
_warned = False


class Watched:
    """One registered mapping: the handle ContainerFile keeps as `.guard`."""

    __slots__ = ("slot", "path", "_damaged")

    def __init__(self, slot: int, path: Path):
        self.slot, self.path, self._damaged = slot, Path(path), False

    @property
    def damaged(self) -> bool:
        if self.slot >= 0:
            self._damaged = self._damaged or kernels.guard_damaged(self.slot)
        return self._damaged

    def mark_damaged(self) -> None:
        """Damage found another way (the expert cache's MADV_POPULATE_READ: EFAULT)."""
        self._damaged = True
        if self.slot >= 0:
            kernels.guard_mark_damaged(self.slot)   # counted: every FileCheck looks again

    def close(self) -> None:
        """Stop watching (before the unmap); `damaged` keeps its last answer."""
        if self.slot >= 0:
            self._damaged = self._damaged or kernels.guard_damaged(self.slot)  # kept
            kernels.guard_unregister(self.slot)
            self.slot = -1


def watch(path: Path, address: int, size: int) -> Optional[Watched]:
    """modelfile's map watcher: register one new mapping (None if it cannot be watched:
    the table of ck_guard.c is full, or sigaction failed)."""
    global _warned
    slot = kernels.guard_register(address, size)
    if slot < 0:
        if not _warned:
            _warned = True
            log.warning("%s: cannot watch this mapping for truncation (too many mapped "
                        "files); a truncated file will crash the process", path)
        return None
    return Watched(slot, path)


class FileCheck:
    """The per-step check of one model's files: `check()` raises ModelFileDamaged once any
    of them is damaged. While no fault has happened anywhere in the process it reads one
    integer (the handler's counter) and compares it with the last value seen."""

    def __init__(self, files: Iterable):
        self._counter = kernels.guard_counter()
        self._seen = -1                           # look at the files at the first check
        self._files = []
        for f in files:
            f.watch()                             # mapped before this module was imported
            if f.guard is not None:
                self._files.append(f.guard)

    def check(self) -> None:
        if self._counter[0] != self._seen:
            self._look()

    def _look(self) -> None:
        now = self._counter[0]                    # read first: a later fault looks again
        for w in self._files:
            if w.damaged:
                raise ModelFileDamaged(w.path)    # _seen stays behind: raised every time
        self._seen = now


modelfile.set_map_watcher(watch)
