"""Reading Hugging Face safetensors checkpoints (single or sharded) tensor by tensor.

Our own small reader over mmap: it needs neither torch nor the whole file in memory, and
it understands bf16 (which numpy does not) by widening to float32 one tensor at a time.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I32": np.int32, "I64": np.int64, "U8": np.uint8, "I8": np.int8, "BOOL": np.bool_}


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{self.path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise ModelFormatError(f"{self.path}: header of {n} bytes is implausible")
            try:
                self.header = json.loads(f.read(n))
            except Exception as e:
                raise ModelFormatError(f"{self.path}: unreadable safetensors header ({e})") from None
            self._mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        self.data_start = 8 + n
        self.header.pop("__metadata__", None)

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        e = self.header[name]
        dt = _DTYPES.get(e["dtype"])
        if dt is None:
            raise ModelFormatError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
        a, b = e["data_offsets"]
        buf = np.frombuffer(self._mm, dtype=np.uint8, count=b - a, offset=self.data_start + a)
        return buf.view(dt).reshape(e["shape"])

    def float32(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (or its `index`-th slice along axis 0) widened to a new float32 array."""
        a = self.raw(name)
        if index is not None:
            a = a[index]
        if self.dtype(name) == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


class Checkpoint:
    """All safetensors shards of a Hugging Face model directory, by tensor name."""

    def __init__(self, hf_dir: Path):
        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{self.dir}: no *.safetensors files (only safetensors "
                                   f"checkpoints are supported; re-save with safe_serialization=True)")
        self.files = [SafetensorsFile(f) for f in files]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for n in f.names():
                self.where[n] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self.where[name].dtype(name)

    def get(self, name: str, index: int | None = None) -> np.ndarray:
        f = self.where.get(name)
        if f is None:
            raise ModelFormatError(f"{self.dir}: checkpoint has no tensor '{name}'")
        return f.float32(name, index)
