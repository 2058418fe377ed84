"""Each C entry point of the pipeline (ck_step*.c) against the reference ops, one call at a
time, and the batch invariance of each: a token's row is bit-identical alone and among
63 other tokens (which run the batch tiles).

The reference blocks (reference.py) quantize activations to int8 as the C calls do but
compute norms and attention in numpy float32, so a value can differ by one int8 quantum
of an activation: ~1e-3 of a result. The bounds below are a few times that."""
import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.model import ops
from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.kernels import ffi, lib
from colibri_core.forward.pipeline import Pipeline
from colibri_core.format.quant import quantize_q4, quantize_q6, quantize_q8
from colibri_core.model.routing import route
from colibri_core.model.testing import write_random_model

SHAPES = {
    # dense + MoE with a gated shared expert; hidden 192: partial last group
    "mixed_shared_odd": dict(hidden=192, layers=("dense", "moe", "moe"), experts=6, top_k=2,
                             inter=320, moe_inter=160, shared=96, heads=4, kv_heads=2),
    # group 64, one kv head (MQA), top-3
    "g64_mqa_k3": dict(hidden=128, layers=("moe", "moe"), experts=5, top_k=3, inter=128,
                       moe_inter=192, shared=0, heads=4, kv_heads=1, group=64),
    # the q6 format for the lm_head and every attention projection (partial last group)
    "q6_head_attn": dict(hidden=192, layers=("dense", "moe"), experts=4, top_k=2, inter=192,
                         moe_inter=128, shared=64, heads=6, kv_heads=2, head="q6", attn="q6"),
}


