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
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.model import ops
from colibri_core.format import quant as Q

FLOAT_TOL = 1e-5
INT8_TOL = 1e-5
FFN_INT8_TOL = 2e-3

BACKENDS = K.available_backends()
THREADS = [1, 2]
SHAPES = [(1, 64), (3, 130), (37, 300), (259, 1000)]   # (rows, cols): odd rows, partial groups
NS = [1, 2, 7, 33]
GROUPS = [64, 128]


def rel(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture(params=BACKENDS)
def backend(request):
    K.set_backend(request.param)
    yield request.param
    K.set_backend("auto")


@pytest.fixture(params=THREADS)
def threads(request):
    """1 or 2 threads; with 2, even tiny calls really run on both (threshold 0), so that
    row splits with fewer tiles than threads are covered too."""
    old = K.get_threads()
    K.set_threads(request.param)
    K._set_parallel_threshold(0 if request.param > 1 else -1)
    yield request.param
    K.set_threads(old)
    K._set_parallel_threshold(-1)


def unaligned_q4(t: Q.Q4Tensor) -> Q.Q4Tensor:
    """The same tensor with every part at an odd byte offset of one bytes buffer."""
    parts = [np.ascontiguousarray(t.data), np.ascontiguousarray(t.scales),
             np.ascontiguousarray(t.zeros)]
    buf = bytearray(sum(p.nbytes for p in parts) + 3 * 8)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    views, off = [], 0
    for p in parts:
        off += (1 - (base + off)) % 4            # address = 1 mod 4: odd, and not float-aligned
        buf[off:off + p.nbytes] = p.tobytes()
        views.append(np.frombuffer(buf, p.dtype, p.size, off).reshape(p.shape))
        off += p.nbytes
    assert all(v.ctypes.data % 4 == 1 for v in views)
    return Q.Q4Tensor(*views, t.rows, t.cols, t.group)


def unaligned_q6(t: Q.Q6Tensor) -> Q.Q6Tensor:
    """The same q6 tensor with its parts at odd byte offsets (as unaligned_q4)."""
    u = unaligned_q4(Q.Q4Tensor(t.data, t.scales, t.zeros, t.rows, t.cols, t.group))
    return Q.Q6Tensor(u.data, u.scales, u.zeros, t.rows, t.cols, t.group)


def unaligned_f32(a: np.ndarray) -> np.ndarray:
    """Copy of a as a view offset by one float into a larger buffer."""
    buf = np.zeros(a.size + 9, np.float32)
    v = buf[1:1 + a.size].reshape(a.shape)
    v[...] = a
    return v


@functools.lru_cache(maxsize=None)
def case(rows: int, cols: int, group: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed * 1000003 + rows * 7919 + cols * 31 + group + n)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    t = Q.quantize_q4(w, group)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, ::17] *= 8.0                            # some outliers, as real activations have
    return t, x, Q.matvec_q4_ref(t, x), Q.matvec_q4_q8_ref(t, x)


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


# ----------------------------------------------------------------------------- expert FFN

@functools.lru_cache(maxsize=None)
def ffn_case(hidden: int, inter: int, g13: int, g2: int, n: int):
    rng = np.random.default_rng(hidden * 3 + inter + g13 + g2 + n)
    w1 = Q.quantize_q4(rng.standard_normal((inter, hidden)).astype(np.float32) * 0.1, g13)
    w3 = Q.quantize_q4(rng.standard_normal((inter, hidden)).astype(np.float32) * 0.1, g13)
    w2 = Q.quantize_q4(rng.standard_normal((hidden, inter)).astype(np.float32) * 0.1, g2)
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    rw = rng.uniform(0.1, 1.0, n).astype(np.float32)
    return (w1, w3, w2, x, rw, ops.expert_ffn_ref(w1, w3, w2, x, "float"),
            ops.expert_ffn_ref(w1, w3, w2, x, "int8"))


