"""Value checks on stored weights: no NaN or Inf anywhere, q4 zero points in 0..15.

Run at conversion (every tensor, as it is written: `weights.write_model_dir` calls
`check_tensor`) and by `colibri inspect DIR --verify` (`scan_model_dir`), never at load:
a load maps the files and reads only what a token touches.

    check_tensor(name, tensor, source)   raise ModelFormatError naming the first problem
    tensor_problems(name, tensor)        -> list of one-line problems (empty: fine)
    scan_model_dir(path)                 -> list of one-line problems over every section

What is checked, per stored number type (docs/FORMAT.md):

- `f32`, `f16`: every value finite.
- `bf16` (stored as uint16): no value with an all-ones exponent (Inf or NaN).
- `q4`: every scale finite, every zero point in 0..15 (4-bit). The packed nibbles are
  always 0..15, so with finite scales every dequantized value is finite.
- `q8`: every scale finite (int8 data is always finite).

Large tensors are scanned in row blocks, so the check never allocates more than a few MiB
beyond the (mapped) tensor itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import numpy as np

from ..errors import ModelFormatError
from .mxfp4 import E8M0_NAN, MXFP4Tensor
from .q5 import Q5Tensor
from .quant import Q4Tensor, Q6Tensor, Q8Tensor

Tensor = Union[np.ndarray, Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor]

_BLOCK_BYTES = 4 << 20          # scan this many bytes of a tensor at a time
_BF16_EXP = 0x7F80              # bf16 exponent bits: all ones -> Inf or NaN


def _blocks(a: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first flat index, block) over a C-contiguous array, a few MiB at a time."""
    flat = a.reshape(-1)
    step = max(1, _BLOCK_BYTES // max(1, a.itemsize))
    for i in range(0, flat.size, step):
        yield i, flat[i:i + step]


def _count_bad(a: np.ndarray, bad_of) -> tuple[int, Optional[int]]:
    """(how many entries are bad, flat index of the first) over `a`, blockwise."""
    n, first = 0, None
    for i, blk in _blocks(np.ascontiguousarray(a)):
        bad = bad_of(blk)
        c = int(np.count_nonzero(bad))
        if c:
            if first is None:
                first = i + int(np.argmax(bad))
            n += c
    return n, first


def _non_finite(blk: np.ndarray) -> np.ndarray:
    return ~np.isfinite(blk)


def _bf16_non_finite(blk: np.ndarray) -> np.ndarray:
    return (blk & _BF16_EXP) == _BF16_EXP


def _where(shape: tuple[int, ...], flat: int) -> str:
    idx = np.unravel_index(flat, shape) if len(shape) > 1 else (flat,)
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def tensor_problems(name: str, t: Tensor) -> list[str]:
    """One line per problem found in tensor `name` (empty list: all values are fine)."""
    out = []
    if isinstance(t, MXFP4Tensor):
        exps = np.asarray(t.exps)
        n, first = _count_bad(exps, lambda b: b == E8M0_NAN)
        if n:
            out.append(f"section '{name}' (mxfp4): {n} block exponent(s) 255 (NaN in e8m0), "
                       f"first at {_where(exps.shape, first)}")
        return out
    if isinstance(t, (Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor)):
        kind = {Q4Tensor: "q4", Q5Tensor: "q5", Q6Tensor: "q6"}.get(type(t), "q8")
        scales = np.asarray(t.scales)
        n, first = _count_bad(scales, _non_finite)
        if n:
            r, g = np.unravel_index(first, scales.shape) if scales.ndim == 2 else (first, 0)
            out.append(f"section '{name}' ({kind}): {n} non-finite scale(s) (NaN/Inf), first at "
                       f"row {int(r)}, group {int(g)} (columns {int(g) * t.group}.."
                       f"{int(g + 1) * t.group - 1})")
        if isinstance(t, (Q4Tensor, Q5Tensor, Q6Tensor)):
            zeros, top = np.asarray(t.zeros), {"q4": 15, "q5": 31}.get(kind, 63)
            n, first = _count_bad(zeros, lambda b: b > top)
            if n:
                out.append(f"section '{name}' ({kind}): {n} zero point(s) outside 0..{top}, "
                           f"first at {_where(zeros.shape, first)}")
        return out
    a = np.asarray(t)
    if a.dtype == np.uint16:                              # bf16 bits
        n, first = _count_bad(a, _bf16_non_finite)
        kind = "bf16"
    elif a.dtype.kind == "f":
        n, first = _count_bad(a, _non_finite)
        kind = {4: "f32", 2: "f16", 8: "f64"}.get(a.itemsize, str(a.dtype))
    else:
        return out                                         # integer data: always finite
    if n:
        out.append(f"section '{name}' ({kind}): {n} non-finite value(s) (NaN/Inf), first at "
                   f"{_where(a.shape, first)}")
    return out


def check_tensor(name: str, t: Tensor, source: str = "") -> None:
    """Raise ModelFormatError (one line) when tensor `name` holds NaN/Inf values or
    non-finite quantization scales. `source` names the checkpoint or file in the message.

    The converter calls it for every tensor it writes (through write_model_dir)."""
    problems = tensor_problems(name, t)
    if problems:
        where = f"{source}: " if source else ""
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ModelFormatError(f"{where}{problems[0]}{more}; fix the source weights "
                               f"(a diverged or corrupted checkpoint?) and convert again")


def checked(sections: Iterable[tuple[str, Tensor]], source: str) -> Iterator[tuple[str, Tensor]]:
    """Pass (name, tensor) pairs through, checking each (streaming: one tensor at a time)."""
    for name, t in sections:
        check_tensor(name, t, source)
        yield name, t


def scan_model_dir(path: Union[str, Path]) -> list[str]:
    """Check every section of every container file of a model directory for NaN/Inf
    (and q4 zero points out of range). One line per problem; empty: clean.

    Files are the ones config.json lists (plus any other *.bin in the folder); a file
    that cannot be opened or parsed is reported as a problem, not raised."""
    from ..config import load_model_config
    from .modelfile import ContainerFile
    path = Path(path)
    cfg = load_model_config(path / "config.json")
    names = sorted({n for n in cfg.files if n.endswith(".bin")}
                   | {p.name for p in path.glob("*.bin") if p.is_file()})
    problems = []
    for n in names:
        try:
            f = ContainerFile(path / n)
        except ModelFormatError as e:
            problems.append(str(e))
            continue
        try:
            for s in list(f.sections):
                problems += [f"{f.path}: {p}" for p in tensor_problems(s, f.tensor(s))]
            if f.damaged:                 # truncated during the scan: zeros were read
                problems.append(f"{f.path}: truncated while being checked")
        finally:
            f.close()
    return problems
