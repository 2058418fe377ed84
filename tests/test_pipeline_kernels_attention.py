"""The pipeline's attention entry points (ck_step_attention, ck_step_mla_attention)
against the reference blocks, and their batch invariance: a token's row is bit-identical
alone and among 63 other tokens. The bounds: pipeline_kernel_helpers.py."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.kernels import ffi, lib
from colibri_core.forward.pipeline import Pipeline

from pipeline_kernel_helpers import (  # noqa: F401 (eng, every_thread: fixtures)
    eng, every_thread, hidden_rows, rel, run_attention, tol)


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


# ----------------------------------------------------------------------------- MLA

def _mla_awq(w, rng):
    for lw in w.layers:
        a = lw.attn
        a.act_scales = {n: rng.uniform(0.5, 2.0, getattr(a, n).cols).astype(np.float32)
                        for n in a.MATRICES if getattr(a, n) is not None}


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v3_plain_q", "deepseek_v2",
                                        "deepseek_v3_over_budget", "deepseek_v2_float_act",
                                        "deepseek_v3_awq", "deepseek_v3_awq_over_budget",
                                        "deepseek_v2_odd_heads"])
def mla_eng(request, tmp_path_factory):
    """over_budget: W_UK / W_UV past the float budget, read from wkv_b's quantized rows;
    awq: activation scales on every MLA matrix (wkv_b's divided out of its columns);
    odd_heads: 6 heads (one group, 2 heads past the AVX2 kernel's 4-head block) and a
    rope part of 12 (not a multiple of 8)."""
    from hf_helpers import make_hf_model, save, write_tokenizer
    from colibri_core.forward import pipeline as P
    from colibri_core.convert import convert
    name = request.param
    over = {"q_lora_rank": None, "rope_interleave": False} if name.endswith("plain_q") else {}
    if name.endswith("odd_heads"):
        over = {"num_attention_heads": 6, "num_key_value_heads": 6, "qk_rope_head_dim": 12}
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


@pytest.mark.parametrize("backend", ["scalar", "auto"])
def test_mla_backends_match_the_reference(mla_eng, backend):
    """The backends with an `mla` kernel (AVX2, AVX-512: ck_avx2_mla) and those without
    (scalar, NEON: ck_step_mla.c's per-head loop) against the same reference."""
    from colibri_core import kernels as K
    K.set_backend(backend)
    try:
        test_mla_attention_matches_the_reference_block(mla_eng)
    finally:
        K.set_backend("auto")
