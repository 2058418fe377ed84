"""The C kernels (colibri_core.kernels) against the numpy references of quant.py and ops.py.

Error bounds (relative, ||y - ref|| / ||ref|| over the whole output):
  act="float" vs the float64 dequantized product ......... FLOAT_TOL = 1e-5
  act="int8"  vs matvec_q4_q8_ref (same integer dots) ..... INT8_TOL  = 1e-5
  expert_ffn float vs float64 composition ................. FLOAT_TOL
  expert_ffn int8 vs the int8 composition (expert_ffn_ref)  FFN_INT8_TOL = 2e-3: h is
      computed in float32 by the kernel and in float64 by the reference, so a few h
      values may round to the neighbouring int8 step before the down projection.
  act_quantize_q8 .......................................... bit-exact
Every kernel runs on every available backend (scalar reference and SIMD) and on 1 and
2 threads; results must not depend on the thread count at all (rows are split, never
the reduction).
The expert FFN and decode attention kernels: test_kernels_ffn_attention.py; argument
checks, backend choice and runtime facts: test_kernels_runtime.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.format import quant as Q

from kernel_helpers import (  # noqa: F401 (backend, threads: fixtures)
    BACKENDS, FFN_INT8_TOL, FLOAT_TOL, GROUPS, INT8_TOL, NS, SHAPES, THREADS,
    backend, case, ffn_case, rel, threads, unaligned_f32, unaligned_q4, unaligned_q6)


# ----------------------------------------------------------------------------- act quant

@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("cols", [1, 63, 64, 100, 128, 130, 300, 1000])
@pytest.mark.parametrize("n", NS)
def test_act_quantize_exact(backend, threads, group, cols, n):
    rng = np.random.default_rng(cols * 100 + n)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 100, (n, 1))).astype(np.float32)
    x[0, : min(cols, group)] = 0.0               # an all-zero group: scale 0, q 0
    if cols > 2:                                 # exact .5 ties after scaling: half-even
        x[-1, :3] = [127.0, 0.5, -1.5]
    x = unaligned_f32(x)
    xq, xs, xsum = K.act_quantize_q8(x, group)
    rq, rs, rsum = Q.quantize_act_q8(x, group)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xs, rs)
    np.testing.assert_array_equal(xsum, rsum)


# ----------------------------------------------------------------------------- q4 matmul

@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", NS)
def test_q4_matmul(backend, threads, group, shape, n):
    t, x, ref_f, ref_i = case(*shape, group, n)
    out = np.empty((n, t.rows), np.float32)
    K.q4_matmul(t, x, out, act="float")
    assert rel(out, ref_f) < FLOAT_TOL
    K.q4_matmul(t, x, out, act="int8")
    assert rel(out, ref_i) < INT8_TOL


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("n", [1, 7])
def test_q4_matmul_unaligned(backend, threads, group, n):
    t, x, ref_f, ref_i = case(37, 300, group, n)
    tu, xu = unaligned_q4(t), unaligned_f32(x)
    out = unaligned_f32(np.zeros((n, t.rows), np.float32))
    K.q4_matmul(tu, xu, out, act="float")
    assert rel(out, ref_f) < FLOAT_TOL
    K.q4_matmul(tu, xu, out, act="int8")
    assert rel(out, ref_i) < INT8_TOL


def test_q4_matmul_vector(backend):
    t, x, ref_f, ref_i = case(259, 1000, 128, 1)
    out = np.empty(t.rows, np.float32)
    for _ in range(2):                            # a repeated call gives the same answer
        K.q4_matmul(t, x[0], out, act="int8")
        assert rel(out, ref_i[0]) < INT8_TOL
    out2 = np.empty((1, t.rows), np.float32)
    K.q4_matmul(t, x, out2)                       # the same row as a batch of one: identical
    np.testing.assert_array_equal(out, out2[0])


@pytest.mark.parametrize("act", ["int8", "float"])
def test_threads_and_backends_agree(act):
    t, x, _, ref_i = case(259, 1000, 128, 33)
    res, old = {}, K.get_threads()
    K._set_parallel_threshold(0)
    for be in BACKENDS:
        K.set_backend(be)
        for th in THREADS:
            K.set_threads(th)
            out = np.empty((33, t.rows), np.float32)
            res[be, th] = K.q4_matmul(t, x, out, act=act)
    K.set_backend("auto")
    K.set_threads(old)
    K._set_parallel_threshold(-1)
    for be in BACKENDS:                          # the thread count never changes a bit
        np.testing.assert_array_equal(res[be, 1], res[be, 2])
    for (be, th), y in res.items():
        assert rel(y, res["scalar", 1]) < 1e-5, (be, th)


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(BACKENDS),
                    reason="needs both the avx2 and avx512vnni backends")
@pytest.mark.parametrize("threads", THREADS)
def test_avx512vnni_bit_identical_to_avx2(threads):
    """The VNNI tiles change only how the exact integer dots are formed: every int8
    result must equal AVX2's bit for bit (odd rows, partial groups, more groups than one
    dot chunk of 32, every token tile width, unaligned parts)."""
    old = K.get_threads()
    K.set_threads(threads)
    K._set_parallel_threshold(0 if threads > 1 else -1)
    try:
        rng = np.random.default_rng(5)
        for rows, cols, group in [(37, 300, 64), (259, 1000, 128), (67, 64 * 43, 64),
                                  (5, 64 * 75, 128), (3, 130, 128)]:
            w = rng.standard_normal((rows, cols)).astype(np.float32)
            t, t8 = unaligned_q4(Q.quantize_q4(w, group)), Q.quantize_q8(w[::-1].copy(), group)
            t6 = unaligned_q6(Q.quantize_q6(w[:, ::-1].copy(), group))
            for n in (1, 2, 3, 4, 5, 9):
                x = unaligned_f32(rng.standard_normal((n, cols)).astype(np.float32))
                res = {}
                for be in ("avx2", "avx512vnni"):
                    K.set_backend(be)
                    res[be] = (K.q4_matmul(t, x, np.empty((n, rows), np.float32)),
                               K.q8_matmul(t8, x, np.empty((n, rows), np.float32)),
                               K.q6_matmul(t6, x, np.empty((n, rows), np.float32)))
                for a, b in zip(res["avx2"], res["avx512vnni"]):
                    np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32),
                                                  err_msg=f"{rows}x{cols} g{group} n{n}")
        for dims in [(300, 259, 64, 128), (130, 300, 128, 64)]:
            for n in (1, 3, 7):
                w1, w3, w2, x, rw, _, _ = ffn_case(*dims, n)
                res = {}
                for be in ("avx2", "avx512vnni"):
                    K.set_backend(be)
                    res[be] = K.expert_ffn(w1, w3, w2, x, np.empty_like(x), act="int8",
                                           row_weights=rw)
                np.testing.assert_array_equal(res["avx2"].view(np.int32),
                                              res["avx512vnni"].view(np.int32))
    finally:
        K.set_backend("auto")
        K.set_threads(old)
        K._set_parallel_threshold(-1)


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(BACKENDS),
                    reason="needs both the avx2 and avx512vnni backends")
@pytest.mark.parametrize("threads", THREADS)
def test_panels_bit_identical_to_tiles(threads):
    """The AVX-512 panel kernel (tokens in the lanes, rows unpacked) against the AVX2
    tiles bit for bit, and against numpy: rows not a multiple of 8, partial groups, a
    tail of groups past the last 8, more groups than one float-pass chunk of 32 (43, 75),
    partial last panels, more than one block of 64 panels (n = 1100)."""
    old = K.get_threads()
    K.set_threads(threads)
    K._set_parallel_threshold(0 if threads > 1 else -1)
    default = K._set_panel_min_tokens(0)
    try:
        rng = np.random.default_rng(23)
        for rows, cols, group, ns in [(37, 300, 64, (8, 17, 33)), (259, 1000, 128, (16, 40)),
                                      (67, 64 * 43, 64, (9, 64)), (13, 64 * 75, 128, (20,)),
                                      (3, 130, 128, (31,)), (24, 256, 128, (1100,))]:
            t = unaligned_q4(Q.quantize_q4(rng.standard_normal((rows, cols)).astype(np.float32), group))
            for n in ns:
                x = unaligned_f32(rng.standard_normal((n, cols)).astype(np.float32))
                res = {}
                for be, mt in (("avx2", 0), ("avx512vnni", 1 << 30), ("avx512vnni", 1)):
                    K.set_backend(be)
                    K._set_panel_min_tokens(mt)
                    res[be, mt] = K.q4_matmul(t, x, np.empty((n, rows), np.float32))
                for y in res.values():
                    np.testing.assert_array_equal(y.view(np.int32), res["avx2", 0].view(np.int32),
                                                  err_msg=f"{rows}x{cols} g{group} n{n}")
                assert rel(res["avx512vnni", 1], Q.matvec_q4_q8_ref(t, x)) < INT8_TOL
    finally:
        K._set_panel_min_tokens(default)
        K.set_backend("auto")
        K.set_threads(old)
        K._set_parallel_threshold(-1)


def test_batch_equals_single_tokens(backend):
    """N > 1 tiles rows x tokens; each row must equal the decode (N = 1) answer."""
    t, x, _, _ = case(37, 300, 64, 7)
    batch = K.q4_matmul(t, x, np.empty((7, 37), np.float32))
    for i in range(7):
        one = K.q4_matmul(t, x[i:i + 1], np.empty((1, 37), np.float32))
        assert rel(one[0], batch[i]) < 1e-6


def test_nan_propagates(backend):
    """A NaN activation must poison its token's outputs, not vanish in the int8 rounding."""
    t, x, _, _ = case(37, 300, 64, 2)
    x = x.copy()
    x[1, 5] = np.nan
    for act in ("int8", "float"):
        y = K.q4_matmul(t, x, np.empty((2, 37), np.float32), act=act)
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all(), act
    xs = K.act_quantize_q8(x, 64)[1]
    assert np.isnan(xs[1, 0]) and np.isfinite(xs[0]).all() and np.isfinite(xs[1, 1:]).all()


