"""Python face of the C kernels (`colibri_core._colibri_kernels`, built by cffi).

This is the only module that imports the extension. Every function checks the dtype,
shape, C-contiguity (and writability of outputs) of its numpy arguments and raises
ValueError naming the argument; arrays are then handed to C with `ffi.from_buffer`,
never copied. No alignment is required: weight parts may be views at any byte offset.
The C calls release the GIL.

Backends: "avx512vnni" (x86-64 with AVX-512 F/BW/VL/VNNI: vpdpbusd int8 dots; otherwise
the AVX2 code), "avx2" (x86-64 with AVX2+FMA), "neon" (aarch64; int8 dots with sdot where
the CPU has them), "scalar" (portable C, the reference). The best one available is picked
at import, in that order; `COLIBRI_KERNELS=<name>` (e.g. avx2, scalar) forces one if this
CPU has it, and `set_backend()` switches at run time (tests, benchmarks). avx512vnni and
avx2 give bit-identical results; neon's int8 products and activation quantization are
bit-identical to scalar's (docs/ARCHITECTURE.md, "The NEON backend").
Threads: every call's parallel loops run on ck_pool.c's threads (the pipeline step's
too), over output rows; `set_threads(n)` (default: OMP_NUM_THREADS when set, else the
CPUs this process may run on).

Quantized matrices are `quant.Q4Tensor` / `Q6Tensor` / `Q8Tensor` and `mxfp4.MXFP4Tensor` in the
docs/FORMAT.md layout.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..format.mxfp4 import MXFP4Tensor
from ..format.quant import (Q4_CLIP_GRID, Q4_CLIPS, Q4Tensor, Q6Tensor, Q8Tensor, check_group,
                            padded_cols, q4_group_codes as _q4_group_codes_np)

try:
    from .._colibri_kernels import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the install
    from ..errors import KernelError

    raise KernelError(
        "colibri_core._colibri_kernels is not built: run `pip install -e .` or "
        f"`python colibri_core/kernels/build.py` ({exc})") from exc

__all__ = [
    "backend", "available_backends", "set_backend", "set_threads", "get_threads",
    "rdtsc", "cycle_counter_name", "act_quantize_q8", "q4_matmul", "q6_matmul", "mxfp4_matmul",
    "q8_matmul", "expert_ffn", "attention_decode", "q4_group_codes",
]

lib.ck_init()

_BACKENDS = {"scalar": 0, "avx2": 1, "neon": 2, "avx512vnni": 3}
_PREFERENCE = ("avx512vnni", "avx2", "neon", "scalar")   # as ck_core.c's ck_init
_NAMES = {v: k for k, v in _BACKENDS.items()}
_ACTS = {"int8": 1, "float": 0}
_NULL = ffi.NULL
_f32, _u8, _i8, _i32 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.int32)
_CTYPE = {_f32: "float[]", _u8: "uint8_t[]", _i8: "int8_t[]", _i32: "int32_t[]"}


# ----------------------------------------------------------------------------- runtime

def backend() -> str:
    """Name of the active SIMD path: "avx512vnni", "avx2", "neon" or "scalar"."""
    return _NAMES[lib.ck_backend()]


def available_backends() -> list[str]:
    return [n for n, b in _BACKENDS.items() if lib.ck_backend_available(b)]


def set_backend(name: str) -> str:
    """Switch the SIMD path ("scalar", "avx2", "avx512vnni", "neon" or "auto": the best
    available); returns the active one. Not meant to be called while other threads run
    kernels."""
    if name == "auto":
        name = next(n for n in _PREFERENCE if lib.ck_backend_available(_BACKENDS[n]))
    if name not in _BACKENDS or lib.ck_set_backend(_BACKENDS[name]) != 0:
        raise ValueError(f"kernel backend {name!r} is not available here "
                         f"(available: {', '.join(available_backends())})")
    return backend()


def set_threads(n: int) -> None:
    """Number of threads of every kernel call (>= 1): ck_pool.c's, which the pipeline
    step shares (its ThreadControl may run a step on fewer)."""
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    lib.ck_set_threads(int(n))


def get_threads() -> int:
    return lib.ck_get_threads()


def _set_parallel_threshold(macs: int) -> None:
    """Testing aid: calls with fewer multiply-adds than this run on one thread
    (0: every call uses all threads; negative: back to the built-in default)."""
    lib.ck_set_par_min_work(int(macs))


def _set_matmul_min_tokens(n: int) -> int:
    """Testing/benchmark aid: calls of n >= this many tokens use the batch (matrix-matrix)
    tiles, fewer tokens the matrix-vector tiles once per token (1: always the batch
    tiles; <= 0: back to the measured default, ck_core.c's CK_MATMUL_MIN_TOKENS).
    Returns the value now in effect. Results do not depend on it."""
    return lib.ck_set_matmul_min_tokens(int(n))


def _set_panel_min_tokens(n: int) -> int:
    """Testing/benchmark aid: experts with at least this many tokens in a step run the
    backend's panel kernel where it has one (AVX-512; 1: every expert; a large value:
    never; <= 0: back to ck_step_moe.c's CK_PANEL_MIN_TOKENS). Returns the value now in
    effect. Results do not depend on it."""
    return lib.ck_set_panel_min_tokens(int(n))


def rdtsc() -> int:
    """Raw cycle counter (rdtsc on x86, cntvct_el0 on aarch64, else nanoseconds)."""
    return lib.ck_rdtsc()


def cycle_counter_name() -> str:
    return ffi.string(lib.ck_cycle_counter_name()).decode()


# ----------------------------------------------------------------------------- mapped-file guard

def guard_register(address: int, size: int) -> int:
    """Watch the mapping [address, address + size) for SIGBUS (ck_guard.c); the slot, or
    -1 when it cannot be watched. mapguard.py is the one caller."""
    return lib.ck_guard_register(int(address), int(size))


def guard_unregister(slot: int) -> None:
    """Stop watching a slot (before its mapping is unmapped)."""
    lib.ck_guard_unregister(int(slot))


def guard_damaged(slot: int) -> bool:
    return bool(lib.ck_guard_damaged(int(slot)))


def guard_mark_damaged(slot: int) -> None:
    lib.ck_guard_mark_damaged(int(slot))


def guard_counter():
    """A cffi pointer to the count of repaired faults: `p[0]` reads it (no call, no
    allocation while it is below 257)."""
    return lib.ck_guard_counter()


# ----------------------------------------------------------------------------- checks

def _ptr(a: np.ndarray):
    return ffi.from_buffer(_CTYPE[a.dtype], a)


def _arr(name: str, a, dtype: np.dtype, shape: tuple, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: dtype must be {dtype}, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name}: shape must be {shape}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (use np.ascontiguousarray)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: array must be writable")
    return a


def _ck_mat(name: str, w, kind: type):
    """The validated C descriptor (ck_mat) of a Q4Tensor / Q6Tensor / Q8Tensor, cached on the tensor
    (its fields are frozen, so the check holds for its lifetime; ~3 us saved per call)."""
    got = w.__dict__.get("_ck_mat") if type(w) is kind else None
    if got is not None:
        return got[0]
    if not isinstance(w, kind):
        raise ValueError(f"{name}: expected a {kind.__name__}, got {type(w).__name__}")
    check_group(w.group, name)
    cp = padded_cols(w.cols, w.group)
    ng = cp // w.group
    if kind is Q4Tensor:
        _arr(f"{name}.data", w.data, _u8, (w.rows, cp // 2))
        _arr(f"{name}.scales", w.scales, _f32, (w.rows, ng))
        _arr(f"{name}.zeros", w.zeros, _u8, (w.rows, ng))
        parts = (_ptr(w.data), _ptr(w.scales), _ptr(w.zeros))
    elif kind is MXFP4Tensor:
        _arr(f"{name}.data", w.data, _u8, (w.rows, cp // 2))
        _arr(f"{name}.exps", w.exps, _u8, (w.rows, cp // 32))
        parts = (_ptr(w.data), _NULL, _ptr(w.exps))
    elif kind is Q6Tensor:
        _arr(f"{name}.data", w.data, _u8, (w.rows, cp // 64 * 48))
        _arr(f"{name}.scales", w.scales, _f32, (w.rows, ng))
        _arr(f"{name}.zeros", w.zeros, _u8, (w.rows, ng))
        parts = (_ptr(w.data), _ptr(w.scales), _ptr(w.zeros))
    else:
        _arr(f"{name}.data", w.data, _i8, (w.rows, cp))
        _arr(f"{name}.scales", w.scales, _f32, (w.rows, ng))
        parts = (_ptr(w.data), _ptr(w.scales), _NULL)
    ck_kind = {Q4Tensor: lib.CK_W_Q4, Q6Tensor: lib.CK_W_Q6,
               MXFP4Tensor: lib.CK_W_MXFP4}.get(kind, lib.CK_W_Q8)
    m = ffi.new("ck_mat *", {"kind": ck_kind,
                             "data": parts[0], "scales": parts[1], "zeros": parts[2],
                             "rows": w.rows, "cols": w.cols, "group": w.group})
    try:
        object.__setattr__(w, "_ck_mat", (m, parts))   # the parts keep the buffers alive
    except AttributeError:  # a slotted tensor: no cache, still correct
        pass
    return m


def _f32_ptr(name: str, a, shape: tuple, writable: bool = False):
    """Fast path of _arr + _ptr for float32 arrays (the per-call x / out)."""
    if type(a) is np.ndarray and a.dtype == _f32 and a.shape == shape:
        f = a.flags
        if f.c_contiguous and (f.writeable or not writable):
            return ffi.from_buffer("float[]", a)
    return _ptr(_arr(name, a, _f32, shape, writable))


def _x_out(w, x, out, x_cols: Optional[int] = None) -> tuple:
    """Checks x [N, C] / out [N, rows] (or x [C] / out [rows]), C = x_cols or w.cols;
    returns (N, x pointer, out pointer)."""
    nd = getattr(x, "ndim", 0)
    c = w.cols if x_cols is None else x_cols
    if nd == 2:
        n = x.shape[0]
        return n, _f32_ptr("x", x, (n, c)), _f32_ptr("out", out, (n, w.rows), True)
    if nd == 1:
        return 1, _f32_ptr("x", x, (c,)), _f32_ptr("out", out, (w.rows,), True)
    raise ValueError(f"x: expected a 1-D or 2-D numpy array, got "
                     f"{getattr(x, 'shape', type(x).__name__)}")


def _act(act: str) -> int:
    try:
        return _ACTS[act]
    except KeyError:
        raise ValueError(f"act must be 'int8' or 'float', got {act!r}") from None


def _rc(rc: int) -> None:
    if rc != 0:
        raise MemoryError("colibri kernels: could not allocate scratch buffers")


# ----------------------------------------------------------------------------- kernels

def act_quantize_q8(x: np.ndarray, group: int, xq: Optional[np.ndarray] = None,
                    xs: Optional[np.ndarray] = None, xsum: Optional[np.ndarray] = None):
    """Per-group int8 quantization of x f32 [N, C]; bit-identical to
    quant.quantize_act_q8. Fills xq int8 [N, Cp], xs f32 [N, NG], xsum int32 [N, NG]
    (allocated when None) and returns (xq, xs, xsum)."""
    check_group(group, "group")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x: expected a 2-D numpy array, got {getattr(x, 'shape', type(x).__name__)}")
    n, cols = x.shape
    _arr("x", x, _f32, (n, cols))
    cp = padded_cols(cols, group)
    ng = cp // group
    xq = np.empty((n, cp), np.int8) if xq is None else _arr("xq", xq, _i8, (n, cp), True)
    xs = np.empty((n, ng), np.float32) if xs is None else _arr("xs", xs, _f32, (n, ng), True)
    xsum = np.empty((n, ng), np.int32) if xsum is None else _arr("xsum", xsum, _i32, (n, ng), True)
    if n and cols:
        lib.ck_act_quantize(_ptr(x), n, cols, group, _ptr(xq), _ptr(xs), _ptr(xsum))
    elif n:
        xq[...] = 0; xs[...] = 0; xsum[...] = 0
    return xq, xs, xsum


def q4_matmul(w: Q4Tensor, x: np.ndarray, out: np.ndarray, act: str = "int8") -> np.ndarray:
    """out = x @ W^T for a q4 matrix W [R, C]: x f32 [N, C] -> out f32 [N, R]
    (or x [C] -> out [R]). act="int8" quantizes x per group of W and uses integer dot
    products; act="float" dequantizes W on the fly (parity path). Returns out."""
    return _matmul(w, Q4Tensor, x, out, act)


def q6_matmul(w: Q6Tensor, x: np.ndarray, out: np.ndarray, act: str = "int8") -> np.ndarray:
    """As q4_matmul for a q6 matrix (uint8 [R, Cp*3/4] data, f32 scales, uint8 zeros)."""
    return _matmul(w, Q6Tensor, x, out, act)


def mxfp4_matmul(w: MXFP4Tensor, x: np.ndarray, out: np.ndarray,
                 act: str = "int8") -> np.ndarray:
    """As q4_matmul for an MXFP4 matrix (format/mxfp4.py): int8 activations in groups of
    64, exact integer dots of the doubled e2m1 codes per 32-value block."""
    return _matmul(w, MXFP4Tensor, x, out, act)


def q8_matmul(w: Q8Tensor, x: np.ndarray, out: np.ndarray, act: str = "int8") -> np.ndarray:
    """As q4_matmul for a q8 matrix (int8 [R, Cp] data, f32 [R, NG] scales)."""
    return _matmul(w, Q8Tensor, x, out, act)


def _matmul(w, kind: type, x: np.ndarray, out: np.ndarray, act: str) -> np.ndarray:
    mode = _act(act)
    m = _ck_mat("w", w, kind)
    n, xp, op = _x_out(w, x, out)
    if n == 0 or w.rows == 0:
        return out
    _rc(lib.ck_matmul(m, xp, n, op, mode))
    return out


def expert_ffn(w1: Q4Tensor, w3: Q4Tensor, w2: Q4Tensor, x: np.ndarray, out: np.ndarray,
               act: str = "int8", row_weights: Optional[np.ndarray] = None,
               accumulate: bool = False) -> np.ndarray:
    """One routed (or shared/dense) expert in one call:
        h = silu(x @ W1^T) * (x @ W3^T);  y = h @ W2^T
        out = y * row_weights[:, None]   (out += ... when accumulate)
    W1, W3: [I, H] q4 with the same group; W2: [H, I] q4. x, out: f32 [N, H] (or [H]).
    row_weights: [N] (any float dtype, converted; None = 1). Gate and up share one
    activation quantization and one pass over the rows. Returns out."""
    mode = _act(act)
    m1, m3, m2 = _ck_mat("w1", w1, Q4Tensor), _ck_mat("w3", w3, Q4Tensor), _ck_mat("w2", w2, Q4Tensor)
    hidden, inter = w1.cols, w1.rows
    if (w3.rows, w3.cols) != (inter, hidden) or w3.group != w1.group:
        raise ValueError(f"w3: shape {(w3.rows, w3.cols)} / group {w3.group} must equal "
                         f"w1's {(inter, hidden)} / {w1.group}")
    if (w2.rows, w2.cols) != (hidden, inter):
        raise ValueError(f"w2: shape must be {(hidden, inter)} (hidden, intermediate), "
                         f"got {(w2.rows, w2.cols)}")
    n, xp, op = _x_out(w2, x, out, hidden)
    if row_weights is not None:
        row_weights = np.ascontiguousarray(row_weights, dtype=np.float32)
        if row_weights.shape != (n,) and not (x.ndim == 1 and row_weights.shape == ()):
            raise ValueError(f"row_weights: shape must be ({n},), got {row_weights.shape}")
        row_weights = row_weights.reshape(n)
    if n == 0:
        return out
    if hidden == 0 or inter == 0:
        if not accumulate:
            out[...] = 0
        return out
    rw = _NULL if row_weights is None else _ptr(row_weights)
    _rc(lib.ck_expert_ffn(ffi.new("ck_ffn *", (m1[0], m3[0], m2[0])), xp, n, op, rw,
                          int(bool(accumulate)), mode))
    return out


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, length: int,
                     out: np.ndarray, scale: Optional[float] = None) -> np.ndarray:
    """Attention of one new token over the first `length` cached positions:
        out[h] = softmax(scale * K[:length, h // (NH // NKV)] @ q[h]) @ V[:length, same]
    q, out: f32 [NH, D]; k_cache, v_cache: f32 [S, NKV, D] (e.g. a KVCache layer slab
    cache.k[L]), NH a multiple of NKV (grouped-query attention), 1 <= length <= S;
    scale defaults to 1/sqrt(D). Threads split the KV heads. No causal mask is needed:
    every cached position precedes the token. Returns out."""
    if not isinstance(k_cache, np.ndarray) or k_cache.ndim != 3:
        raise ValueError(f"k_cache: expected a 3-D numpy array [S, NKV, D], got "
                         f"{getattr(k_cache, 'shape', type(k_cache).__name__)}")
    cap, nkv, d = k_cache.shape
    if not isinstance(q, np.ndarray) or q.ndim != 2 or q.shape[1] != d:
        raise ValueError(f"q: expected a numpy array [NH, {d}], got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    nh = q.shape[0]
    if nkv == 0 or nh % nkv:
        raise ValueError(f"q: {nh} heads is not a multiple of the cache's {nkv} kv heads")
    length = int(length)
    if not 1 <= length <= cap:
        raise ValueError(f"length must be in 1..{cap} (the cache capacity), got {length}")
    qp = _f32_ptr("q", q, (nh, d))
    kp = _f32_ptr("k_cache", k_cache, (cap, nkv, d))
    vp = _f32_ptr("v_cache", v_cache, (cap, nkv, d))
    op = _f32_ptr("out", out, (nh, d), True)
    sc = 1.0 / float(np.sqrt(d)) if scale is None else float(scale)
    _rc(lib.ck_attention_decode(qp, nh, d, kp, vp, nkv, length, sc, op))
    return out


_GRID = np.array(Q4_CLIP_GRID, dtype=np.float64)


def q4_group_codes(blk: np.ndarray, clip: str = "mse", qmax: int = 15):
    """quant.q4_group_codes in C (ck_qsearch.c, the kernels' threads, GIL released): each
    group's (row of `blk`, float64 [N, K], K <= 1024) scale and zero point by `clip`, and
    its codes -> (q uint8 [N, K], scale float32 [N], zero uint8 [N]), bit for bit numpy's.
    A block with a NaN or Inf is redone by numpy (its rules give the non-finite scale that
    validate.check_tensor refuses)."""
    if clip not in Q4_CLIPS:
        raise ValueError(f"q4 clip {clip!r}: must be one of {', '.join(Q4_CLIPS)}")
    if not isinstance(blk, np.ndarray) or blk.dtype != np.float64 or blk.ndim != 2:
        raise ValueError(f"blk: expected a float64 numpy array [N, K], got "
                         f"{getattr(blk, 'dtype', type(blk).__name__)} {getattr(blk, 'shape', '')}")
    n, k = blk.shape
    if not 1 <= k <= 1024 or not 1 <= int(qmax) <= 255:
        return _q4_group_codes_np(blk, clip, qmax)           # outside the kernel's sizes
    blk = np.ascontiguousarray(blk)
    q = np.empty((n, k), np.uint8)
    s = np.empty(n, np.float32)
    z = np.empty(n, np.uint8)
    bad = lib.ck_q4_group_search(ffi.cast("const double *", ffi.from_buffer(blk)), n, k,
                                 int(qmax), ffi.cast("const double *", ffi.from_buffer(_GRID)),
                                 len(_GRID), int(clip == "mse"), ffi.from_buffer("float[]", s),
                                 ffi.from_buffer("uint8_t[]", z),
                                 ffi.from_buffer("uint8_t[]", q), lib.ck_get_threads())
    if bad:
        return _q4_group_codes_np(blk, clip, qmax)
    return q, s, z
