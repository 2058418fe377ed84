"""Group quantization in plain numpy: the reference the C kernels are tested against.

Layout and rounding rules are those of docs/FORMAT.md (`q4`, `q8`). Everything here is
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


def check_group(group: int) -> None:
    if group <= 0 or group % NIBBLE_BLOCK:
        raise ValueError(f"group size {group} is not a positive multiple of {NIBBLE_BLOCK}")


@dataclass(frozen=True)
class Q4Tensor:
    """An INT4 matrix in the on-disk layout (arrays may be views into a mapped file)."""

    data: np.ndarray    # uint8 [R, Cp/2]  packed nibbles, FORMAT.md nibble order
    scales: np.ndarray  # float32 [R, NG]
    zeros: np.ndarray   # uint8 [R, NG]
    rows: int
    cols: int
    group: int

    @property
    def cols_padded(self) -> int:
        return padded_cols(self.cols, self.group)


@dataclass(frozen=True)
class Q8Tensor:
    data: np.ndarray    # int8 [R, Cp]
    scales: np.ndarray  # float32 [R, NG]
    rows: int
    cols: int
    group: int


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

def quantize_q4(w: np.ndarray, group: int = DEFAULT_GROUP,
                act_scale: np.ndarray | None = None) -> Q4Tensor:
    """Round-to-nearest asymmetric INT4 quantization of a [R, C] matrix.

    `act_scale` (optional, [C]) multiplies the columns before rounding (AWQ-style); the
    caller stores it and divides the activations by it, so the stored matrix stays the
    plain product the kernels expect.
    """
    check_group(group)
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"quantize_q4 expects a matrix, got shape {w.shape}")
    if act_scale is not None:
        w = w * np.asarray(act_scale, dtype=np.float64)[None, :]
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    ng = cp // group
    q = np.zeros((rows, cp), dtype=np.uint8)
    scales = np.zeros((rows, ng), dtype=np.float32)
    zeros = np.zeros((rows, ng), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        # A NaN/Inf weight gives a non-finite scale, which validate.check_tensor reports
        # (a conversion refuses it with one line); no numpy warning on the way.
        _quantize_q4_groups(w, group, cols, ng, q, scales, zeros)
    return Q4Tensor(pack_nibbles(q), scales, zeros, rows, cols, group)


def _quantize_q4_groups(w, group, cols, ng, q, scales, zeros) -> None:
    for g in range(ng):
        lo_c, hi_c = g * group, min((g + 1) * group, cols)
        blk = w[:, lo_c:hi_c]
        lo = blk.min(axis=1)
        hi = blk.max(axis=1)
        scale = (hi - lo) / 15.0
        const = scale <= 0
        # A constant group c is stored exactly: scale |c| (1 for c == 0).
        scale = np.where(const, np.where(lo != 0, np.abs(lo), 1.0), scale)
        scale32 = scale.astype(np.float32).astype(np.float64)
        zero = np.clip(np.round(-lo / scale32), 0, 15)
        qq = np.clip(np.round(blk / scale32[:, None]) + zero[:, None], 0, 15)
        q[:, lo_c:hi_c] = qq.astype(np.uint8)
        q[:, hi_c:(g + 1) * group] = zero.astype(np.uint8)[:, None]  # padding -> exactly 0
        scales[:, g] = scale32
        zeros[:, g] = zero.astype(np.uint8)


def dequantize_q4(t: Q4Tensor) -> np.ndarray:
    """Q4Tensor -> float64 [R, C]."""
    q = unpack_nibbles(np.asarray(t.data)).astype(np.float64)
    z = np.repeat(np.asarray(t.zeros, dtype=np.float64), t.group, axis=1)
    s = np.repeat(np.asarray(t.scales, dtype=np.float64), t.group, axis=1)
    return ((q - z) * s)[:, : t.cols]


# ----------------------------------------------------------------------------- q8

def quantize_q8(w: np.ndarray, group: int = DEFAULT_GROUP) -> Q8Tensor:
    check_group(group)
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    wp = np.zeros((rows, cp))
    wp[:, :cols] = w
    g = wp.reshape(rows, cp // group, group)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN/Inf -> non-finite scale (see q4)
        amax = np.abs(g).max(axis=2)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.round(g / scale.astype(np.float64)[:, :, None]), -127, 127).astype(np.int8)
    return Q8Tensor(q.reshape(rows, cp), scale, rows, cols, group)


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


def matvec_q4_ref(t: Q4Tensor, x: np.ndarray) -> np.ndarray:
    """float64 reference of y = W x for x [C] or X [N, C] (returns [R] or [N, R])."""
    w = dequantize_q4(t)
    x = np.asarray(x, dtype=np.float64)
    return x @ w.T


def matvec_q4_q8_ref(t: Q4Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the int8-activation path: exact integer dot products per group."""
    xq, xs, xsum = quantize_act_q8(x, t.group)
    q = unpack_nibbles(np.asarray(t.data)).astype(np.int64)      # [R, Cp]
    ng = t.cols_padded // t.group
    qg = q.reshape(t.rows, ng, t.group)
    xg = xq.astype(np.int64).reshape(xq.shape[0], ng, t.group)
    dots = np.einsum("rgk,ngk->nrg", qg, xg)                      # [N, R, NG]
    corr = dots - np.asarray(t.zeros, np.int64)[None] * xsum.astype(np.int64)[:, None, :]
    y = (corr * np.asarray(t.scales, np.float64)[None] * xs.astype(np.float64)[:, None, :]).sum(2)
    return y if np.ndim(x) == 2 else y[0]


# ----------------------------------------------------------------------------- more references
# (q8 and the fused expert FFN, the references of kernels.q8_matmul / kernels.expert_ffn)

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


def expert_ffn_ref(w1: Q4Tensor, w3: Q4Tensor, w2: Q4Tensor, x: np.ndarray,
                   act: str = "float") -> np.ndarray:
    """float64 reference of kernels.expert_ffn (before the routing weight):
    silu(x W1^T) * (x W3^T) @ W2^T. act="int8" follows the int8 kernel: x and the hidden
    activation h (rounded to float32) are quantized per group before each product."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    mv = matvec_q4_q8_ref if act == "int8" else matvec_q4_ref
    g, u = mv(w1, x), mv(w3, x)
    h = g / (1.0 + np.exp(-g)) * u
    return mv(w2, h.astype(np.float32) if act == "int8" else h)