# ----------------------------------------------------------------------------- q8 matmul

@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", [(3, 130), (37, 300), (259, 1000)])
@pytest.mark.parametrize("n", [1, 7])
def test_q8_matmul(backend, threads, group, shape, n):
    rows, cols = shape
    rng = np.random.default_rng(rows + cols + group + n)
    t = Q.quantize_q8(rng.standard_normal((rows, cols)).astype(np.float32), group)
    x = unaligned_f32(rng.standard_normal((n, cols)).astype(np.float32))
    out = np.empty((n, rows), np.float32)
    K.q8_matmul(t, x, out, act="float")
    assert rel(out, Q.matvec_q8_ref(t, x)) < FLOAT_TOL
    K.q8_matmul(t, x, out, act="int8")
    assert rel(out, Q.matvec_q8_q8_ref(t, x)) < INT8_TOL


# ----------------------------------------------------------------------------- q6 matmul

@pytest.mark.parametrize("group", GROUPS + [192])
@pytest.mark.parametrize("shape", [(1, 64), (3, 130), (37, 300), (259, 1000), (5, 64 * 43)])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_q6_matmul(backend, threads, group, shape, n):
    """q6 against its numpy references: act="int8" the exact integer group dots of
    matvec_q6_q8_ref, act="float" the float64 dequantized product; parts unaligned. Every
    tile shape: 1..4 rows for one token, 1 row x 2..4 tokens for more."""
    rows, cols = shape
    rng = np.random.default_rng(rows * 3 + cols + group + n)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[:, ::29] *= 6.0                            # outlier columns: wide groups
    t = unaligned_q6(Q.quantize_q6(w, group))
    x = unaligned_f32(rng.standard_normal((n, cols)).astype(np.float32))
    out = np.empty((n, rows), np.float32)
    K.q6_matmul(t, x, out, act="float")
    assert rel(out, Q.matvec_q6_ref(t, x)) < FLOAT_TOL
    K.q6_matmul(t, x, out, act="int8")
    assert rel(out, Q.matvec_q6_q8_ref(t, x)) < INT8_TOL


