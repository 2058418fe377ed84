"""MXFP4 matrices (OCP microscaling FP4, as gpt-oss ships its experts) in plain numpy: the
layout, dequantization, quantization and the reference of the kernels' `mxfp4` tiles.

A row is blocks of 32 values, each 16 bytes of e2m1 codes and one e8m0 exponent: value
= E2M1[code] * 2^(e - 127). Byte j of a block holds value 2j in its low nibble and 2j+1
in its high nibble -- the byte order of the checkpoints' `*_blocks` tensors, stored as
they are (docs/FORMAT.md `mxfp4`). Rows are padded to a multiple of 64 values (code 0,
exponent 127: zeros), so that an int8 activation group of 64 holds two whole blocks.

The kernels (ck_*.c `mx_i8`) look the codes up as E2M1 x 2, integers -12..12, take exact
integer dots per block with the int8 activations (quant.quantize_act_q8, group 64) and add
dot * 2^(e - 128) * xs per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import padded_cols, quantize_act_q8

MX_BLOCK = 32          # values per e8m0 exponent
MX_GROUP = 64          # the int8 activations' group (two blocks)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E2M1_X2 = (E2M1 * 2).astype(np.int8)       # the kernels' lookup: integers -12..12
E8M0_NAN = 255                              # the OCP format's NaN exponent: refused


@dataclass(frozen=True)
class MXFP4Tensor:
    """An MXFP4 matrix in the on-disk layout (arrays may be views into a mapped file)."""

    data: np.ndarray    # uint8 [R, Cp/2]   e2m1 codes, two per byte (low nibble first)
    exps: np.ndarray    # uint8 [R, Cp/32]  e8m0 block exponents
    rows: int
    cols: int

    group = MX_GROUP    # the activations' group (kernels, ops.matmul)

    @property
    def cols_padded(self) -> int:
        return padded_cols(self.cols, MX_GROUP)


def from_blocks(blocks: np.ndarray, scales: np.ndarray) -> MXFP4Tensor:
    """A checkpoint's `*_blocks` uint8 [R, C/32, 16] and `*_scales` uint8 [R, C/32] of one
    matrix -> MXFP4Tensor, byte for byte (padded to a multiple of 64 columns)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.ndim != 3 or blocks.shape[2] != 16 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: "
                         f"expected [R, C/32, 16] and [R, C/32]")
    rows, nb = scales.shape
    cols = nb * MX_BLOCK
    cp = padded_cols(cols, MX_GROUP)
    data = np.zeros((rows, cp // 2), np.uint8)
    exps = np.full((rows, cp // MX_BLOCK), 127, np.uint8)
    data[:, : cols // 2] = blocks.reshape(rows, cols // 2)
    exps[:, :nb] = scales
    return MXFP4Tensor(data, exps, rows, cols)


def from_gguf_blocks(raw: np.ndarray, rows: int, cols: int) -> MXFP4Tensor:
    """GGUF's MXFP4 blocks (17 bytes: the e8m0 exponent, then 16 bytes whose byte j holds
    value j in its low nibble and value 16 + j in its high one) of a [rows, cols] matrix
    -> MXFP4Tensor: the same codes and exponents, the nibbles reordered (lossless)."""
    b = np.asarray(raw, np.uint8).reshape(rows, cols // MX_BLOCK, 17)
    qs = b[:, :, 1:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)           # [R, NB, 32] value order
    return from_blocks(q[:, :, 0::2] | (q[:, :, 1::2] << 4), b[:, :, 0])


def codes(t: MXFP4Tensor) -> np.ndarray:
    """The e2m1 codes uint8 [R, Cp] in value order."""
    d = np.asarray(t.data)
    out = np.empty((d.shape[0], d.shape[1] * 2), np.uint8)
    out[:, 0::2] = d & 0x0F
    out[:, 1::2] = d >> 4
    return out


def dequantize_mxfp4(t: MXFP4Tensor) -> np.ndarray:
    """MXFP4Tensor -> float64 [R, C] (exact: every value is a float64)."""
    v = E2M1[codes(t)]
    e = np.repeat(np.asarray(t.exps, np.float64) - 127.0, MX_BLOCK, axis=1)
    return np.ldexp(v, e.astype(np.int64))[:, : t.cols]


def quantize_mxfp4(w: np.ndarray) -> MXFP4Tensor:
    """float [R, C] (C a multiple of 32) -> MXFP4Tensor, round to nearest e2m1 (ties to
    the even code). Per block the exponent is the smallest that holds max|w| within 6
    (no clipping) or the one below it (its largest values clipped to +-6), whichever
    gives the smaller squared error (the first on a tie)."""
    w = np.asarray(w, np.float64)
    if w.ndim != 2 or w.shape[1] % MX_BLOCK:
        raise ValueError(f"quantize_mxfp4: expected [R, C] with C a multiple of {MX_BLOCK}, "
                         f"got {list(w.shape)}")
    rows, cols = w.shape
    b = w.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore"):
        e_hi = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 6.0)), -127)
    e_hi = np.clip(e_hi, -127, 127)
    best_q = best_e = best_err = None
    for e in (e_hi, np.maximum(e_hi - 1, -127)):
        q = _nearest_codes(b / np.ldexp(1.0, e.astype(np.int64))[:, :, None])
        err = ((np.ldexp(E2M1[q], e.astype(np.int64)[:, :, None]) - b) ** 2).sum(axis=2)
        if best_q is None:
            best_q, best_e, best_err = q, e, err
        else:
            take = err < best_err
            best_q = np.where(take[:, :, None], q, best_q)
            best_e = np.where(take, e, best_e)
            best_err = np.where(take, err, best_err)
    q = best_q.reshape(rows, cols).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(rows, cols // MX_BLOCK, 16)
    return from_blocks(packed, (best_e + 127).astype(np.uint8))


_MAGS = E2M1[:8]


def _nearest_codes(v: np.ndarray) -> np.ndarray:
    """Codes of the e2m1 values nearest to v (clamped to +-6; ties to the even code, as
    round-to-nearest-even on the 3-bit magnitude)."""
    a = np.minimum(np.abs(v), 6.0)
    d = np.abs(a[..., None] - _MAGS)
    m = np.argmin(d, axis=-1)                        # first (lower) code on a tie
    tie = np.take_along_axis(d, np.minimum(m + 1, 7)[..., None], -1)[..., 0] == d.min(-1)
    m = np.where(tie & (m % 2 == 1) & (m < 7), m + 1, m)
    return (m + 8 * (v < 0)).astype(np.uint8)


def matvec_mxfp4_q8_ref(t: MXFP4Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the kernels' int8 path (float64): x [C] or [N, C] quantized per group
    of 64 (quant.quantize_act_q8), exact integer dots per block of the doubled codes,
    each times 2^(e - 128) * xs, summed."""
    xq, xs, _ = quantize_act_q8(x, MX_GROUP)
    q = E2M1_X2[codes(t)].astype(np.int64)
    nb = t.cols_padded // MX_BLOCK
    dots = np.einsum("rbk,nbk->nrb", q.reshape(t.rows, nb, MX_BLOCK),
                     xq.astype(np.int64).reshape(xq.shape[0], nb, MX_BLOCK))
    ws = np.ldexp(1.0, np.asarray(t.exps, np.int64) - 128)                 # [R, NB]
    xsb = np.repeat(xs.astype(np.float64), 2, axis=1)                       # [N, NB]
    y = (dots * ws[None] * xsb[:, None, :]).sum(axis=2)
    return y if np.ndim(x) == 2 else y[0]


def bits_per_weight_mxfp4(t: MXFP4Tensor) -> float:
    return 8.0 * (t.data.nbytes + t.exps.nbytes) / (t.rows * t.cols)