@pytest.mark.parametrize("dims", [(64, 128, 64, 128), (130, 300, 128, 64), (300, 259, 64, 128)])
@pytest.mark.parametrize("n", NS)
def test_expert_ffn(backend, threads, dims, n):
    w1, w3, w2, x, rw, ref_f, ref_i = ffn_case(*dims, n)
    out = np.empty_like(x)
    K.expert_ffn(w1, w3, w2, x, out, act="float")
    assert rel(out, ref_f) < FLOAT_TOL
    K.expert_ffn(w1, w3, w2, x, out, act="int8")
    assert rel(out, ref_i) < FFN_INT8_TOL
    assert rel(out, ref_f) < 5e-2                # int8 activations vs float: a sanity bound
    # routing weights, accumulate and unaligned views all at once
    base = np.random.default_rng(n).standard_normal(x.shape).astype(np.float32)
    acc = unaligned_f32(base)
    K.expert_ffn(unaligned_q4(w1), unaligned_q4(w3), unaligned_q4(w2), unaligned_f32(x), acc,
                 act="float", row_weights=rw, accumulate=True)
    assert rel(acc - base, ref_f * rw[:, None]) < FLOAT_TOL
    K.expert_ffn(w1, w3, w2, x, acc, act="int8", row_weights=rw)
    assert rel(acc, ref_i * rw[:, None]) < FFN_INT8_TOL


# ----------------------------------------------------------------------------- attention

def attention_ref(q, k, v, length, scale):
    """float64 attention of one token (the last of `length` positions) over the cache."""
    f64 = np.float64
    return ops.attention(q[None].astype(f64), k[:length].astype(f64), v[:length].astype(f64),
                         scale, start=length - 1)[0]


@pytest.mark.parametrize("nh,nkv,d", [(4, 2, 64), (8, 8, 32), (6, 1, 100), (1, 1, 7),
                                       (16, 4, 64), (12, 2, 72), (7, 1, 40)])
@pytest.mark.parametrize("length", [1, 3, 77, 300])
def test_attention_decode(backend, threads, nh, nkv, d, length):
    rng = np.random.default_rng(nh * 1000 + d + length)
    cap = 301
    k = unaligned_f32(rng.standard_normal((cap, nkv, d)).astype(np.float32))
    v = unaligned_f32(rng.standard_normal((cap, nkv, d)).astype(np.float32))
    k[length:] = np.nan                         # never read past `length`
    q = unaligned_f32(rng.standard_normal((nh, d)).astype(np.float32))
    out = unaligned_f32(np.zeros((nh, d), np.float32))
    K.attention_decode(q, k, v, length, out)
    assert rel(out, attention_ref(q, k, v, length, 1 / np.sqrt(d))) < FLOAT_TOL
    K.attention_decode(q, k, v, length, out, scale=0.3)
    assert rel(out, attention_ref(q, k, v, length, 0.3)) < FLOAT_TOL


def test_attention_decode_rejects():
    k = np.zeros((10, 2, 8), np.float32)
    q, out = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="length"):
        K.attention_decode(q, k, k, 11, out)
    with pytest.raises(ValueError, match="length"):
        K.attention_decode(q, k, k, 0, out)
    with pytest.raises(ValueError, match="multiple"):
        K.attention_decode(np.zeros((3, 8), np.float32), k, k, 5, np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="v_cache: shape"):
        K.attention_decode(q, k, k[:, :1], 5, out)
    with pytest.raises(ValueError, match="q: "):
        K.attention_decode(np.zeros((4, 7), np.float32), k, k, 5, out)
    with pytest.raises(ValueError, match="contiguous"):
        K.attention_decode(q, k, np.zeros((10, 8, 2), np.float32).transpose(0, 2, 1), 5, out)


# ----------------------------------------------------------------------------- validation