def test_q6_layout_and_rounding():
    """The packed bytes of docs/FORMAT.md's q6 layout, written out by hand for one block;
    the rounding is q4's with 63 levels: min/max codes exactly 0 and 63, a constant row
    exact, and the padding of a partial group dequantizing to 0."""
    q = np.arange(64, dtype=np.uint8)[None]          # values 0..63 in order
    b = Q.pack_q6(q)[0]
    assert b.shape == (48,)
    assert list(b[:32]) == [(j & 15) | (((32 + j) & 15) << 4) for j in range(32)]
    assert list(b[32:]) == [(i >> 4) | ((16 + i) >> 4) << 2 | ((32 + i) >> 4) << 4
                            | ((48 + i) >> 4) << 6 for i in range(16)]
    assert np.array_equal(Q.unpack_q6(Q.pack_q6(q)), q)
    w = np.linspace(-1.0, 2.0, 128)[None]
    t = Q.quantize_q6(w, 128, clip="minmax")
    codes = Q.unpack_q6(t.data)[0]
    assert codes.min() == 0 and codes.max() == 63
    assert np.abs(Q.dequantize_q6(t) - w).max() <= t.scales[0, 0] / 2 * (1 + 1e-9)
    c = Q.quantize_q6(np.full((1, 100), 0.37), 64)               # constant: stored exactly
    assert np.array_equal(Q.dequantize_q6(c), np.full((1, 100), float(np.float32(0.37))))
    padded = Q.unpack_q6(c.data).astype(np.int64).reshape(2, 64)
    assert np.all(padded[1, 100 - 64:] == c.zeros[0, 1])       # padding = the zero point
    assert Q.bits_per_weight(Q.quantize_q6(np.ones((4, 1024)), 128)) == 6 + 40 / 128


