"""The pipeline's router entry point (ck_step_route) against routing.route: every
routing mode, the batch invariance of a row, and non-finite logits reported."""
import numpy as np
import pytest

from colibri_core.model import ops
from colibri_core.kernels import ffi, lib
from colibri_core.model.routing import route

from pipeline_kernel_helpers import (  # noqa: F401 (eng, every_thread: fixtures)
    eng, every_thread, fp, hidden_rows, route_c)


# ----------------------------------------------------------------------------- router

def run_route(p, T, xn, k, kmax, fixed=True):
    n = len(xn)
    sc = p.scratch
    sc.ensure(n, kmax)
    sc.xn[:n] = xn
    sc.kt[:n] = k
    logits = np.zeros((n, T.slots), np.float32)
    ids = np.zeros((n, kmax), np.int64)
    w = np.zeros((n, kmax), np.float32)
    rc = lib.ck_step_route(T.router, sc.p_xn, n, sc.p_kt, kmax, fp(logits),
                           fp(ids, "int64_t *") if fixed else ffi.NULL, fp(w) if fixed else ffi.NULL, 0)
    return rc, logits, ids, w


def test_router_matches_routing_route_bit_for_bit(eng):
    m = eng.model
    p, cfg = m.pipeline, m.cfg
    t = p.tables_for(m.expert_set)
    rng = np.random.default_rng(5)
    for L, T in t.layers.items():
        xn = hidden_rows(40, cfg.hidden_size, L)
        k = rng.integers(1, cfg.num_experts + 1, 40)
        rc, logits, ids, w = run_route(p, T, xn, k, int(k.max()))
        assert rc == 0
        want_logits = ops.router_logits(xn, m.expert_set.routers[L], m.expert_set.logit_bias[L])
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        r = route(logits, k, mode="fixed", norm_topk_prob=cfg.norm_topk_prob,
                  scaling=cfg.routed_scaling_factor)
        assert ids.tolist() == r.ids.tolist()
        assert w.tolist() == r.weights.tolist()
        # batch invariance: row 7 alone
        rc, l1, i1, w1 = run_route(p, T, xn[7:8], k[7:8], int(k.max()))
        assert np.array_equal(l1[0], logits[7]) and i1[0].tolist() == ids[7].tolist()


@pytest.mark.parametrize("seed", range(60))
def test_router_modes_equal_routing_route(seed):
    """Every routing mode in C against routing.route: the same ids, weights to the last
    bit in fixed mode and to float rounding in the float ones (their double exp may be
    numpy's SIMD one)."""
    rng = np.random.default_rng(seed)
    mode = ("fixed", "float", "sigmoid")[seed % 3]
    n_group = int(rng.choice([1, 2, 4])) if seed % 2 else 1
    E = n_group * int(rng.integers(2, 12))
    n = int(rng.integers(1, 9))
    topk_group = int(rng.integers(1, n_group + 1))
    k = rng.integers(1, min(E // n_group * topk_group, 9) + 1, n)
    logits = (rng.standard_normal((n, E)) * rng.choice([0.1, 3.0, 20.0])).astype(np.float32)
    if seed % 5 == 0:                                   # ties resolve to the lower index
        logits[:, rng.integers(0, E, 3)] = logits.max()
    sbias = rng.standard_normal(E).astype(np.float32) * 0.3 if seed % 4 == 0 else None
    norm, scaling = bool(seed % 2 == 0 or mode == "sigmoid"), float(rng.choice([1.0, 2.5, 1.1]))
    rc, ids, w = route_c(logits, k, scoring=mode, norm=norm, scaling=scaling, select_bias=sbias,
                         n_group=n_group, topk_group=topk_group)
    assert rc == 0
    ref = route(logits, k, mode="float" if mode == "float" else "fixed",
                scoring="sigmoid" if mode == "sigmoid" else "softmax", norm_topk_prob=norm,
                bias=sbias, n_group=n_group, topk_group=topk_group, scaling=scaling)
    assert ids.tolist() == ref.ids.tolist()
    if mode == "fixed":
        assert w.tolist() == ref.weights.tolist()          # bit for bit
    else:
        np.testing.assert_allclose(w, ref.weights, rtol=1e-6, atol=1e-7)


def test_router_reports_nonfinite_logits(eng):
    m = eng.model
    p = m.pipeline
    T = next(iter(p.tables_for(m.expert_set).layers.values()))
    xn = hidden_rows(3, m.cfg.hidden_size, 0)
    xn[1, 0] = np.nan
    assert run_route(p, T, xn, np.full(3, 2), 2)[0] == lib.CK_E_NONFINITE
