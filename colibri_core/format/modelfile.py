"""The model directory on disk: container files, their section tables, and the reader that
maps them into zero-copy numpy views. No math here. Layout: docs/FORMAT.md.

The format's fixed parts are container.py's and the writer is writer.py; their names are
imported here too, so that `format.modelfile` is the one place the rest of Colibri takes
the format from.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

import numpy as np

from ..errors import ModelFormatError
from .container import (ALIGN, ALL_DTYPES, DTYPE_MINOR, FORMAT_MAJOR, FORMAT_MINOR, HUGE_PAGE,
                        MADV_HUGEPAGE, MAGIC, MAX_EXPERT_TABLE_BYTES, MAX_TABLE_BYTES,
                        PLAIN_DTYPES, QUANT_DTYPES, Tensor, _DTYPE_NAMES, _PREFIX,
                        _cached_after, _drop_cached, expert_file_name, expert_name, minor_for,
                        sha256_file)
from .filemap import FileMapping, max_map_count
from ..files import open_regular
from ..nesting import json_loads
from .mxfp4 import MX_GROUP, MXFP4Tensor
from .q5 import Q5Tensor
from .quant import Q4Tensor, Q6Tensor, Q8Tensor, padded_cols
from .writer import DEFAULT_RESERVE, write_container

__all__ = ["ALIGN", "ALL_DTYPES", "DTYPE_MINOR", "FORMAT_MAJOR", "FORMAT_MINOR", "HUGE_PAGE",
           "MADV_HUGEPAGE", "MAGIC", "MAX_EXPERT_TABLE_BYTES", "MAX_TABLE_BYTES",
           "PLAIN_DTYPES", "QUANT_DTYPES", "Tensor", "expert_file_name", "expert_name",
           "minor_for", "sha256_file", "DEFAULT_RESERVE", "write_container", "Section",
           "parse_table", "set_map_watcher", "ContainerFile"]


# ----------------------------------------------------------------------------- reader

@dataclass(frozen=True, slots=True)      # slots: a table's sections live as long as the file
class Section:
    name: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    parts: dict[str, tuple[int, int]]   # part -> (offset, nbytes)


def _expected_part_sizes(dtype: str, shape: tuple[int, ...], group: int) -> dict[str, int]:
    # Python integers: a corrupt shape such as [2**32, 2**32] must not wrap around int64
    # to a small size that matches a small part.
    if dtype in PLAIN_DTYPES:
        return {"data": math.prod(shape) * np.dtype(PLAIN_DTYPES[dtype]).itemsize}
    rows, cols = shape
    cp = padded_cols(cols, group)
    ng = cp // group
    if dtype == "q4":
        return {"data": rows * cp // 2, "scales": rows * ng * 4, "zeros": rows * ng}
    if dtype == "q6":
        return {"data": rows * cp // 64 * 48, "scales": rows * ng * 4, "zeros": rows * ng}
    if dtype == "q5":
        return {"data": rows * cp // 64 * 40, "scales": rows * ng * 4, "zeros": rows * ng}
    if dtype == "mxfp4":
        return {"data": rows * cp // 2, "exps": rows * cp // 32}
    return {"data": rows * cp, "scales": rows * ng * 4}


def _table_int(v) -> int:
    """An integer field of the section table (the writer only ever writes JSON integers;
    a float, string or bool there is corruption)."""
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {v!r:.40}")
    return v


def _shown(name: str) -> str:
    """A section name for a message: quoted when not printable, cut when long."""
    text = name if name.isprintable() else repr(name)[1:-1]
    return text if len(text) <= 60 else text[:57] + "..."


def parse_table(buf, file_size: int, source: str,
                max_table: int = MAX_TABLE_BYTES) -> list[Section]:
    """Validate the prefix and section table of a container held in `buf`.

    Messages never quote the bytes of a file that is not a Colibri container (a model file
    may be a symlink to anything): a bad magic is reported without the bytes found. Once
    the magic matched, the table's own fields (section names, dtypes) may be named."""
    if file_size < _PREFIX.size:
        raise ModelFormatError(f"{source}: file is {file_size} bytes, too short for a header")
    magic, major, minor, tlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ModelFormatError(f"{source}: not a Colibri file (bad magic: its first 8 bytes "
                               f"are not {MAGIC!r}); expected a container file (docs/FORMAT.md)")
    if major != FORMAT_MAJOR:
        raise ModelFormatError(f"{source}: format version {major}.{minor} is not readable by "
                               f"this Colibri (reads {FORMAT_MAJOR}.x); re-convert the model")
    if tlen > max_table:
        raise ModelFormatError(f"{source}: section table of {tlen} bytes exceeds the cap of "
                               f"{max_table} bytes (docs/FORMAT.md); the file is corrupt")
    if _PREFIX.size + tlen > file_size:
        raise ModelFormatError(f"{source}: section table length {tlen} exceeds the file "
                               f"({file_size} bytes); the file is truncated or corrupt")
    try:
        raw = json_loads(bytes(buf[_PREFIX.size:_PREFIX.size + tlen]).decode("utf-8"))["sections"]
        if not isinstance(raw, list):
            raise TypeError("'sections' is not a list")
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{source}: unreadable section table (not UTF-8 at byte "
                               f"{_PREFIX.size + e.start})") from None
    except Exception as e:
        raise ModelFormatError(f"{source}: unreadable section table ({type(e).__name__}: "
                               f"{str(e)[:80]})") from None
    sections, spans, names = [], [], set()
    for i, e in enumerate(raw):
        where = f"{source}: section {i}"
        try:
            name, dtype = e["name"], e["dtype"]
            if not isinstance(name, str) or not isinstance(dtype, str):
                raise TypeError("'name' and 'dtype' must be strings")
            shape = tuple(_table_int(s) for s in e["shape"])
            group = _table_int(e.get("group_size", 0))
            parts = {}
            for k, v in e["parts"].items():
                if not isinstance(v, list) or len(v) != 2:
                    raise TypeError(f"part {k!r} must be [offset, nbytes]")
                parts[str(k)] = (_table_int(v[0]), _table_int(v[1]))
        except Exception as ex:
            raise ModelFormatError(f"{where}: malformed entry ({type(ex).__name__}: "
                                   f"{str(ex)[:80]})") from None
        where = f"{source}: section '{_shown(name)}'"
        if name in names:
            raise ModelFormatError(f"{where}: duplicate name")
        names.add(name)
        if dtype not in ALL_DTYPES:
            raise ModelFormatError(f"{where}: unknown dtype {dtype!r:.40} (expected one of "
                                   f"{sorted(ALL_DTYPES)})")
        if not 1 <= len(shape) <= 4 or any(s <= 0 or s > 1 << 40 for s in shape):
            raise ModelFormatError(f"{where}: invalid shape {list(shape)}")
        if dtype in QUANT_DTYPES:
            if len(shape) != 2 or group <= 0 or group % 64 or group > 1 << 20:
                raise ModelFormatError(f"{where}: {dtype} needs a 2-D shape and a group size "
                                       f"that is a positive multiple of 64 (got {list(shape)}, "
                                       f"group {group})")
        if dtype == "mxfp4" and (group != MX_GROUP or shape[1] % 32):
            raise ModelFormatError(f"{where}: mxfp4 needs group size {MX_GROUP} and a multiple "
                                   f"of 32 columns (got {list(shape)}, group {group})")
        expected = _expected_part_sizes(dtype, shape, group)
        if set(parts) != set(expected):
            raise ModelFormatError(f"{where}: parts {sorted(parts)}, expected {sorted(expected)}")
        for p, (off, n) in parts.items():
            if n != expected[p]:
                raise ModelFormatError(f"{where}: part '{p}' has {n} bytes, expected "
                                       f"{expected[p]} for shape {list(shape)}")
            if off % ALIGN or off < _PREFIX.size + tlen:
                raise ModelFormatError(f"{where}: part '{p}' offset {off} is not a 4096-byte "
                                       f"boundary after the header")
            if off + n > file_size:
                raise ModelFormatError(f"{where}: part '{p}' ends at {off + n}, past the end of "
                                       f"the file ({file_size} bytes): the file is truncated")
            spans.append((off, off + n, name))
        sections.append(Section(name, _DTYPE_NAMES[dtype], shape, group, parts))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ModelFormatError(f"{source}: sections '{_shown(an)}' and '{_shown(bn)}' overlap")
    return sections