# ----------------------------------------------------------------------------- prefill switch

# (rows, cols, group) for q4/q8 matmul and (hidden, inter, g13, g2) for expert_ffn: odd
# rows (partial row tiles), partial groups and 64-blocks, more groups than one dot chunk
SWITCH_MATMULS = [(3, 130, 64), (37, 300, 128), (259, 1000, 64), (5, 64 * 43, 128)]
SWITCH_FFNS = [(130, 300, 128, 64), (300, 259, 64, 128)]
SWITCH_NS = [1, 2, 3, 4, 5, 6, 7, 9, 13]
# 1: batch tiles for every n > 1; 0: the built-in default; 5: batch tiles of 4 tokens
# and a partial last tile of 3 or fewer run per token; a large value: matvec tiles only
SWITCH_POINTS = [1, 0, 5, 1 << 30]


@pytest.mark.parametrize("threads", THREADS)
def test_switch_point_does_not_change_results(backend, threads):
    """Whether a call of n tokens runs the batch (row x tokens) tiles or the matrix-vector
    tiles once per token (kernels._set_matmul_min_tokens) must not change one bit: every
    backend's tiles compute each (row, token) result with the same arithmetic whatever
    the tile shape."""
    old = K.get_threads()
    K.set_threads(threads)
    K._set_parallel_threshold(0 if threads > 1 else -1)
    default = K._set_matmul_min_tokens(0)
    rng = np.random.default_rng(11)
    try:
        assert default >= 1
        for rows, cols, group in SWITCH_MATMULS:
            t4 = unaligned_q4(Q.quantize_q4(rng.standard_normal((rows, cols)).astype(np.float32), group))
            t8 = Q.quantize_q8(rng.standard_normal((rows, cols)).astype(np.float32), group)
            for n in SWITCH_NS:
                x = unaligned_f32(rng.standard_normal((n, cols)).astype(np.float32))
                res = {}
                for sp in SWITCH_POINTS:
                    assert K._set_matmul_min_tokens(sp) == (sp or default)
                    res[sp] = [f(w, x, np.empty((n, rows), np.float32), act=act)
                               for f, w in ((K.q4_matmul, t4), (K.q8_matmul, t8))
                               for act in ("int8", "float")]
                for sp in SWITCH_POINTS[1:]:
                    for a, b in zip(res[SWITCH_POINTS[0]], res[sp]):
                        np.testing.assert_array_equal(
                            a.view(np.int32), b.view(np.int32),
                            err_msg=f"{rows}x{cols} g{group} n{n} switch {sp}")
        for dims in SWITCH_FFNS:
            for n in SWITCH_NS:
                w1, w3, w2, x, rw, _, ref_i = ffn_case(*dims, n)
                res = {}
                for sp in SWITCH_POINTS:
                    K._set_matmul_min_tokens(sp)
                    res[sp] = [K.expert_ffn(w1, w3, w2, x, np.empty_like(x), act=act,
                                            row_weights=rw) for act in ("int8", "float")]
                assert rel(res[0][0], ref_i * rw[:, None]) < FFN_INT8_TOL
                for sp in SWITCH_POINTS[1:]:
                    for a, b in zip(res[SWITCH_POINTS[0]], res[sp]):
                        np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32),
                                                      err_msg=f"ffn {dims} n{n} switch {sp}")
    finally:
        assert K._set_matmul_min_tokens(0) == default
        K.set_threads(old)
        K._set_parallel_threshold(-1)
