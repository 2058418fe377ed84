"""What the tests of the pipeline's C entry points (test_pipeline_kernels*.py) share: the
model shapes and weight variants the `eng` fixture builds engines from, the error bound
`tol`, and the call that runs ck_step_attention on the pipeline's scratch.

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
from colibri_core.model.routing import _EXP2_TABLE
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


def route_c(logits, k, *, scoring, norm, scaling, bias=None, select_bias=None,
            n_group=1, topk_group=1, bias_on_probs=0):
    """ck_step_route on `logits` [n, E] exactly: xn = logits padded, router = identity;
    (rc, ids, weights)."""
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
        "exp2_q30": fp(exp2, "int64_t *"), "bias_on_probs": bias_on_probs})
    kk = np.ascontiguousarray(k, np.int32)
    kmax = int(kk.max())
    out_l = np.zeros((n, E), np.float32)
    ids = np.zeros((n, kmax), np.int64)
    w = np.zeros((n, kmax), np.float32)
    rc = lib.ck_step_route(r, fp(xn), n, fp(kk, "int32_t *"), kmax, fp(out_l), fp(ids, "int64_t *"),
                           fp(w), 0)
    del keep
    return rc, ids, w


def assert_decodes_as_reference(m, ref, prompt, c, r, last, steps: int, bound: float):
    """After `prompt` is in m's cache c and the reference model ref's cache r (`last`: the
    reference's logits of its last position), `steps` greedy decode steps whose logits are
    within `bound` (relative) of ref's; then batch invariance: the next step alone and
    beside another sequence, bit for bit."""
    tok = int(last.argmax())
    for _ in range(steps):
        a = m.decode_step(tok, c, m.cfg.top_k).copy()
        b = ref.forward([np.array([tok])], [r])[0]
        assert rel(a, b) < bound
        tok = int(b.argmax())
    x1, x2 = m.new_cache(32), m.new_cache(32)
    m.forward([prompt], [x1])
    m.forward([prompt], [x2])
    alone = m.forward([[tok]], [x1])[0].copy()
    crowd = m.forward([[tok], prompt[:3]], [x2, m.new_cache(32)])[0]
    assert np.array_equal(alone, crowd)
