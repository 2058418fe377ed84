"""Each C entry point of the pipeline (ck_step*.c) against the reference ops, one call at a
time, and the batch invariance of each: a token's row is bit-identical alone and among
63 other tokens (which run the batch tiles). Here the expert block, the AVX-512 panels,
the lm_head and the thread pool; attention in test_pipeline_kernels_attention.py, the
router in test_pipeline_kernels_router.py; the bounds in pipeline_kernel_helpers.py."""
import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.model import ops
from colibri_core.kernels import lib

from pipeline_kernel_helpers import (  # noqa: F401 (eng, every_thread: fixtures)
    eng, every_thread, fp, hidden_rows, rel, run_attention, tol)


# ----------------------------------------------------------------------------- experts

def run_experts(p, L, T, xn, ids, w, x0):
    n, kmax = ids.shape
    sc = p.scratch
    sc.ensure(n, kmax)
    sc.xn[:n] = xn
    sc.x[:n] = x0
    ids, w = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(w, np.float32)
    block = p.layers[L].block
    if T is not None:
        block.table, block.n_table = T.table, T.n
    rc = lib.ck_step_experts(block, sc.p_xn, n, fp(ids, "int64_t *"), fp(w), kmax, sc.p_x, sc.s)
    assert rc == 0
    return sc.x[:n].copy()


def reference_experts(m, lw, xn, ids, w, x0):
    ref, out = m.ref, x0.astype(np.float32).copy()
    experts = m.expert_set.experts[lw.index]
    for e in sorted(set(ids[ids >= 0].tolist())):
        rows, slot = np.nonzero(ids == e)
        y = np.zeros((len(rows), xn.shape[1]), np.float32)
        ref._run_expert(experts[e], np.ascontiguousarray(xn[rows]), y, w[rows, slot])
        out[rows] += y
    if lw.shared is not None:
        sh = np.empty_like(xn)
        ref._ffn(lw.shared, xn, sh)
        if lw.shared_gate is not None:
            sh *= ops.sigmoid(xn @ np.asarray(lw.shared_gate, np.float32).T)
        out += sh
    return out


@pytest.mark.parametrize("n", [1, 5, 64])
def test_expert_block_matches_the_reference(eng, n):
    m = eng.model
    p, cfg = m.pipeline, m.cfg
    t = p.tables_for(m.expert_set)
    rng = np.random.default_rng(n)
    for L, lw in enumerate(m.w.layers):
        xn = hidden_rows(n, cfg.hidden_size, L)
        x0 = hidden_rows(n, cfg.hidden_size, L + 50)
        if lw.kind == "dense":
            ids, w = np.zeros((n, 1), np.int64), np.ones((n, 1), np.float32)
            got = run_experts(p, L, None, xn, ids, w, x0)
            y = np.empty_like(xn)
            m.ref._ffn(lw.dense, xn, y)
            want = x0 + y
        else:
            k = cfg.top_k
            ids = np.stack([rng.choice(cfg.num_experts, k, replace=False) for _ in range(n)])
            ids[0, -1] = -1                                # a narrower choice: unused slot
            w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
            got = run_experts(p, L, t.layers[L], xn, ids, w, x0)
            want = reference_experts(m, lw, xn, ids, w, x0)
        assert rel(got - x0, want - x0) < tol(eng), (L, rel(got - x0, want - x0))


def test_expert_rows_are_batch_invariant(eng):
    """Token 0's experts alone and among 63 others, also when the step's pairs exceed
    one piece of the scratch (pairs_max) so that an expert's tokens run in parts."""
    m = eng.model
    p, cfg = m.pipeline, m.cfg
    t = p.tables_for(m.expert_set)
    rng = np.random.default_rng(9)
    for L, lw in enumerate(m.w.layers):
        if lw.kind != "moe":
            continue
        k = cfg.top_k
        xn = hidden_rows(64, cfg.hidden_size, L)
        x0 = hidden_rows(64, cfg.hidden_size, L + 1)
        ids = np.stack([rng.choice(cfg.num_experts, k, replace=False) for _ in range(64)])
        w = rng.uniform(0.1, 1.0, (64, k)).astype(np.float32)
        alone = run_experts(p, L, t.layers[L], xn[:1], ids[:1], w[:1], x0[:1])
        crowd = run_experts(p, L, t.layers[L], xn, ids, w, x0)
        assert np.array_equal(alone[0], crowd[0])
        saved = p.scratch.s.pairs_max
        p.scratch.s.pairs_max = 7                          # many pieces, experts split
        try:
            pieces = run_experts(p, L, t.layers[L], xn, ids, w, x0)
        finally:
            p.scratch.s.pairs_max = saved
        assert np.array_equal(pieces, crowd)


PANEL_POINTS = [1, 0, 5, 1 << 30]     # every job, the default, 5 tokens, never


@pytest.mark.skipif("avx512vnni" not in K.available_backends(),
                    reason="the panel kernel is AVX-512 VNNI's")