def _read_header(fd: int, size: int, path: Path, max_table: int) -> bytes:
    """The prefix and section table, read with pread and no readahead (only the pages
    holding them enter the page cache)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            advise = None
    try:
        head = os.pread(fd, _PREFIX.size, 0)
        if len(head) == _PREFIX.size:
            tlen = _PREFIX.unpack_from(head, 0)[3]
            if tlen <= max_table:
                head += os.pread(fd, min(tlen, size - _PREFIX.size), _PREFIX.size)
        return head
    except OSError as e:
        raise ModelFormatError(f"{path}: read error: {e.strerror}") from None
    finally:
        if advise is not None:
            try:
                advise(fd, 0, 0, os.POSIX_FADV_NORMAL)   # the mapping reads ahead as usual
            except OSError:
                pass


# Parsed section tables by (prefix and table bytes, file size, cap): a model's expert
# files share one table (6,144 files for Qwen3-30B-A3B), so a load parses it once; any
# other byte or size is a new key, parsed and checked in full. Only successes are kept.
# Every file with the table shares one read-only mapping of its Sections (frozen), so
# what is checked of a table can be checked once (weights.expert_ffn).
_TABLES: dict = {}
_TABLES_MAX = 64


def _parsed(head: bytes, size: int, source: str, max_table: int) -> Mapping:
    key = (head, size, max_table)
    got = _TABLES.get(key)
    if got is None:
        got = MappingProxyType({s.name: s for s in parse_table(head, size, source, max_table)})
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        _TABLES[key] = got
    return got


# A mapped file truncated in place loses the pages past its new end, and reading one
# raises SIGBUS. mapguard.py (listed after the compiled kernels it needs, so this module
# cannot import it) installs a watcher here when it is imported: watcher(path, address,
# size) registers a new mapping with the C SIGBUS handler and returns a handle
# (`.damaged`, `.close()`), or None. Every ContainerFile mapping is registered before
# any of its bytes are read and unregistered before it is unmapped.
_map_watcher = None


def set_map_watcher(watcher) -> None:
    global _map_watcher
    _map_watcher = watcher


class ContainerFile:
    """One mapped (or copied-in) container file; hands out zero-copy views.

    load_mode "header" reads only the section table: the data is read later by the caller
    into buffers of its own (the memory budget's copy-in expert slots, expertcache.py), and
    `tensor(name, buf, base)` hands out views into such a buffer. A section table longer
    than `max_table` bytes is refused before it is read."""

    def __init__(self, path: Path, load_mode: str = "mmap", max_table: int = MAX_TABLE_BYTES):
        self.path = Path(path)
        fd = open_regular(self.path)           # a FIFO or device is refused, never waited on
        head = None
        self._mm = None
        self.guard = None           # the map watcher's handle (mapguard.Watched), if any
        try:
            self.size = os.fstat(fd).st_size
            if self.size == 0:
                raise ModelFormatError(f"{self.path}: file is empty")
            if load_mode == "mmap":
                # The table is read with pread, not through the mapping: a fault there
                # would read around it (read_ahead_kb, often MBs: a whole expert file).
                head = _read_header(fd, self.size, self.path, max_table)
                try:                  # holds no descriptor (filemap.py: RLIMIT_NOFILE)
                    self._mm = FileMapping(fd, self.size)
                except OSError as e:  # ENOMEM: most often vm.max_map_count reached
                    raise ModelFormatError(f"{self.path}: cannot map: {e.strerror} (vm."
                                           f"max_map_count {max_map_count()}); try "
                                           f"load_mode 'copy'") from None
                hpages = -(-len(head) // mmap.PAGESIZE) * mmap.PAGESIZE
                if self.size >= HUGE_PAGE and not _cached_after(self._mm, hpages):
                    _drop_cached(fd, hpages)
                self.buf = np.asarray(self._mm)
                self.watch()
            elif load_mode == "header":   # the table only, read with pread (no mapping)
                self.buf = None
                head = _read_header(fd, self.size, self.path, max_table)
            else:  # copy-in: one read into private memory, for file systems without mmap
                self.buf = np.empty(self.size, dtype=np.uint8)
                view = memoryview(self.buf)
                got = 0
                while got < self.size:
                    try:
                        n = os.readv(fd, [view[got:]])
                    except OSError as e:
                        raise ModelFormatError(f"{self.path}: read error: {e.strerror}") from None
                    if n == 0:
                        raise ModelFormatError(f"{self.path}: file shrank while reading")
                    got += n
        finally:
            os.close(fd)
        try:
            self.sections = ({s.name: s for s in parse_table(self.buf, self.size, str(self.path),
                                                              max_table)}
                             if head is None else _parsed(head, self.size, str(self.path), max_table))
        except BaseException:
            self.close()                   # a refused file leaves no mapping behind
            raise
        self.base_address = int(self.buf.ctypes.data) if self.buf is not None else 0

    def __contains__(self, name: str) -> bool:
        return name in self.sections

    def _part(self, s: Section, part: str, dtype, shape, buf=None, base: int = 0) -> np.ndarray:
        off, n = s.parts[part]
        off -= base
        return (self.buf if buf is None else buf)[off:off + n].view(dtype).reshape(shape)

    def tensor(self, name: str, buf: Optional[np.ndarray] = None, base: int = 0) -> Tensor:
        """Views of section `name` into the file's bytes, or into `buf` (uint8) holding the
        file's bytes from offset `base` on."""
        s = self.sections.get(name)
        if s is None:
            raise ModelFormatError(f"{self.path}: missing section '{name}'")
        if buf is None and self.buf is None:
            raise ModelFormatError(f"{self.path}: opened for its table only; pass a buffer")
        part = lambda p, dt, shape: self._part(s, p, dt, shape, buf, base)   # noqa: E731
        if s.dtype in PLAIN_DTYPES:
            return part("data", PLAIN_DTYPES[s.dtype], s.shape)
        rows, cols = s.shape
        cp = padded_cols(cols, s.group_size)
        ng = cp // s.group_size
        if s.dtype == "q4":
            return Q4Tensor(part("data", np.uint8, (rows, cp // 2)),
                            part("scales", np.float32, (rows, ng)),
                            part("zeros", np.uint8, (rows, ng)),
                            rows, cols, s.group_size)
        if s.dtype == "mxfp4":
            return MXFP4Tensor(part("data", np.uint8, (rows, cp // 2)),
                               part("exps", np.uint8, (rows, cp // 32)), rows, cols)
        if s.dtype == "q5":
            return Q5Tensor(part("data", np.uint8, (rows, cp // 64 * 40)),
                            part("scales", np.float32, (rows, ng)),
                            part("zeros", np.uint8, (rows, ng)),
                            rows, cols, s.group_size)
        if s.dtype == "q6":
            return Q6Tensor(part("data", np.uint8, (rows, cp // 64 * 48)),
                            part("scales", np.float32, (rows, ng)),
                            part("zeros", np.uint8, (rows, ng)),
                            rows, cols, s.group_size)
        return Q8Tensor(part("data", np.int8, (rows, cp)),
                        part("scales", np.float32, (rows, ng)),
                        rows, cols, s.group_size)

    def data_span(self) -> tuple[int, int]:
        """(first byte after the header, file size): the bytes the sections live in."""
        return min((off for s in self.sections.values() for off, _ in s.parts.values()),
                   default=self.size), self.size

    def watch(self) -> None:
        """Register the mapping with the map watcher (when one is installed; idempotent)."""
        if (self.guard is None and self._mm is not None and self.buf is not None
                and _map_watcher is not None):
            self.guard = _map_watcher(self.path, int(self.buf.ctypes.data), self.size)

    @property
    def damaged(self) -> bool:
        """True once a read of the mapping found the file truncated (mapguard.py)."""
        return self.guard is not None and self.guard.damaged

    def madvise(self, advice: int) -> None:
        """One call for the whole file (prefetch a whole expert in one batch)."""
        if self._mm is not None:
            self._mm.madvise(advice)   # best effort (e.g. POPULATE_READ on an old kernel)

    def populate(self) -> int:
        """Read the whole file in and map it (MADV_POPULATE_READ, Linux 5.14 on); on older
        kernels read it once into the page cache and advise WILLNEED, so that the kernels'
        faults find it there. Returns 0 or MADV_POPULATE_READ's errno (EFAULT: the file is
        shorter than its mapping, truncated in place); what that means is the caller's."""
        from ..memstat import MADV_POPULATE_READ, MADV_WILLNEED, madvise
        if self._mm is None or self.buf is None:
            return 0
        addr, size = self.base_address, -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        err = madvise(addr, size, MADV_POPULATE_READ)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return err
        fd = open_regular(self.path)
        try:
            buf = bytearray(1 << 20)
            off = 0
            while off < self.size and os.preadv(fd, [buf], off) > 0:
                off += len(buf)
        finally:
            os.close(fd)
        madvise(addr, size, MADV_WILLNEED)
        return 0

    def close(self) -> None:
        self.sections = {}
        self.buf = None
        if self.guard is not None:
            self.guard.close()      # before the unmap: the range may be reused by others
        # unmapped now, or when the last view alive elsewhere goes (unwatched from now
        # on: the guard never holds a range that may be unmapped)
        self._mm = None
