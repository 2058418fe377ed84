"""The expert FFN (gate, up, down in one call) and decode attention kernels against
float64 numpy, on every backend and on 1 and 2 threads; the bounds: test_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.model import ops

from kernel_helpers import (  # noqa: F401 (backend, threads: fixtures)
    FFN_INT8_TOL, FLOAT_TOL, NS, backend, ffn_case, rel, threads, unaligned_f32,
    unaligned_q4)


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
