"""Writing a container file (docs/FORMAT.md): sections aligned to 4 KiB after a header
that holds the section table, streamed from a generator when the caller has no list, the
whole file written through files.atomic_write (a temporary file renamed at the end).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from ..files import atomic_write
from .container import (ALIGN, FORMAT_MAJOR, HUGE_PAGE, MAGIC, MAX_TABLE_BYTES, PLAIN_DTYPES,
                        _PREFIX, Tensor, _align, _drop_cached, minor_for)
from .mxfp4 import MX_GROUP, MXFP4Tensor
from .q5 import Q5Tensor
from .quant import Q4Tensor, Q6Tensor, Q8Tensor


def _parts_of(t: Tensor) -> tuple[str, list[int], dict, list[tuple[str, np.ndarray]]]:
    """-> (dtype, shape, extra table keys, [(part name, contiguous array)]).

    A plain float32 / float16 array is stored as f32 / f16, a uint16 array as bf16 (the
    reader hands bf16 sections out as uint16 views, so this round-trips)."""
    if isinstance(t, Q4Tensor):
        return "q4", [t.rows, t.cols], {"group_size": t.group}, [
            ("data", np.ascontiguousarray(t.data, np.uint8)),
            ("scales", np.ascontiguousarray(t.scales, np.float32)),
            ("zeros", np.ascontiguousarray(t.zeros, np.uint8))]
    if isinstance(t, (Q5Tensor, Q6Tensor)):
        return "q5" if isinstance(t, Q5Tensor) else "q6", [t.rows, t.cols], {"group_size": t.group}, [
            ("data", np.ascontiguousarray(t.data, np.uint8)),
            ("scales", np.ascontiguousarray(t.scales, np.float32)),
            ("zeros", np.ascontiguousarray(t.zeros, np.uint8))]
    if isinstance(t, MXFP4Tensor):             # the checkpoint's bytes (docs/FORMAT.md)
        return "mxfp4", [t.rows, t.cols], {"group_size": MX_GROUP}, [
            ("data", np.ascontiguousarray(t.data, np.uint8)),
            ("exps", np.ascontiguousarray(t.exps, np.uint8))]
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
