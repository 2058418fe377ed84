"""Reading Hugging Face safetensors checkpoints (single or sharded) tensor by tensor.

Our own small reader: it needs neither torch nor the whole file in memory, and it
understands bf16 (which numpy does not) by widening to float32 one tensor at a time.
Tensors are read with pread into private buffers (not mapped), so the converter's resident
memory holds the tensor being converted, not the pages of every tensor already read: peak
RSS stays near one tensor whatever the checkpoint size. A fused expert tensor is read one
expert's slab at a time. `raw()` returns the stored bits (bf16 as uint16), which is how
`--bits 16` copies 16-bit checkpoints losslessly.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ConfigError, ModelFormatError
from ..files import open_regular, read_text
from ..nesting import json_loads

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "BOOL": np.bool_,
           "I16": np.int16, "U16": np.uint16, "U32": np.uint32}
_FLOAT = {"F32", "F16", "BF16", "F64"}


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even), returned as uint16 bits."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(a, np.float32))
    return np.where(nan, 0x7FC0, r).astype(np.uint16)


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = -1
        fd = open_regular(self.path)           # a FIFO or device is refused, never waited on
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ModelFormatError(f"{self.path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20 or 8 + n > size:
                raise ModelFormatError(f"{self.path}: header of {n} bytes is implausible "
                                       f"(file of {size} bytes)")
            try:
                self.header = json_loads(os.pread(fd, n, 8))
                if not isinstance(self.header, dict):
                    raise TypeError("not a JSON object")
            except Exception as e:
                raise ModelFormatError(f"{self.path}: unreadable safetensors header "
                                       f"({type(e).__name__}: {str(e)[:80]})") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.data_start = 8 + n
        self.header.pop("__metadata__", None)
        for name, e in self.header.items():
            a, b = e["data_offsets"]
            if self.data_start + b > size or a > b:
                raise ModelFormatError(f"{self.path}: tensor {name} lies past the end of the "
                                       f"file ({size} bytes): truncated download?")

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def raw(self, name: str, index: int | None = None,
            rows: tuple[int, int] | None = None) -> np.ndarray:
        """The stored tensor (or its `index`-th slice along axis 0) in a new array; `rows`
        (r0, r1): only those rows of it (the first axis after `index`), read alone."""
        e = self.header[name]
        dt = _DTYPES.get(e["dtype"])
        if dt is None:
            hint = (" (FP8 checkpoints, e.g. the original DeepSeek-V3 release, are not "
                    "supported: convert a bf16 copy)" if e["dtype"].startswith("F8") else "")
            raise ConfigError(f"{self.path}: tensor {name} has unsupported dtype "
                              f"{e['dtype']}{hint}")
        a, b = e["data_offsets"]
        shape = list(e["shape"])
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise ModelFormatError(f"{self.path}: tensor {name} {shape} has no slice {index}")
            slab = (b - a) // shape[0]
            a, b, shape = a + index * slab, a + (index + 1) * slab, shape[1:]
        if rows is not None:
            r0, r1 = rows
            if not shape or not 0 <= r0 <= r1 <= shape[0]:
                raise ModelFormatError(f"{self.path}: tensor {name} {shape} has no rows {r0}..{r1}")
            row = (b - a) // shape[0] if shape[0] else 0
            a, b, shape = a + r0 * row, a + r1 * row, [r1 - r0] + shape[1:]
        n = b - a
        if n == 0:
            return np.zeros(shape, dtype=dt)
        buf = np.empty(n, dtype=np.uint8)
        view, got = memoryview(buf), 0
        while got < n:
            k = os.preadv(self._fd, [view[got:]], self.data_start + a + got)
            if k <= 0:
                raise ModelFormatError(f"{self.path}: short read in tensor {name} (file changed?)")
            got += k
        return buf.view(dt).reshape(shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def float32(self, name: str, index: int | None = None,
                rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor (or its `index`-th slice along axis 0; `rows`: as raw) widened to a
        new float32 array."""
        a = self.raw(name, index, rows)
        if self.dtype(name) == "BF16":
            return bf16_to_f32(a)
        return a.astype(np.float32, copy=False)


WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _inside(folder: Path, name, what: str) -> Path:
    """`folder / name` for a relative file name that stays inside the folder."""
    p = Path(name) if isinstance(name, str) and name else None
    if p is None or p.is_absolute() or ".." in p.parts:
        raise ModelFormatError(f"{what}: file name {str(name)[:80]!r} is not a file inside "
                               f"{folder}")
    return folder / p


