"""The kernels' argument checks (one ValueError naming the argument and what was
expected), their runtime facts (threads, cycle counter), and the backend COLIBRI_KERNELS
or "auto" picks."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.format import quant as Q

from kernel_helpers import BACKENDS, case, ffn_case


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
