"""What the C kernel tests (test_kernels*.py) share: the error bounds (test_kernels.py's
docstring says why each), the backend and thread-count fixtures every kernel runs under,
unaligned copies of tensors, and the cached random cases."""
from __future__ import annotations

import functools

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