def checkpoint_files(hf_dir: Path, explicit: str | None = None) -> list[Path]:
    """The safetensors files of a checkpoint folder, chosen by transformers' rule for a
    local folder (`from_pretrained`), first match wins:

    1. `explicit`: config.json's `transformers_weights`, a *.safetensors file or a
       *.safetensors.index.json index inside the folder;
    2. `model.safetensors`;
    3. `model.safetensors.index.json`: exactly the shards its `weight_map` names (all must
       be there).

    No other file is read: consolidated copies, adapters or reference outputs beside the
    weights are ignored, as transformers ignores them. A name that exists but is not a
    regular file is refused when opened, never skipped."""
    hf_dir = Path(hf_dir)
    if explicit is not None:
        where = f"{hf_dir / 'config.json'}: transformers_weights"
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors",
                                                                    ".safetensors.index.json")):
            raise ConfigError(f"{where} {str(explicit)[:80]!r}: expected a *.safetensors file "
                              f"or a *.safetensors.index.json index")
        chosen = _inside(hf_dir, explicit, where)
        if not os.path.lexists(chosen):
            raise ModelFormatError(f"{where} names {explicit}, which is not in {hf_dir}")
    elif os.path.lexists(hf_dir / WEIGHTS_NAME):
        chosen = hf_dir / WEIGHTS_NAME
    elif os.path.lexists(hf_dir / INDEX_NAME):
        chosen = hf_dir / INDEX_NAME
    else:
        others = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        pt = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt*"))
        hint = (f"; the other safetensors files here ({', '.join(others[:3])}) are not "
                f"weights transformers would load" if others else
                f"; found {', '.join(pt[:3])}: only safetensors checkpoints are supported "
                f"(re-save with safe_serialization=True)" if pt else "")
        raise ModelFormatError(f"{hf_dir}: no {WEIGHTS_NAME} and no {INDEX_NAME} (the "
                               f"checkpoint files transformers reads){hint}")
    if not chosen.name.endswith(".index.json"):
        return [chosen]
    try:
        wm = json_loads(read_text(chosen))["weight_map"]
        if not isinstance(wm, dict) or not wm:
            raise TypeError("'weight_map' is not a non-empty object")
    except ModelFormatError:
        raise
    except Exception as e:
        raise ModelFormatError(f"{chosen}: unreadable shard index ({type(e).__name__}: "
                               f"{str(e)[:80]})") from None
    names = sorted({v for v in wm.values()}, key=str)
    files = [_inside(hf_dir, n, str(chosen)) for n in names]
    missing = [f.name for f in files if not os.path.lexists(f)]
    if missing:
        raise ModelFormatError(f"{chosen}: shard(s) {', '.join(missing[:3])} missing from "
                               f"{hf_dir} (incomplete download?)")
    return files


class Checkpoint:
    """The safetensors files of a Hugging Face model folder (checkpoint_files: the ones
    transformers reads), by tensor name."""

    def __init__(self, hf_dir: Path, explicit: str | None = None, prefix: str = ""):
        """prefix: only the tensors under it, named without it (the text model of a
        multimodal checkpoint: families_more.text_model)."""
        self.dir = Path(hf_dir)
        self.files = [SafetensorsFile(f) for f in checkpoint_files(self.dir, explicit)]
        self.where: dict[str, SafetensorsFile] = {}
        self.stored: dict[str, str] = {}           # name -> the file's name (prefixed)
        for f in self.files:
            for stored in f.names():
                if not stored.startswith(prefix):
                    continue
                n = stored[len(prefix):]
                if n in self.where:
                    raise ModelFormatError(f"{self.dir}: tensor {stored} appears in both "
                                           f"{self.where[n].path.name} and {f.path.name}")
                self.where[n], self.stored[n] = f, stored

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def _file(self, name: str) -> SafetensorsFile:
        f = self.where.get(name)
        if f is None:
            raise ModelFormatError(f"{self.dir}: checkpoint has no tensor '{name}'")
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(self.stored[name])

    def dtype(self, name: str) -> str:
        return self._file(name).dtype(self.stored[name])

    def get(self, name: str, index: int | None = None,
            rows: tuple[int, int] | None = None) -> np.ndarray:
        return self._file(name).float32(self.stored[name], index, rows)

    def raw(self, name: str, index: int | None = None,
            rows: tuple[int, int] | None = None) -> np.ndarray:
        return self._file(name).raw(self.stored[name], index, rows)

    def matrix_rows(self, name: str, index: int | None = None,
                    rows: tuple[int, int] | None = None):
        """(R, C, read(r0, r1) -> float32 rows r0..r1) of a matrix (tensor `name`, its
        `index`-th slice, the row range `rows` of that), so that a converter can hold one
        block of rows in float, not the tensor (an embedding of 129,280 x 7,168 is 3.7 GB
        in float32); None if it is not a matrix."""
        shape = self.shape(name)[0 if index is None else 1:]
        if len(shape) != 2:
            return None
        base, R = (0, shape[0]) if rows is None else (rows[0], rows[1] - rows[0])
        return R, shape[1], lambda r0, r1: self.get(name, index, (base + r0, base + r1))

    def close(self) -> None:
        for f in self.files:
            f.close()

    def float_dtypes(self) -> set[str]:
        return {f.dtype(s) for n, s in self.stored.items() for f in (self.where[n],)
                if f.dtype(s) in _FLOAT}
