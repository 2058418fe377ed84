"""Figures for the core engine: fixed-point routing error, INT4 matmul error, and the
built-in model's decode speed (the logit error against transformers is printed by
tests/test_builtin_model.py).

    python -m benchmarks.accuracy.core_figures
"""
from __future__ import annotations

import json
import time

import numpy as np


def main():
    from colibri_core import kernels
    from colibri_core.engine import Engine
    from colibri_core.format.quant import matvec_q4_ref, quantize_q4
    from colibri_core.model.routing import fixed_point_softmax_weights

    rng = np.random.default_rng(0)
    worst = 0.0
    for E, scale in ((8, 1.0), (60, 3.0), (64, 10.0)):
        lg = (rng.standard_normal((20000, E)) * scale).astype(np.float32)
        sel = np.argsort(-lg, 1)[:, :8 if E > 8 else 2]
        p = np.exp(lg - lg.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
        worst = max(worst, float(np.abs(fixed_point_softmax_weights(lg, sel, False)
                                        - np.take_along_axis(p, sel, 1)).max()))
    w = rng.standard_normal((2816, 1024))
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    t = quantize_q4(w, 128)
    exact = (x.astype(np.float64) @ w.T)[0]
    out = np.empty((1, 2816), np.float32)
    errs = {}
    for act in ("float", "int8"):
        kernels.q4_matmul(t, x, out, act=act)
        errs[act] = float(np.abs(out[0] - exact).max() / np.abs(exact).max())
    kern_vs_ref = float(np.abs(out[0] - matvec_q4_ref(t, x)[0]).max() / np.abs(exact).max())

    with Engine.from_config("builtin") as eng:
        ids = eng.encode("The assert statement")
        eng.generate(ids, max_new_tokens=8, temperature=0).run()
        g = eng.generate(ids, max_new_tokens=200, temperature=0.7, seed=0)
        lat = [ev.latency_s for ev in g]
    lat = np.array(lat[1:]) * 1000
    res = {"fixed_point_routing_max_abs_err": worst,
           "int4_matvec_rel_err_vs_float64": errs,
           "int8_kernel_vs_float_ref_rel": kern_vs_ref,
           "builtin_decode_tok_s": float(1000 / lat.mean()),
           "builtin_decode_p50_ms": float(np.median(lat)),
           "builtin_decode_p99_ms": float(np.percentile(lat, 99))}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