def test_rejects_bad_arguments():
    t, x, _, _ = case(37, 300, 64, 2)
    out = np.zeros((2, 37), np.float32)
    bad = [
        (x.astype(np.float64), out, "dtype"),
        (x[:, :299], out, "shape"),
        (np.asfortranarray(x), out, "contiguous"),
        (np.zeros((2, 600), np.float32)[:, ::2], out, "contiguous"),
        (x, out.astype(np.float64), "dtype"),
        (x, out[:1], "shape"),
        (x, np.empty((37, 2), np.float32).T, "contiguous"),
        (x, np.broadcast_to(np.float32(0), (2, 37)), "contiguous|writable"),
        (x.tolist(), out, "numpy array"),
    ]
    for xx, oo, msg in bad:
        with pytest.raises(ValueError, match=msg):
            K.q4_matmul(t, xx, oo)
    ro = np.empty((2, 37), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        K.q4_matmul(t, x, ro)
    with pytest.raises(ValueError, match="act"):
        K.q4_matmul(t, x, out, act="fp16")
    with pytest.raises(ValueError, match="Q4Tensor"):
        K.q4_matmul(Q.quantize_q8(np.ones((37, 300)), 64), x, out)
    with pytest.raises(ValueError, match="w.scales: dtype"):
        K.q4_matmul(Q.Q4Tensor(t.data, t.scales.astype(np.float64), t.zeros, 37, 300, 64), x, out)
    with pytest.raises(ValueError, match="w.data: shape"):
        K.q4_matmul(Q.Q4Tensor(t.data[:, :-32], t.scales, t.zeros, 37, 300, 64), x, out)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.q4_matmul(Q.Q4Tensor(t.data, t.scales, t.zeros, 37, 300, 96), x, out)
    with pytest.raises(ValueError, match="Q8Tensor"):
        K.q8_matmul(t, x, out)
    with pytest.raises(ValueError, match="x: dtype"):
        K.act_quantize_q8(x.astype(np.float16), 64)
    with pytest.raises(ValueError, match="xq: shape"):
        K.act_quantize_q8(x, 64, xq=np.empty((2, 300), np.int8))
    w1, w3, w2, xf, rw, _, _ = ffn_case(64, 128, 64, 128, 2)
    o = np.empty_like(xf)
    with pytest.raises(ValueError, match="w2: shape"):
        K.expert_ffn(w1, w3, w1, xf, o)
    with pytest.raises(ValueError, match="w3"):
        K.expert_ffn(w1, w2, w2, xf, o)
    with pytest.raises(ValueError, match="row_weights"):
        K.expert_ffn(w1, w3, w2, xf, o, row_weights=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="x: shape"):
        K.expert_ffn(w1, w3, w2, xf[:, :32].copy(), o)
    with pytest.raises(ValueError):
        K.set_threads(0)
    with pytest.raises(ValueError, match="not available"):
        K.set_backend("sse9")


# ----------------------------------------------------------------------------- runtime

def test_runtime_info():
    assert K.backend() in BACKENDS and "scalar" in BACKENDS
    old = K.get_threads()
    K.set_threads(1)
    assert K.get_threads() == 1
    K.set_threads(3)
    assert K.get_threads() == 3
    K.set_threads(old)
    a, b = K.rdtsc(), K.rdtsc()
    assert isinstance(a, int) and b >= a
    assert K.cycle_counter_name() in ("rdtsc", "cntvct_el0", "clock_gettime_ns")


BEST = next(b for b in ["avx512vnni", "avx2", "neon", "scalar"] if b in BACKENDS)


@pytest.mark.parametrize("name", BACKENDS + ["auto", "sse9"])
def test_env_forces_backend(name):
    """COLIBRI_KERNELS=<name> picks that backend at import; "auto" and names this CPU
    lacks give the best one."""
    code = ("import numpy as np; from colibri_core import kernels as K; "
            "from colibri_core.format import quant as Q; "
            "t = Q.quantize_q4(np.ones((3, 70), np.float32), 64); "
            "y = K.q4_matmul(t, np.ones((1, 70), np.float32), np.empty((1, 3), np.float32)); "
            "print(K.backend(), round(float(y.sum())))")
    # the child imports the very colibri_core this process tests (checkout or install)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(K.__file__)))
    env = dict(os.environ, COLIBRI_KERNELS=name,
               PYTHONPATH=os.pathsep.join([pkg_parent, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [name if name in BACKENDS else BEST, "210"]


def test_auto_is_the_best():
    assert K.set_backend("auto") == BEST


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