def _float(w, dtype):
    """A stored matrix at 16/32 bits: float32, float16, or bf16 bits (uint16)."""
    f = ops.float_matrix(w)
    return (f.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bf16" else f.astype(dtype)


def _ffns(w):
    for lw in w.layers:
        yield from (f for f in (lw.dense, lw.shared) if f is not None)
        yield from (ex.ffn for ex in lw.experts)


def _awq(w, rng):
    """AWQ activation scales on every FFN and attention projection (gate and up share
    theirs; each expert its own)."""
    scale = lambda n: rng.uniform(0.5, 2.0, n).astype(np.float32)  # noqa: E731
    for f in _ffns(w):
        s1 = scale(f.w1.cols)
        f.act_scales = {"w1": s1, "w3": s1, "w2": scale(f.w2.cols)}
    for lw in w.layers:
        a, s = lw.attn, scale(lw.attn.wq.cols)
        a.act_scales = {"wq": s, "wk": s, "wv": s, "wo": scale(a.wo.cols)}


def _floats(dtype):
    def go(w, rng):
        for f in _ffns(w):
            f.w1, f.w3, f.w2 = (_float(getattr(f, n), dtype) for n in ("w1", "w3", "w2"))
        for lw in w.layers:
            for n in ("wq", "wk", "wv", "wo"):
                setattr(lw.attn, n, _float(getattr(lw.attn, n), dtype))
        w.lm_head, w.embed = _float(w.lm_head, dtype), _float(w.embed, dtype)
    return go


def _requant(quantize):
    def go(w, rng):
        for f in _ffns(w):
            f.w1, f.w3, f.w2 = (quantize(ops.float_matrix(getattr(f, n)), 128)
                                for n in ("w1", "w3", "w2"))
    return go


def _regroup(w, rng):
    """Every other expert (and the shared one) at group 64, the rest at the model's 128."""
    for lw in w.layers:
        for f in [ex.ffn for ex in lw.experts[::2]] + ([lw.shared] if lw.shared else []):
            f.w1, f.w3, f.w2 = (quantize_q4(ops.float_matrix(getattr(f, n)), 64)
                                for n in ("w1", "w3", "w2"))


# Configurations on the first shape's weights: (engine settings, change to the weights).
# Each runs every C entry point below against the reference block, and its batch invariance.
VARIANTS = {
    "float_act": ({"activations": "float"}, None),
    "awq": ({}, _awq),
    "awq_float_act": ({"activations": "float"}, _awq),
    "f32": ({}, _floats(np.float32)),
    "f16_float_act": ({"activations": "float"}, _floats(np.float16)),
    "bf16": ({}, _floats("bf16")),
    "q8_ffn": ({}, _requant(quantize_q8)),
    "q6_ffn": ({}, _requant(quantize_q6)),
    "expert_groups": ({}, _regroup),
}


def tol(eng):
    """The bound on a block's relative error: int8 activations of quantized weights can
    flip an int8 rounding (~1e-3, see above); float rows only differ in summation order."""
    return 1e-4 if eng.all_float else 5e-3


@pytest.fixture(scope="module", params=list(SHAPES) + list(VARIANTS))
def eng(request, tmp_path_factory):
    name = request.param
    shape = name if name in SHAPES else "mixed_shared_odd"
    kw, change = VARIANTS.get(name, ({}, None))
    d = tmp_path_factory.mktemp(name) / "m"
    write_random_model(d, seed=21, vocab=300, context=128, **SHAPES[shape])
    with Engine(d, EngineConfig(threads=2, **kw)) as e:
        if change is not None:                  # the changed weights, a pipeline made for them
            change(e.model.w, np.random.default_rng(5))
            e.model.pipeline = Pipeline(e.model)
        e.all_float = kw.get("activations") == "float" or name in ("f32", "bf16")
        yield e


def fp(a, ctype="float *"):
    return ffi.cast(ctype, ffi.from_buffer(a))


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def hidden_rows(n, H, seed):
    return (np.random.default_rng(seed).standard_normal((n, H)) * 2).astype(np.float32)


@pytest.fixture(autouse=True)
def every_thread():
    K._set_parallel_threshold(0)          # these small layers too run on every thread
    yield
    K._set_parallel_threshold(-1)


# ----------------------------------------------------------------------------- attention

def run_attention(p, L, x, caches, positions):
    """ck_step_attention on rows x of sequences `caches` at `positions` (one per row)."""
    n = len(x)
    sc = p.scratch
    sc.ensure(n, 1)
    for t, (c, pos) in enumerate(zip(caches, positions)):
        sc.tok[t] = (pos, *p._cache_ptrs(c)[1:])
    sc.x[:n] = x
    rc = lib.ck_step_attention(p.layers[L].attn, L, sc.p_x, n, sc.p_tok, sc.p_xn, sc.s)
    assert rc == 0
    return sc.x[:n].copy(), sc.xn[:n].copy()


KV_DTYPES = ["f32", "f16", "q8"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_attention_matches_the_reference_block(eng, kv):
    """The C block writes each cache row in the cache's type and attends over the rows
    dequantized; the reference block (reference.py) stores with quant.quantize_kv_q8 /
    numpy's float16 and attends in numpy."""
    m = eng.model
    p, ref, cfg = m.pipeline, m.ref, m.cfg
    rng = np.random.default_rng(3)
    for L, lw in enumerate(m.w.layers):
        prompt = hidden_rows(9, cfg.hidden_size, 4 + L)
        c_c, c_r = m.new_cache(32, kv), m.new_cache(32, kv)
        # 9 tokens of one sequence in one call: a token sees the earlier ones of its call
        got_x, got_xn = run_attention(p, L, prompt, [c_c] * 9, range(9))
        want = prompt + ref._attention(lw, ref._rmsnorm(prompt, lw.attn_norm), np.arange(9),
                                       [(0, 9, c_r)])
        assert rel(got_x, want) < tol(eng)
        assert rel(got_xn, ref._rmsnorm(want, lw.ffn_norm)) < tol(eng)
        (kc, vc), (kr, vr) = c_c.read(L, 9), c_r.read(L, 9)
        np.testing.assert_allclose(vc, vr, rtol=0, atol=2e-2 * np.abs(vr).max())
        np.testing.assert_allclose(kc, kr, rtol=0, atol=2e-2 * np.abs(kr).max())
        c_r.length = 9
        # then one decode token
        x1 = hidden_rows(1, cfg.hidden_size, int(rng.integers(100)))
        got_x, _ = run_attention(p, L, x1, [c_c], [9])
        want = x1 + ref._attention(lw, ref._rmsnorm(x1, lw.attn_norm), np.array([9]), [(0, 1, c_r)])
        assert rel(got_x, want) < tol(eng)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_attention_rows_are_batch_invariant(eng, kv):
    """Sequence 0's token alone, then among 63 tokens of 8 other sequences (whose caches
    are of every storage type)."""
    m = eng.model
    p, cfg = m.pipeline, m.cfg
    H = cfg.hidden_size
    ctx = hidden_rows(6, H, 1)
    for L in range(len(m.w.layers)):
        solo, crowd = m.new_cache(16, kv), m.new_cache(16, kv)
        others = [m.new_cache(16, KV_DTYPES[i % 3]) for i in range(8)]
        run_attention(p, L, ctx, [solo] * 6, range(6))
        run_attention(p, L, ctx, [crowd] * 6, range(6))
        x = hidden_rows(64, H, 2)
        a_x, a_xn = run_attention(p, L, x[:1], [solo], [6])
        seqs = [crowd] + [others[i % 8] for i in range(63)]
        pos = [6] + [i // 8 for i in range(63)]
        b_x, b_xn = run_attention(p, L, x, seqs, pos)
        assert np.array_equal(a_x[0], b_x[0]) and np.array_equal(a_xn[0], b_xn[0])
        assert np.array_equal(solo.k[L, 6], crowd.k[L, 6])


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


def _route_c(logits, k, *, scoring, norm, scaling, bias=None, select_bias=None,
             n_group=1, topk_group=1):
    """ck_step_route on `logits` [n, E] exactly: xn = logits padded, router = identity."""
    from colibri_core.model.routing import _EXP2_TABLE
    n, E = logits.shape
    H = E + 3
    xn = np.zeros((n, H), np.float32)
    xn[:, :E] = logits
    router = np.zeros((E, H), np.float32)
    router[np.arange(E), np.arange(E)] = 1.0
    exp2 = np.ascontiguousarray(_EXP2_TABLE, np.int64)
    keep = [router, exp2, bias, select_bias]
    r = ffi.new("ck_router *", {
        "weight": fp(router), "bias": ffi.NULL if bias is None else fp(bias), "e": E, "h": H,
        "scoring": {"fixed": lib.CK_ROUTE_FIXED, "float": lib.CK_ROUTE_FLOAT,
                    "sigmoid": lib.CK_ROUTE_SIGMOID}[scoring],
        "select_bias": ffi.NULL if select_bias is None else fp(select_bias),
        "n_group": n_group, "topk_group": topk_group, "norm_topk": norm, "scaling": scaling,
        "exp2_q30": fp(exp2, "int64_t *")})
    kk = np.ascontiguousarray(k, np.int32)
    kmax = int(kk.max())
    out_l = np.zeros((n, E), np.float32)
    ids = np.zeros((n, kmax), np.int64)
    w = np.zeros((n, kmax), np.float32)
    rc = lib.ck_step_route(r, fp(xn), n, fp(kk, "int32_t *"), kmax, fp(out_l), fp(ids, "int64_t *"),
                           fp(w), 0)
    del keep
    return rc, ids, w


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
    rc, ids, w = _route_c(logits, k, scoring=mode, norm=norm, scaling=scaling, select_bias=sbias,
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


# ----------------------------------------------------------------------------- MLA

def _mla_awq(w, rng):
    for lw in w.layers:
        a = lw.attn
        a.act_scales = {n: rng.uniform(0.5, 2.0, getattr(a, n).cols).astype(np.float32)
                        for n in a.MATRICES if getattr(a, n) is not None}


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v3_plain_q", "deepseek_v2",
                                        "deepseek_v3_over_budget", "deepseek_v2_float_act",
                                        "deepseek_v3_awq", "deepseek_v3_awq_over_budget"])
def mla_eng(request, tmp_path_factory):
    """over_budget: W_UK / W_UV past the float budget, read from wkv_b's quantized rows;
    awq: activation scales on every MLA matrix (wkv_b's divided out of its columns)."""
    from hf_helpers import make_hf_model, save, write_tokenizer
    from colibri_core.forward import pipeline as P
    from colibri_core.convert import convert
    name = request.param
    over = {"q_lora_rank": None, "rope_interleave": False} if name.endswith("plain_q") else {}
    hf = make_hf_model(name.split("_")[0] + "_" + name.split("_")[1], seed=2, **over)
    d = tmp_path_factory.mktemp(name)
    src = save(hf, d / "hf")
    write_tokenizer(src)
    convert(src, d / "c")
    kw = {"activations": "float"} if name.endswith("float_act") else {}
    with Engine(d / "c", EngineConfig(threads=2, **kw)) as e:
        if "_awq" in name:
            _mla_awq(e.model.w, np.random.default_rng(8))
            e.model.pipeline = Pipeline(e.model)
        if name.endswith("over_budget"):
            saved, P._MLA_DEQUANT_BUDGET = P._MLA_DEQUANT_BUDGET, 0
            try:
                e.model.pipeline = Pipeline(e.model)
            finally:
                P._MLA_DEQUANT_BUDGET = saved
            assert all(L.mla.wkv_b == ffi.NULL and L.mla.wkv_b_q.kind == lib.CK_W_Q4
                       for L in e.model.pipeline.layers)
        assert all(L.mla is not None for L in e.model.pipeline.layers)
        e.all_float = "activations" in kw
        yield e


def run_mla(p, L, x, caches, positions):
    n = len(x)
    sc = p.scratch
    sc.ensure(n, 1)
    for t, (c, pos) in enumerate(zip(caches, positions)):
        sc.tok[t] = (pos,) + p._cache_ptrs(c)[1:]
    sc.x[:n] = x
    assert lib.ck_step_mla_attention(p.layers[L].mla, L, sc.p_x, n, sc.p_tok, sc.p_xn, sc.s) == 0
    return sc.x[:n].copy(), sc.xn[:n].copy()


def test_mla_attention_matches_the_reference_block(mla_eng):
    m = mla_eng.model
    p, ref, cfg = m.pipeline, m.ref, m.cfg
    for L, lw in enumerate(m.w.layers):
        x = hidden_rows(9, cfg.hidden_size, 30 + L)
        c_c, c_r = m.new_cache(32), m.new_cache(32)
        got_x, got_xn = run_mla(p, L, x, [c_c] * 9, range(9))
        want = x + ref._attention(lw, ref._rmsnorm(x, lw.attn_norm), np.arange(9), [(0, 9, c_r)])
        assert rel(got_x - x, want - x) < tol(mla_eng)
        assert rel(got_xn, ref._rmsnorm(want, lw.ffn_norm)) < tol(mla_eng)
        np.testing.assert_allclose(c_c.k[L, :9], c_r.k[L, :9], rtol=1e-4, atol=1e-5)   # latents
        np.testing.assert_allclose(c_c.v[L, :9], c_r.v[L, :9], rtol=1e-4, atol=1e-4)   # k_pe
        c_r.length = 9
        x1 = hidden_rows(1, cfg.hidden_size, 60 + L)
        got_x, _ = run_mla(p, L, x1, [c_c], [9])
        want = x1 + ref._attention(lw, ref._rmsnorm(x1, lw.attn_norm), np.array([9]), [(0, 1, c_r)])
        assert rel(got_x - x1, want - x1) < tol(mla_eng)


def test_mla_rows_are_batch_invariant(mla_eng):
    m = mla_eng.model
    p, H = m.pipeline, m.cfg.hidden_size
    ctx = hidden_rows(5, H, 1)
    for L in range(len(m.w.layers)):
        solo, crowd = m.new_cache(16), m.new_cache(16)
        others = [m.new_cache(16) for _ in range(8)]
        run_mla(p, L, ctx, [solo] * 5, range(5))
        run_mla(p, L, ctx, [crowd] * 5, range(5))
        x = hidden_rows(64, H, 2)
        a_x, a_xn = run_mla(p, L, x[:1], [solo], [5])
        b_x, b_xn = run_mla(p, L, x, [crowd] + [others[i % 8] for i in range(63)],
                            [5] + [i // 8 for i in range(63)])
        assert np.array_equal(a_x[0], b_x[0]) and np.array_equal(a_xn[0], b_xn[0])
