"""Reading GGUF files (llama.cpp, Ollama, LM Studio) for the converter (issue 33).

`open_gguf(path)` -> GGUFSource: the file's metadata turned into a Hugging Face style
config.json dict (gguf_families.hf_config), and `ck`, a checkpoint object with the same
interface as safetensors_reader.Checkpoint whose tensors carry Hugging Face names, so the
converter's family code (families.py) reads a GGUF as it reads a checkpoint folder.

- Reading and dequantizing is the `gguf` package's (GGUFReader, gguf.quants.dequantize):
  every type it dequantizes is read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
  K-quants, MXFP4, the IQ types); one tensor (or one expert's slab of a merged expert
  tensor) at a time, from the file's read-only mapping.
- llama.cpp's `llama`-architecture files (Mixtral) hold the q and k rows permuted for its
  rope (convert_hf_to_gguf.py LlamaModel.permute); they are permuted back here
  (gguf_families.unpermute), so the rows are transformers' again.
- A split GGUF (`NAME-00001-of-00003.gguf`) is read from its first file: the other parts
  are found beside it by name and all must be there.
- F16 / BF16 tensors keep their stored bits (`raw`), so `--bits 16` copies them; so do
  gpt-oss's MXFP4 experts at 4 bits (convert/gptoss.py).
"""
from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import ConfigError, ModelFormatError
from . import gguf_families as gf

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError("reading a .gguf file needs the `gguf` package (pip install gguf, "
                          "or pip install colibri-core[gguf])") from None
    return gguf


def split_parts(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF, in order, starting from any of them."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ConfigError(f"{path}: split GGUF of {n} files; missing beside it: "
                          f"{', '.join(missing)}")
    return parts


class GGUFTensor:
    def __init__(self, t, qtype: str, reader=None):
        self.t, self.qtype, self.reader = t, qtype, reader
        # numpy order: [rows, cols] / [experts, rows, cols]
        self.shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))