def test_panels_change_no_bit(eng):
    """The expert block and the attention projections give the same bits whether they
    run the AVX-512 panels (tokens in the lanes) or the tiles, whichever token counts
    switch, with the panels' scratch short (some jobs fall back), and on AVX2."""
    m = eng.model
    p, cfg = m.pipeline, m.cfg
    t = p.tables_for(m.expert_set)
    rng = np.random.default_rng(17)
    H, n = cfg.hidden_size, 45                     # 45: a partial last panel
    default = K._set_panel_min_tokens(0)
    try:
        for L, lw in enumerate(m.w.layers):
            xn, x0 = hidden_rows(n, H, L), hidden_rows(n, H, L + 7)
            if lw.kind == "moe":
                ids = np.stack([rng.choice(cfg.num_experts, cfg.top_k, replace=False)
                                for _ in range(n)])
                ids[:30, 0] = 1                    # one expert with many tokens
                T = t.layers[L]
            else:
                ids, T = np.zeros((n, 1), np.int64), None
            w = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
            res = []
            for be, mt, rows in [("avx512vnni", sp, None) for sp in PANEL_POINTS] + \
                    [("avx512vnni", 1, 40), ("avx2", 1, None)]:
                K.set_backend(be)
                K._set_panel_min_tokens(mt)
                saved = p.scratch.s.p_rows
                if rows is not None:
                    p.scratch.s.p_rows = rows      # room for some jobs' panels only
                try:
                    caches = [m.new_cache(32) for _ in range(3)]
                    a_x, a_xn = run_attention(p, L, x0, [caches[i % 3] for i in range(n)],
                                              [i // 3 for i in range(n)])
                    res.append((a_x, a_xn, run_experts(p, L, T, xn, ids, w, x0)))
                finally:
                    p.scratch.s.p_rows = saved
                    K.set_backend("auto")
            for i, r in enumerate(res[1:]):
                for a, b in zip(res[0], r):
                    assert np.array_equal(a.view(np.int32), b.view(np.int32)), (L, i)
    finally:
        K._set_panel_min_tokens(default)


@pytest.mark.skipif("avx512vnni" not in K.available_backends(),
                    reason="the panel kernel is AVX-512 VNNI's")
def test_head_panels_change_no_bit(eng):
    """The lm_head (q4, q6 or q8 by the variant) gives the same bits through the AVX-512
    panels (q4 and q6 heads, from the panel switch point on) or the tiles, with the panels'
    scratch short (the tiles then), and on AVX2."""
    m = eng.model
    p = m.pipeline
    n = 45                                         # a partial last panel
    x = hidden_rows(n, m.cfg.hidden_size, 91)
    sc = p.scratch
    sc.ensure(n, 1)
    default = K._set_panel_min_tokens(0)
    res = []
    try:
        for be, mt, rows in [("avx512vnni", sp, None) for sp in PANEL_POINTS] + \
                [("avx512vnni", 1, 40), ("avx2", 1, None)]:
            K.set_backend(be)
            K._set_panel_min_tokens(mt)
            saved = sc.s.p_rows
            if rows is not None:
                sc.s.p_rows = rows
            try:
                out = np.zeros((n, m.cfg.vocab_size), np.float32)
                sc.head_x[:n] = x
                assert lib.ck_step_head(p.head, p.final_norm, p.eps, sc.p_head_x, n, fp(out),
                                        sc.s) == 0
                res.append(out)
            finally:
                sc.s.p_rows = saved
                K.set_backend("auto")
    finally:
        K._set_panel_min_tokens(default)
    for i, r in enumerate(res[1:]):
        assert np.array_equal(res[0].view(np.int32), r.view(np.int32)), i


# ----------------------------------------------------------------------------- lm_head

def test_head_matches_the_reference_and_is_batch_invariant(eng):
    m = eng.model
    p, ref = m.pipeline, m.ref
    x = hidden_rows(64, m.cfg.hidden_size, 77)
    sc = p.scratch
    sc.ensure(64, 1)
    out = np.zeros((64, m.cfg.vocab_size), np.float32)
    sc.head_x[:64] = x
    assert lib.ck_step_head(p.head, p.final_norm, p.eps, sc.p_head_x, 64, fp(out), sc.s) == 0
    want = ref.linear(m.w.lm_head, ref._rmsnorm(x, m.w.final_norm))
    assert rel(out, want) < tol(eng)
    one = np.zeros((1, m.cfg.vocab_size), np.float32)
    sc.head_x[:1] = x[5:6]
    assert lib.ck_step_head(p.head, p.final_norm, p.eps, sc.p_head_x, 1, fp(one), sc.s) == 0
    assert np.array_equal(one[0], out[5])


@pytest.mark.parametrize("n,nth", [(1, 2), (2, 2), (3, 2), (97, 2), (1000, 2), (50, 5)])
def test_pool_runs_every_chunk_exactly_once(n, nth):
    """The pipeline's work-stealing loops (ck_pool.c): every chunk once per loop, over many
    back-to-back loops (where a late thread must never run a newer loop's chunk with an
    older loop's function), with more threads than chunks too."""
    assert lib.ck_pool_check(n, nth, 300) == 0
