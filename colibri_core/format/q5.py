"""The `q5` format (container 1.3): 5-bit asymmetric group quantization, in plain numpy.

q4's rules with 32 levels: per group of G input channels a float32 scale and a uint8 zero
point 0..31, value = (q - zero) * scale, q in 0..31; the scale / zero point search is
quant.q4_group_params with qmax 31 (clip "mse" or "minmax"). It exists for GGUF files
(issue 33): a Q5_K expert class (5.5 bits per weight, 5.85 in a Q5_K_M file with its
Q6_K ffn_down) had nothing between q4 g64 (4.63) and q8 (8.5); q5 g128 stores 5.31 and
q5 g64 5.63 bits per weight.

Layout (docs/FORMAT.md `q5`), per 64-value block 40 bytes: q4's 32 bytes of low nibbles
(byte j: value j in the low nibble, value 32+j in the high one), then 8 bytes holding the
64 values' fifth bits, byte i those of values i, 8+i, .., 56+i in its bits 0..7 (as q6's
top bits: a shift per 8-byte lane puts them in place). The C kernels (kernels/c/ck_q5.c)
are tested against the references below.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import (DEFAULT_GROUP, DEFAULT_Q4_CLIP, NIBBLE_BLOCK, AsymTensor, dequantize_asym,
                    matvec_asym_q8_ref, pack_nibbles, quantize_asym_rows, unpack_nibbles)

Q5_BLOCK_BYTES = 40      # bytes per 64 values: 32 of low nibbles, 8 of fifth bits
Q5_QMAX = 31


@dataclass(frozen=True)
class Q5Tensor(AsymTensor):
    """A 5-bit matrix: data uint8 [R, Cp*5/8], 40 bytes per 64 values (the layout above);
    zeros 0..31."""


def pack_q5(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..31 [R, Cp] -> packed bytes [R, Cp*5/8] (the layout above)."""
    rows, cp = q.shape
    v = q.reshape(rows, cp // NIBBLE_BLOCK, NIBBLE_BLOCK).astype(np.uint8)
    lo = pack_nibbles((v & 0x0F).reshape(rows, cp)).reshape(rows, -1, 32)
    fifth = ((v >> 4) & 1).reshape(rows, -1, 8, 8).transpose(0, 1, 3, 2)   # [R, NB, i, k]
    hi = np.packbits(fifth, axis=3, bitorder="little")[..., 0]             # [R, NB, 8]
    return np.ascontiguousarray(np.concatenate([lo, hi], axis=2).reshape(rows, cp * 5 // 8))


def unpack_q5(packed: np.ndarray) -> np.ndarray:
    """packed bytes [R, Cp*5/8] -> uint8 values 0..31 [R, Cp]."""
    rows, nb = packed.shape
    b = np.asarray(packed).reshape(rows, nb // Q5_BLOCK_BYTES, Q5_BLOCK_BYTES)
    lo = unpack_nibbles(np.ascontiguousarray(b[:, :, :32]).reshape(rows, -1))
    bits = np.unpackbits(b[:, :, 32:, None], axis=3, bitorder="little")    # [R, NB, i, k]
    hi = bits.transpose(0, 1, 3, 2).reshape(rows, -1)                      # value 8k + i
    return lo | (hi << 4)


def quantize_q5(w: np.ndarray, group: int = DEFAULT_GROUP, clip: str = DEFAULT_Q4_CLIP,
                group_codes=None) -> Q5Tensor:
    """Asymmetric 5-bit group quantization of a [R, C] matrix: q4's rules (scale and zero
    point per group by `clip`, padding stored as the zero point) with levels 0..31, a
    block of rows at a time (quant.row_blocks). `group_codes`: as quant.quantize_rows's."""
    if np.ndim(w) != 2:
        raise ValueError(f"quantize_q5 expects a matrix, got shape {np.shape(w)}")
    rows, cols = np.shape(w)
    return quantize_q5_rows(lambda r0, r1: w[r0:r1], rows, cols, group, clip, group_codes)


def quantize_q5_rows(read, rows: int, cols: int, group: int = DEFAULT_GROUP,
                     clip: str = DEFAULT_Q4_CLIP, group_codes=None) -> Q5Tensor:
    """As quant.quantize_rows for q5: `read(r0, r1)` gives rows r0..r1."""
    return quantize_asym_rows(Q5Tensor, 5, pack_q5, read, rows, cols, group, clip,
                              group_codes, "quantize_q5_rows")


def dequantize_q5(t: Q5Tensor) -> np.ndarray:
    """Q5Tensor -> float64 [R, C]."""
    return dequantize_asym(t, unpack_q5(np.asarray(t.data)))


def matvec_q5_ref(t: Q5Tensor, x: np.ndarray) -> np.ndarray:
    """float64 reference of y = W x for a q5 matrix (x [C] or [N, C])."""
    return np.asarray(x, dtype=np.float64) @ dequantize_q5(t).T


def matvec_q5_q8_ref(t: Q5Tensor, x: np.ndarray) -> np.ndarray:
    """Reference of the int8-activation path (the kernels' arithmetic): x quantized per
    group (quant.quantize_act_q8), exact integer dots per group, then
    scale_w * scale_x * (dot - zero * xsum) summed over the groups."""
    return matvec_asym_q8_ref(t, unpack_q5(np.asarray(t.data)), x)