class GGUFCheckpoint:
    """Checkpoint interface (safetensors_reader.Checkpoint) over a GGUF's tensors under
    Hugging Face names: `name in ck`, shape, dtype, get (float32), raw, float_dtypes."""

    def __init__(self, readers: list, names: dict[str, tuple[str, Optional[int], str]],
                 arch: str, meta: gf.Meta):
        gguf = _gguf()
        self._q = gguf.quants
        self.tensors: dict[str, GGUFTensor] = {}
        for rd in readers:
            for t in rd.tensors:
                self.tensors[t.name] = GGUFTensor(t, t.tensor_type.name, rd)
        self.names_map = names        # HF name -> (gguf name, expert index or None, permute)
        self.arch, self.meta = arch, meta

    def __contains__(self, name: str) -> bool:
        return name in self.names_map

    def names(self) -> list[str]:
        return list(self.names_map)

    def _src(self, name: str):
        try:
            g, idx, perm = self.names_map[name]
        except KeyError:
            raise ConfigError(f"GGUF: no tensor for {name} (the file lacks "
                              f"{gf.gguf_name_hint(name)})") from None
        return self.tensors[g], idx, perm

    def gguf_name(self, name: str) -> str:
        return self.names_map[name][0]

    def _kv_b(self, name: str, fn) -> np.ndarray:
        """MLA's kv_b_proj [heads * (nope + v), kv_lora] from llama.cpp's attn_k_b
        [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora] (fn: get or raw)."""
        g = self.names_map[name][0]
        kb = fn(self.tensors[g], None, None)
        vb = fn(self.tensors[g.replace("attn_k_b", "attn_v_b")], None, None)
        return np.ascontiguousarray(np.concatenate([np.swapaxes(kb, 1, 2), vb], axis=1)
                                    .reshape(-1, kb.shape[1]))

    def shape(self, name: str) -> tuple[int, ...]:
        t, idx, op = self._src(name)
        if op == "kv_b":
            kb = t.shape
            vb = self.tensors[t.t.name.replace("attn_k_b", "attn_v_b")].shape
            return (kb[0] * (kb[2] + vb[1]), kb[1])
        if op in ("gate", "up"):
            return (t.shape[1] // 2, t.shape[2])
        return t.shape[1:] if idx is not None else t.shape

    def dtype(self, name: str) -> str:
        return self._src(name)[0].qtype

    def _data(self, t: GGUFTensor, idx):
        d = t.t.data
        return d[idx] if idx is not None else d

    @staticmethod
    def _release(t: GGUFTensor) -> None:
        """Drop the mapped pages of a tensor just read from this process's RSS (they stay in
        the page cache): the converter's resident memory stays near one tensor, as with
        the safetensors reader's pread."""
        mm = getattr(getattr(t.reader, "data", None), "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        a = (int(t.t.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        b = int(t.t.data_offset) + int(t.t.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, a, b - a)
        except (OSError, ValueError):
            pass

    def get(self, name: str, index: Optional[int] = None) -> np.ndarray:
        if index is not None:
            raise ModelFormatError(f"GGUF: {name}: fused-expert indexing is not used for GGUF")
        t, idx, perm = self._src(name)
        if perm == "kv_b":
            return self._kv_b(name, self._deq)
        return gf.unpermute(self._deq(t, idx, perm), perm, self.meta)

    def _deq(self, t: GGUFTensor, idx, perm) -> np.ndarray:
        data = self._data(t, idx)
        try:
            a = self._q.dequantize(np.asarray(data), t.t.tensor_type)
        except NotImplementedError:
            raise ConfigError(f"GGUF: tensor {t.t.name} has type {t.qtype}, which the gguf "
                              f"package cannot dequantize") from None
        shape = t.shape[1:] if idx is not None else t.shape
        out = np.ascontiguousarray(a, np.float32).reshape(shape)
        if idx is None or idx == t.shape[0] - 1:
            self._release(t)
        return out

    def raw(self, name: str, index: Optional[int] = None) -> np.ndarray:
        """The stored bits of an F16 / BF16 / F32 tensor (bf16 as uint16), or an MXFP4
        tensor's blocks (uint8 [rows, 17 bytes per 32 values]: format/mxfp4.from_gguf_blocks)."""
        t, idx, perm = self._src(name)
        if perm == "kv_b":
            return self._kv_b(name, self._raw)
        return np.ascontiguousarray(gf.unpermute(self._raw(t, idx, perm), perm, self.meta))

    def _raw(self, t: GGUFTensor, idx, perm) -> np.ndarray:
        data = np.asarray(self._data(t, idx))
        shape = t.shape[1:] if idx is not None else t.shape
        if t.qtype == "BF16":
            a = data.view(np.uint16).reshape(shape)
        elif t.qtype in ("F16", "F32"):
            a = data.reshape(shape)
        elif t.qtype == "MXFP4":
            a = data.view(np.uint8).reshape(shape[0], -1)
        else:
            raise ModelFormatError(f"GGUF: {t.t.name} is {t.qtype}; raw bits only for floats "
                                   f"and MXFP4")
        return a

    def close(self) -> None:
        pass

    def float_dtypes(self) -> set[str]:
        return {self.tensors[g].qtype for g, _, _ in self.names_map.values()}

    def types_of(self, hf_names) -> dict[str, int]:
        """{GGUF type: weights} over the given HF tensor names."""
        out: dict[str, int] = {}
        for n in hf_names:
            t, idx, _ = self._src(n)
            w = int(np.prod(self.shape(n)))
            out[t.qtype] = out.get(t.qtype, 0) + w
        return out


class GGUFSource:
    """One GGUF model: `hf` (config.json-like dict), `ck` (GGUFCheckpoint), `meta`,
    `add_bos`, `parts` (the files read)."""

    def __init__(self, path: Path):
        gguf = _gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: not found (expected a .gguf file)")
        self.parts = split_parts(self.path)
        self.readers = []
        for p in self.parts:
            try:
                self.readers.append(gguf.GGUFReader(str(p), "r"))
            except Exception as e:
                raise ModelFormatError(f"{p}: not a readable GGUF file ({type(e).__name__}: "
                                       f"{str(e)[:120]})") from None
        fields = {}
        for rd in reversed(self.readers):             # the first part's metadata wins
            for k, f in rd.fields.items():
                if k.startswith("GGUF.") or k.startswith("split."):
                    continue
                fields[k] = f
        self.meta = gf.Meta(fields)
        tensor_names = [t.name for rd in self.readers for t in rd.tensors]
        shapes = {t.name: tuple(int(x) for x in reversed([int(v) for v in t.shape]))
                  for rd in self.readers for t in rd.tensors}
        self.arch = self.meta.arch
        vectors = {t.name: np.asarray(t.data, np.float32) for rd in self.readers
                   for t in rd.tensors if t.name.startswith(("rope_factors", "rope_freqs"))}
        self.hf = gf.hf_config(self.meta, shapes, str(self.path), vectors)
        names = gf.tensor_names(self.meta, self.hf, tensor_names, shapes)
        self.ck = GGUFCheckpoint(self.readers, names, self.arch, self.meta)
        self.add_bos = self.meta.get("tokenizer.ggml.add_bos_token")
        unknown = sorted({self.ck.tensors[g].qtype for g, _, _ in names.values()}
                         - set(gf.READ_TYPES))
        if unknown:
            raise ConfigError(f"{self.path}: tensor type {', '.join(unknown)} is not supported "
                              f"(supported: {', '.join(gf.READ_TYPES)})")


def open_gguf(path) -> GGUFSource:
    return GGUFSource(Path(path))
