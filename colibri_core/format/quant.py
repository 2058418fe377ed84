"""Group quantization in plain numpy: the reference the C kernels are tested against.

Layout and rounding rules are those of docs/FORMAT.md (`q4`, `q6`, `q8`). Everything here is
written for clarity, not speed; the engine's hot path uses `colibri_core.kernels`.

Shape legend: R = rows (output features), C = cols (input features),
Cp = cols padded to a multiple of the group size G, NG = Cp // G.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NIBBLE_BLOCK = 64  # values per 32-byte nibble block (low nibbles: first 32, high: next 32)
DEFAULT_GROUP = 128


def padded_cols(cols: int, group: int) -> int:
    return -(-cols // group) * group


def check_group(group: int, what: str = "") -> None:
    """ValueError unless `group` is a positive multiple of NIBBLE_BLOCK (`what`: a prefix
    naming the argument)."""
    if group <= 0 or group % NIBBLE_BLOCK:
        raise ValueError(f"{what + ': ' if what else ''}group size {group} is not a positive "
                         f"multiple of {NIBBLE_BLOCK}")


@dataclass(frozen=True)
class AsymTensor:
    """An asymmetric group-quantized matrix (q4, q5, q6) in the on-disk layout (arrays may
    be views into a mapped file): value = (q - zero) * scale per group, q in 0..qmax; the
    subclass names the packing of `data`."""

    data: np.ndarray    # uint8 [R, Cp*bits/8]  packed codes (the subclass's layout)
    scales: np.ndarray  # float32 [R, NG]
    zeros: np.ndarray   # uint8 [R, NG], 0..qmax
    rows: int
    cols: int
    group: int

    @property
    def cols_padded(self) -> int:
        return padded_cols(self.cols, self.group)


@dataclass(frozen=True)
class Q4Tensor(AsymTensor):
    """An INT4 matrix: data uint8 [R, Cp/2], packed nibbles in FORMAT.md nibble order."""


@dataclass(frozen=True)
class Q8Tensor:
    data: np.ndarray    # int8 [R, Cp]
    scales: np.ndarray  # float32 [R, NG]
    rows: int
    cols: int
    group: int


@dataclass(frozen=True)
class Q6Tensor(AsymTensor):
    """A 6-bit matrix: data uint8 [R, Cp*3/4], 48 bytes per 64 values, FORMAT.md `q6` order."""


# ----------------------------------------------------------------------------- nibbles

def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [R, Cp] -> packed bytes [R, Cp/2] in FORMAT.md order."""
    rows, cp = q.shape
    blocks = q.reshape(rows, cp // NIBBLE_BLOCK, 2, 32).astype(np.uint8)
    packed = blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(rows, cp // 2))


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """packed bytes [R, Cp/2] -> uint8 values 0..15 [R, Cp]."""
    rows, half = packed.shape
    blocks = packed.reshape(rows, half // 32, 32)
    out = np.empty((rows, half // 32, 2, 32), dtype=np.uint8)
    out[:, :, 0, :] = blocks & 0x0F
    out[:, :, 1, :] = blocks >> 4
    return out.reshape(rows, half * 2)


# ----------------------------------------------------------------------------- q4

Q4_CLIPS = ("mse", "minmax")
DEFAULT_Q4_CLIP = "mse"
# Shrink factors of a group's range tried by clip="mse" (1.00, 0.98, .., 0.80), each range
# centred on the group's midpoint. (Also trying, per factor, the range that keeps the lower
# or the upper end lowered the error by under 0.1% on Gaussian, Student-t, Laplace,
# log-normal, skewed and outlier groups, for 2.8x the time.)
Q4_CLIP_GRID = tuple(round(1.0 - 0.02 * i, 2) for i in range(11))
_CHUNK_GROUPS = 1024          # groups per search step (one reused buffer, 1 MiB at group 128)
_IMPROVE = 1e-12              # a later candidate must beat the kept one by this (relative)


def quantize_q4(w: np.ndarray, group: int = DEFAULT_GROUP,
                act_scale: np.ndarray | None = None, clip: str = DEFAULT_Q4_CLIP,
                group_codes=None) -> Q4Tensor:
    """Asymmetric INT4 group quantization of a [R, C] matrix (round to nearest).

    `clip` picks each group's scale and zero point (docs/FORMAT.md, "Rounding"):
    "minmax" maps the group's min..max onto 0..15; "mse" (default) also tries that range
    (extended to hold 0) shrunk by the factors of Q4_CLIP_GRID around the group's midpoint
    and keeps, per group, the candidate with the smallest squared error (min/max first: a
    candidate replaces the kept one only when strictly better, so the result is never worse
    than "minmax").

    `act_scale` (optional, [C]) multiplies the columns before rounding (AWQ-style); the
    caller stores it and divides the activations by it, so the stored matrix stays the
    plain product the kernels expect.
    """
    if np.ndim(w) != 2:
        raise ValueError(f"quantize_q4 expects a matrix, got shape {np.shape(w)}")
    a = None if act_scale is None else np.asarray(act_scale, dtype=np.float64)[None, :]
    rows, cols = np.shape(w)
    return quantize_rows("q4", lambda r0, r1: w[r0:r1] if a is None else w[r0:r1] * a,
                         rows, cols, group, clip, group_codes)


# Rows are quantized in blocks of about this many bytes of float64 (each block's working
# set is a few times that): a quantizer's memory is its output plus one block, whatever
# the matrix (an embedding of 129,280 x 7,168 in float64 alone is 7.4 GB). Every group
# lies in one row, so the blocks give exactly the whole matrix's result.
ROW_BLOCK_BYTES = 16 << 20


def row_blocks(rows: int, cols: int):
    """(r0, r1) row ranges of about ROW_BLOCK_BYTES of float64 each."""
    step = max(1, ROW_BLOCK_BYTES // (8 * max(cols, 1)))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def quantize_rows(kind: str, read, rows: int, cols: int, group: int = DEFAULT_GROUP,
                  clip: str = DEFAULT_Q4_CLIP, group_codes=None):
    """Quantize a [rows, cols] matrix given by `read(r0, r1)` (its rows r0..r1, any float
    dtype) block by block (row_blocks) into a Q4Tensor, Q6Tensor or Q8Tensor (`kind`
    "q4", "q6", "q8"): the matrix is never held in float64, nor whole unless `read` holds it.
    `group_codes`: q4/q6's per-group search, q4_group_codes (default) or a function with its
    signature and results (the converter passes kernels.q4_group_codes, the same in C)."""
    check_group(group)
    if kind not in ("q4", "q6", "q8"):
        raise ValueError(f"quantize_rows: kind {kind!r} is not q4, q6 or q8")
    if kind != "q8":
        cls, bits, pack = (Q4Tensor, 4, pack_nibbles) if kind == "q4" else (Q6Tensor, 6, pack_q6)
        return quantize_asym_rows(cls, bits, pack, read, rows, cols, group, clip, group_codes)
    ng = padded_cols(cols, group) // group
    data = np.empty((rows, ng * group), np.int8)
    scales = np.empty((rows, ng), np.float32)
    for r0, r1 in row_blocks(rows, cols):
        data[r0:r1], scales[r0:r1] = _q8_codes(_read_block(read, r0, r1, cols, "quantize_rows"),
                                               group)
    return Q8Tensor(data, scales, rows, cols, group)


def quantize_asym_rows(cls, bits: int, pack, read, rows: int, cols: int,
                       group: int = DEFAULT_GROUP, clip: str = DEFAULT_Q4_CLIP,
                       group_codes=None, who: str = "quantize_rows"):
    """quantize_rows for an AsymTensor class `cls` of `bits` bits (q4, q5, q6): codes
    0..2^bits-1 by `clip` (_q4_codes), packed by `pack` ([R, Cp] -> [R, Cp*bits/8])."""
    check_group(group)
    ng = padded_cols(cols, group) // group
    data = np.empty((rows, ng * group * bits // 8), np.uint8)
    scales = np.empty((rows, ng), np.float32)
    zeros = np.empty((rows, ng), np.uint8)
    for r0, r1 in row_blocks(rows, cols):
        w = _read_block(read, r0, r1, cols, who)
        q, scales[r0:r1], zeros[r0:r1] = _q4_codes(w, group, clip, (1 << bits) - 1,
                                                   group_codes or q4_group_codes)
        data[r0:r1] = pack(q)
        del q, w
    return cls(data, scales, zeros, rows, cols, group)


def _read_block(read, r0: int, r1: int, cols: int, who: str) -> np.ndarray:
    """Rows r0..r1 from `read` as float64, refusing a block of the wrong shape."""
    w = np.asarray(read(r0, r1), dtype=np.float64)
    if w.shape != (r1 - r0, cols):
        raise ValueError(f"{who}: rows {r0}..{r1} read as shape {w.shape}, "
                         f"expected {(r1 - r0, cols)}")
    return w


def fake_quant_q4(w: np.ndarray, group: int = DEFAULT_GROUP,
                  clip: str = DEFAULT_Q4_CLIP) -> np.ndarray:
    """dequantize_q4(quantize_q4(w, group, clip=clip)) without packing: float64 [R, C]."""
    w = np.asarray(w, dtype=np.float64)
    q, scales, zeros = _q4_codes(w, group, clip)
    rows, cp = q.shape
    g = (q.reshape(rows, -1, group).astype(np.float64) - zeros[:, :, None]) \
        * scales.astype(np.float64)[:, :, None]
    return g.reshape(rows, cp)[:, : w.shape[1]]


def _q4_codes(w: np.ndarray, group: int, clip: str, qmax: int = 15, group_codes=None):
    """float64 [R, C] -> (q uint8 [R, Cp] unpacked, scales float32 [R, NG], zeros uint8 [R, NG]);
    levels 0..qmax (15: q4, 63: q6)."""
    check_group(group)
    if clip not in Q4_CLIPS:
        raise ValueError(f"q4 clip {clip!r}: must be one of {', '.join(Q4_CLIPS)}")
    if w.ndim != 2:
        raise ValueError(f"q4 quantization expects a matrix, got shape {w.shape}")
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    ng = cp // group
    full = cols // group                       # groups with `group` real values
    q = np.empty((rows, cp), dtype=np.uint8)
    scales = np.empty((rows, ng), dtype=np.float32)
    zeros = np.empty((rows, ng), dtype=np.uint8)
    # A NaN/Inf weight gives a non-finite scale, which validate.check_tensor reports (a
    # conversion refuses it with one line); no numpy warning on the way.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        parts = [(0, full, group)] if full else []
        if cols % group:
            parts.append((full, ng, cols - full * group))   # last partial group: real values only
        for g0, g1, k in parts:
            blk = np.ascontiguousarray(w[:, g0 * group: g0 * group + (g1 - g0) * k]).reshape(-1, k)
            qq, s, z = (group_codes or q4_group_codes)(blk, clip, qmax)
            n = g1 - g0
            qv = q[:, g0 * group: g1 * group].reshape(rows, n, group)
            qv[:, :, :k] = qq.reshape(rows, n, k)
            qv[:, :, k:] = z.reshape(rows, n, 1).astype(np.uint8)   # padding -> exactly 0
            scales[:, g0:g1] = s.reshape(rows, n)
            zeros[:, g0:g1] = z.reshape(rows, n).astype(np.uint8)
    return q, scales, zeros


def q4_group_codes(blk: np.ndarray, clip: str = DEFAULT_Q4_CLIP, qmax: int = 15):
    """Each group's (row of `blk`, float64 [N, K]) scale and zero point (q4_group_params)
    and its codes: -> (q uint8 [N, K], scale [N], zero [N])."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        s, z = q4_group_params(blk, clip, qmax)
        q = np.clip(np.round(blk / s[:, None]) + z[:, None], 0, qmax).astype(np.uint8)
    return q, s, z


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float64)


def _sq_err(b: np.ndarray, s: np.ndarray, z: np.ndarray, t: np.ndarray,
            qmax: float = 15.0) -> np.ndarray:
    """Per group (row of b): sum of ((q - z) * s - b)^2, q = clamp(round(b / s) + z, 0, qmax),
    computed in the buffer t (shape of b) without allocating."""
    np.divide(b, s[:, None], out=t)
    np.rint(t, out=t)                                   # = np.round: half to even
    np.clip(t, -z[:, None], qmax - z[:, None], out=t)   # q - z
    t *= s[:, None]
    t -= b
    t *= t
    return t.sum(axis=1)


def q4_group_params(blk: np.ndarray, clip: str = DEFAULT_Q4_CLIP, qmax: int = 15):
    """Scale and zero point of each row of `blk` (float64 [N, K]: N groups of K values),
    for levels 0..qmax (15: q4; 63: q6, the same rules with 63 in place of 15).

    -> (scale float64 [N], every value exactly a float32; zero float64 [N], integers 0..qmax).
    Deterministic: elementwise float64 arithmetic and one fixed-order sum per group; the
    candidates are tried in a fixed order and a later one is kept only when it lowers the
    group's squared error by more than a relative 1e-12, so last-bit differences in a sum
    cannot change the choice.
    """
    n = blk.shape[0]
    scale = np.empty(n)
    zero = np.empty(n)
    for a in range(0, n, _CHUNK_GROUPS):
        s, z = _params_chunk(np.ascontiguousarray(blk[a:a + _CHUNK_GROUPS]), clip, float(qmax))
        scale[a:a + len(s)] = s
        zero[a:a + len(s)] = z
    return scale, zero


def _params_chunk(b: np.ndarray, clip: str, qmax: float = 15.0):
    lo = b.min(axis=1)
    hi = b.max(axis=1)
    # min/max (docs/FORMAT.md): scale (hi - lo) / qmax; a constant group c is stored exactly
    # with scale |c| (1 for c == 0).
    sc = (hi - lo) / qmax
    sc = np.where(sc <= 0, np.where(lo != 0, np.abs(lo), 1.0), sc)
    s = _f32(sc)
    # a positive scale below float32's range would be 0: use the smallest float32 instead
    s = np.where((s == 0) & (sc > 0), float(np.finfo(np.float32).smallest_subnormal), s)
    z = np.clip(np.round(-lo / s), 0, qmax)
    if clip == "minmax":
        return s, z
    best_s, best_z = s, z
    t = np.empty_like(b)
    best_e = _sq_err(b, s, z, t, qmax)
    # Candidates: the range that also holds 0 (every level set holds 0: zero is 0..qmax),
    # shrunk by f, centred on the group's midpoint (the zero point clamps it to 0..15).
    lo0, hi0 = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    span = hi0 - lo0
    mid = (lo + hi) / 2.0
    for f in Q4_CLIP_GRID:
        s = _f32(span * f / qmax)
        ok = (s > 0) & np.isfinite(s)
        s = np.where(ok, s, 1.0)
        z = np.clip(np.round(qmax / 2 - mid / s), 0, qmax)
        e = _sq_err(b, s, z, t, qmax)
        better = ok & (e < best_e * (1.0 - _IMPROVE))
        best_e = np.where(better, e, best_e)
        best_s = np.where(better, s, best_s)
        best_z = np.where(better, z, best_z)
    return best_s, best_z


def dequantize_q4(t: Q4Tensor) -> np.ndarray:
    """Q4Tensor -> float64 [R, C]."""
    return dequantize_asym(t, unpack_nibbles(np.asarray(t.data)))


def dequantize_asym(t: AsymTensor, q: np.ndarray) -> np.ndarray:
    """(q - zero) * scale per group of t's unpacked codes q [R, Cp] -> float64 [R, C]."""
    z = np.repeat(np.asarray(t.zeros, dtype=np.float64), t.group, axis=1)
    s = np.repeat(np.asarray(t.scales, dtype=np.float64), t.group, axis=1)
    return ((q.astype(np.float64) - z) * s)[:, : t.cols]


# ----------------------------------------------------------------------------- q6

Q6_BLOCK_BYTES = 48   # bytes per 64 values: 32 of low nibbles (q4's order), 16 of high bits


def pack_q6(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..63 [R, Cp] -> packed bytes [R, Cp*3/4] in FORMAT.md `q6` order: per
    64-value block, the low 4 bits of each value as q4's nibbles (byte j: value j low,
    value 32+j high), then 16 bytes whose byte i holds the top 2 bits of values i, 16+i,
    32+i and 48+i in bits 0-1, 2-3, 4-5 and 6-7."""
    rows, cp = q.shape
    v = q.reshape(rows, cp // NIBBLE_BLOCK, NIBBLE_BLOCK).astype(np.uint8)
    lo = v & 0x0F
    ql = lo[:, :, :32] | (lo[:, :, 32:] << 4)
    h = (v >> 4).reshape(rows, -1, 4, 16)
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    return np.ascontiguousarray(np.concatenate([ql, qh], axis=2).reshape(rows, cp * 3 // 4))


def unpack_q6(packed: np.ndarray) -> np.ndarray:
    """packed bytes [R, Cp*3/4] -> uint8 values 0..63 [R, Cp]."""
    rows, nb = packed.shape
    b = packed.reshape(rows, nb // Q6_BLOCK_BYTES, Q6_BLOCK_BYTES)
    ql, qh = b[:, :, :32], b[:, :, 32:]
    out = np.empty((rows, nb // Q6_BLOCK_BYTES, NIBBLE_BLOCK), dtype=np.uint8)
    out[:, :, :32] = ql & 0x0F
    out[:, :, 32:] = ql >> 4
    for k in range(4):
        out[:, :, 16 * k:16 * (k + 1)] |= ((qh >> (2 * k)) & 3) << 4
    return out.reshape(rows, nb // Q6_BLOCK_BYTES * NIBBLE_BLOCK)


def quantize_q6(w: np.ndarray, group: int = DEFAULT_GROUP,
                clip: str = DEFAULT_Q4_CLIP, group_codes=None) -> Q6Tensor:
    """Asymmetric 6-bit group quantization of a [R, C] matrix: q4's rules (scale and zero
    point per group by `clip`, padding stored as the zero point) with levels 0..63."""
    if np.ndim(w) != 2:
        raise ValueError(f"quantize_q6 expects a matrix, got shape {np.shape(w)}")
    rows, cols = np.shape(w)
    return quantize_rows("q6", lambda r0, r1: w[r0:r1], rows, cols, group, clip, group_codes)


def dequantize_q6(t: Q6Tensor) -> np.ndarray:
    """Q6Tensor -> float64 [R, C]."""
    return dequantize_asym(t, unpack_q6(np.asarray(t.data)))


def matvec_q6_ref(t: Q6Tensor, x: np.ndarray) -> np.ndarray:
    """float64 reference of y = W x for a q6 matrix (x [C] or [N, C])."""
    return np.asarray(x, dtype=np.float64) @ dequantize_q6(t).T


def matvec_q6_q8_ref(t: Q6Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the q6 int8-activation path: exact integer dots per group, then
    scale_w * scale_x * (dot - zero * xsum), as matvec_q4_q8_ref."""
    return matvec_asym_q8_ref(t, unpack_q6(np.asarray(t.data)), x)


def bits_per_weight(t) -> float:
    """Stored bits per weight of a quantized matrix (data, scales and zero points over
    rows * cols: padding included), or of a float array."""
    if isinstance(t, (AsymTensor, Q8Tensor)):
        n = t.data.nbytes + t.scales.nbytes + (t.zeros.nbytes if hasattr(t, "zeros") else 0)
        return 8.0 * n / (t.rows * t.cols)
    return 8.0 * np.asarray(t).itemsize


# ----------------------------------------------------------------------------- q8

def quantize_q8(w: np.ndarray, group: int = DEFAULT_GROUP) -> Q8Tensor:
    check_group(group)
    rows, cols = np.shape(w)
    return quantize_rows("q8", lambda r0, r1: w[r0:r1], rows, cols, group)


def _q8_codes(w: np.ndarray, group: int):
    """float64 [R, C] -> (int8 [R, Cp], float32 scales [R, NG]): symmetric, amax / 127."""
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    wp = np.zeros((rows, cp))
    wp[:, :cols] = w
    g = wp.reshape(rows, cp // group, group)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN/Inf -> non-finite scale (see q4)
        amax = np.abs(g).max(axis=2)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.round(g / scale.astype(np.float64)[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(rows, cp), scale


def dequantize_q8(t: Q8Tensor) -> np.ndarray:
    s = np.repeat(np.asarray(t.scales, dtype=np.float64), t.group, axis=1)
    return (np.asarray(t.data, dtype=np.float64) * s)[:, : t.cols]


# ----------------------------------------------------------------------------- activations

def quantize_act_q8(x: np.ndarray, group: int = DEFAULT_GROUP):
    """Per-group symmetric int8 quantization of activations [N, C] (or [C]).

    Returns (xq int8 [N, Cp], xs float32 [N, NG], xsum int32 [N, NG]); padding is 0.
    This is the reference of the C kernel `act_quantize_q8`.
    """
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    n, cols = x.shape
    cp = padded_cols(cols, group)
    xp = np.zeros((n, cp), dtype=np.float32)
    xp[:, :cols] = x
    g = xp.reshape(n, cp // group, group)
    amax = np.abs(g).max(axis=2)
    xs = (amax / 127.0).astype(np.float32)
    inv = np.where(xs > 0, 1.0 / np.where(xs > 0, xs, 1.0), 0.0).astype(np.float32)
    xq = np.clip(np.rint(g * inv[:, :, None]), -127, 127).astype(np.int8)
    xsum = xq.astype(np.int32).sum(axis=2)
    return xq.reshape(n, cp), xs, xsum


def quantize_kv_q8(rows: np.ndarray):
    """The q8 KV-cache row format (kvcache.py, ck_step_attn.c's kv_store_row): each row of the
    last axis [..., D] quantized alone, symmetric, one float32 scale per row -- the rule of
    quantize_act_q8 with one group of D values (scale max|x| / 127, codes rint(x * (1 /
    scale)), half to even, clipped to +-127). Returns (codes int8 [..., D], scales float32
    [...])."""
    rows = np.asarray(rows, dtype=np.float32)
    d = rows.shape[-1]
    q, s, _ = quantize_act_q8(rows.reshape(-1, d), group=d)
    return q.reshape(rows.shape), s.reshape(rows.shape[:-1])


def dequantize_kv_q8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rows of the q8 KV format back to float32: codes * scale (float32, as the C side)."""
    return q.astype(np.float32) * np.asarray(scales, np.float32)[..., None]


def matvec_q4_ref(t: Q4Tensor, x: np.ndarray) -> np.ndarray:
    """float64 reference of y = W x for x [C] or X [N, C] (returns [R] or [N, R])."""
    w = dequantize_q4(t)
    x = np.asarray(x, dtype=np.float64)
    return x @ w.T


def matvec_q4_q8_ref(t: Q4Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the int8-activation path: exact integer dot products per group."""
    return matvec_asym_q8_ref(t, unpack_nibbles(np.asarray(t.data)), x)


def matvec_asym_q8_ref(t: AsymTensor, q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The int8-activation path (the kernels' arithmetic) of t, unpacked codes q [R, Cp]: exact
    integer dots per group, then scale_w * scale_x * (dot - zero * xsum) over the groups."""
    xq, xs, xsum = quantize_act_q8(x, t.group)
    ng = t.cols_padded // t.group
    qg = q.astype(np.int64).reshape(t.rows, ng, t.group)
    xg = xq.astype(np.int64).reshape(xq.shape[0], ng, t.group)
    dots = np.einsum("rgk,ngk->nrg", qg, xg)                      # [N, R, NG]
    corr = dots - np.asarray(t.zeros, np.int64)[None] * xsum.astype(np.int64)[:, None, :]
    y = (corr * np.asarray(t.scales, np.float64)[None] * xs.astype(np.float64)[:, None, :]).sum(2)
    return y if np.ndim(x) == 2 else y[0]


# ----------------------------------------------------------------------------- more references
# (q8: the references of kernels.q8_matmul; the fused expert FFN's is ops.expert_ffn_ref)

def matvec_q8_ref(t: Q8Tensor, x: np.ndarray) -> np.ndarray:
    """float64 reference of y = W x for a q8 matrix (x [C] or [N, C])."""
    return np.asarray(x, dtype=np.float64) @ dequantize_q8(t).T


def matvec_q8_q8_ref(t: Q8Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the q8 int8-activation path: exact integer dot products per group."""
    xq, xs, _ = quantize_act_q8(x, t.group)
    ng = padded_cols(t.cols, t.group) // t.group
    wg = np.asarray(t.data, np.int64).reshape(t.rows, ng, t.group)
    xg = xq.astype(np.int64).reshape(xq.shape[0], ng, t.group)
    dots = np.einsum("rgk,ngk->nrg", wg, xg)
    y = (dots * np.asarray(t.scales, np.float64)[None] * xs.astype(np.float64)[:, None, :]).sum(2)
    return y if np.ndim(x) == 2 else y[0]
