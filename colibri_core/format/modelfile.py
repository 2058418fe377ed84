"""The model directory on disk: container files, their section tables, and the reader that
maps them into zero-copy numpy views. No math here. Layout: docs/FORMAT.md.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from ..errors import ModelFormatError
from .filemap import FileMapping, max_map_count
from ..memstat import resident_bytes
from ..files import atomic_write, open_regular
from ..nesting import json_loads
from .quant import Q4Tensor, Q6Tensor, Q8Tensor, padded_cols

# 2 MB pages for the weights. Decode streams ~100 MB of weights a token, with a page
# walk per 4 KB page. With madvise(2) HUGEPAGE on a file's mapping (residency.py's
# preload), a page that is not cached yet is read in a 2 MB folio (file systems with
# large folios: ext4 from Linux 6.16, xfs) and the mapping maps it whole. A 2 MB range
# that already holds a small cached page cannot become one, so: the header's pages read
# with pread are dropped again (unless the file is cached past them already: then the drop
# gains nothing and costs a read at the next load), and write_container leaves what it
# wrote out of the page cache.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
HUGE_PAGE = 2 << 20


def _drop_cached(fd: int, length: int) -> None:
    """Drop the file's pages in its first `length` bytes (0: all) from the page cache:
    clean, unmapped ones only (the kernel keeps what another mapping uses; a partial page
    stays). Best effort."""
    try:
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass

def _cached_after(mm: FileMapping, start: int) -> bool:
    """Whether the file's first 2 MB hold cached pages past its header's: the file is warm
    (often one 2 MB folio, which dropping the header would throw away), so dropping the
    header's pages cannot make a 2 MB folio and would only cost a read at the next load
    (6,144 of them for Qwen3-30B-A3B's experts)."""
    end = min(HUGE_PAGE, mm.size) // mmap.PAGESIZE * mmap.PAGESIZE
    return end > start and resident_bytes(mm.address + start, end - start) > 0


MAGIC = b"COLIBRI\x00"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1        # the newest minor version this Colibri reads and writes (1.1: q6)
# The minor version a file is written with: the lowest that describes its sections, so a
# file without q6 sections stays 1.0 (byte for byte what an older Colibri wrote and reads).
DTYPE_MINOR = {"q6": 1}
ALIGN = 4096
_PREFIX = struct.Struct("<8sHHI")  # magic, major, minor, table_len
# The largest section table a reader parses (docs/FORMAT.md): a parsed table costs about
# 18 times its size in memory for the file's life. The biggest supported model's model.bin
# (DeepSeek-V3: 61 layers, up to 20 sections each) needs an estimated 0.25 MiB; an expert
# file holds at most six sections (under 1 KiB), and a model has thousands of them.
MAX_TABLE_BYTES = 1 << 20
MAX_EXPERT_TABLE_BYTES = 64 << 10

PLAIN_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
QUANT_DTYPES = ("q4", "q6", "q8")
ALL_DTYPES = set(PLAIN_DTYPES) | set(QUANT_DTYPES)
_DTYPE_NAMES = {d: d for d in ALL_DTYPES}   # one shared string per dtype, not one per section

Tensor = Union[np.ndarray, Q4Tensor, Q6Tensor, Q8Tensor]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def expert_name(layer: int, idx: int) -> str:
    """The name of expert `idx` of global layer `layer`, everywhere: files, traces, hooks."""
    return f"expert_{layer}_{idx}"


def expert_file_name(layer: int, idx: int) -> str:
    return expert_name(layer, idx) + ".bin"


# ----------------------------------------------------------------------------- writer

def _parts_of(t: Tensor) -> tuple[str, list[int], dict, list[tuple[str, np.ndarray]]]:
    """-> (dtype, shape, extra table keys, [(part name, contiguous array)]).

    A plain float32 / float16 array is stored as f32 / f16, a uint16 array as bf16 (the
    reader hands bf16 sections out as uint16 views, so this round-trips)."""
    if isinstance(t, Q4Tensor):
        return "q4", [t.rows, t.cols], {"group_size": t.group}, [
            ("data", np.ascontiguousarray(t.data, np.uint8)),
            ("scales", np.ascontiguousarray(t.scales, np.float32)),
            ("zeros", np.ascontiguousarray(t.zeros, np.uint8))]
    if isinstance(t, Q6Tensor):
        return "q6", [t.rows, t.cols], {"group_size": t.group}, [
            ("data", np.ascontiguousarray(t.data, np.uint8)),
            ("scales", np.ascontiguousarray(t.scales, np.float32)),
            ("zeros", np.ascontiguousarray(t.zeros, np.uint8))]
    if isinstance(t, Q8Tensor):
        return "q8", [t.rows, t.cols], {"group_size": t.group}, [
            ("data", np.ascontiguousarray(t.data, np.int8)),
            ("scales", np.ascontiguousarray(t.scales, np.float32))]
    a = np.asarray(t)
    for name, dt in PLAIN_DTYPES.items():
        if a.dtype == dt:
            return name, list(a.shape), {}, [("data", np.ascontiguousarray(a))]
    raise TypeError(f"cannot store array of dtype {a.dtype}; convert to float32, float16 "
                    f"or bf16 (as uint16)")


DEFAULT_RESERVE = 64 << 10   # header room of a streamed container when no size is given


def _layout(sizes: list[list[int]], header: int) -> tuple[list[list[int]], int]:
    """Offsets of every part (sizes per section) after a header of `header` bytes."""
    off, offs = header, []
    for parts in sizes:
        o = []
        for n in parts:
            o.append(off)
            off = _align(off + max(n, 1))
        offs.append(o)
    return offs, off


def _table(entries: list[dict], offs: list[list[int]]) -> bytes:
    for e, o in zip(entries, offs):
        for (p, v), off in zip(e["parts"].items(), o):
            v[0] = off
    return json.dumps({"sections": entries}, separators=(",", ":")).encode()


def _fit_header(entries: list[dict], sizes: list[list[int]], header: int):
    """Smallest header >= `header` that holds the table (offsets depend on it: iterate)."""
    while True:
        offs, end = _layout(sizes, header)
        table = _table(entries, offs)
        if len(table) > MAX_TABLE_BYTES:            # readers would refuse the file
            raise ValueError(f"section table of {len(table)} bytes ({len(entries)} sections) "
                             f"exceeds the format's cap of {MAX_TABLE_BYTES} bytes")
        need = _align(_PREFIX.size + len(table))
        if need <= header:
            return header, table, end
        header = need


def _write_array(f, a: np.ndarray) -> None:
    if a.nbytes:
        f.write(memoryview(a.reshape(-1)).cast("B"))


def minor_for(dtypes: Iterable[str]) -> int:
    """The format minor version a file holding sections of these dtypes is written with."""
    return max((DTYPE_MINOR.get(d, 0) for d in dtypes), default=0)


def write_container(path: Path, sections: Iterable[tuple[str, Tensor]],
                    reserve: int | None = None) -> int:
    """Write sections to `path` (through a temporary file renamed at the end).

    A list or tuple of sections (all in memory already) gets the smallest header. Any
    other iterable is *streamed*: each section is written as soon as it is produced and
    then dropped, so a generator of freshly quantized tensors never has more than one
    alive here. The header room is `reserve` bytes (rounded up to 4 KiB; default 64 KiB);
    if the section table turns out larger, the written data is shifted up in place once.
    The result is a pure function of the sections (and `reserve`): deterministic.
    Returns the format minor version written (minor_for the sections' dtypes)."""
    path = Path(path)
    exact = isinstance(sections, (list, tuple))
    entries: list[dict] = []
    sizes: list[list[int]] = []
    if exact:
        for name, t in sections:
            dtype, shape, extra, parts = _parts_of(t)
            entries.append({"name": name, "dtype": dtype, "shape": shape, **extra,
                            "parts": {p: [0, int(a.nbytes)] for p, a in parts}})
            sizes.append([int(a.nbytes) for _, a in parts])
        header, _, _ = _fit_header([dict(e, parts={k: list(v) for k, v in e["parts"].items()})
                                    for e in entries], sizes, ALIGN)
        entries, sizes = [], []
    else:
        header = _align(max(reserve or DEFAULT_RESERVE, _PREFIX.size + 2))
    names: set[str] = set()
    with atomic_write(path, durable=False) as f:
        off = header
        for name, t in sections:
            if name in names:
                raise ValueError(f"{path.name}: duplicate section name {name!r}")
            names.add(name)
            dtype, shape, extra, parts = _parts_of(t)
            entries.append({"name": name, "dtype": dtype, "shape": shape, **extra,
                            "parts": {p: [0, int(a.nbytes)] for p, a in parts}})
            sizes.append([int(a.nbytes) for _, a in parts])
            for _, a in parts:
                f.seek(off)
                _write_array(f, a)
                off = _align(off + max(a.nbytes, 1))
            del t, parts
        final_header, table, end = _fit_header(entries, sizes, header)
        if final_header != header:              # table outgrew the reserve: shift data
            f.flush()
            _shift(f, header, off, final_header - header)
        f.seek(0)
        minor = minor_for(e["dtype"] for e in entries)
        f.write(_PREFIX.pack(MAGIC, FORMAT_MAJOR, minor, len(table)))
        f.write(table)
        f.write(b"\0" * (final_header - _PREFIX.size - len(table)))
        f.truncate(end)
        if end >= HUGE_PAGE:       # on disk, then out of the cache: read back in 2 MB pages
            f.flush()
            os.fdatasync(f.fileno())
            _drop_cached(f.fileno(), 0)
    return minor


def _shift(f, start: int, end: int, delta: int, chunk: int = 8 << 20) -> None:
    """Move bytes [start, end) of the open file up by `delta`, from the end backwards."""
    pos = end
    while pos > start:
        n = min(chunk, pos - start)
        pos -= n
        f.seek(pos)
        buf = f.read(n)
        f.seek(pos + delta)
        f.write(buf)
    # [start, start + delta) becomes header padding, zeroed by the caller


def sha256_file(path: Union[str, Path], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes (model checksums, hot-plug allowlists)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


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
            self.sections = {s.name: s for s in parse_table(
                head if head is not None else self.buf, self.size, str(self.path), max_table)}
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
