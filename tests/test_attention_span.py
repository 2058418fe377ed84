"""What a layer attends to, and how (issue 32's attention fields): a sliding window per layer
(`attention_window`, gpt-oss), a chunk per layer (`attention_chunk`, Llama 4), attention
sinks (`attention_sinks`, gpt-oss), an output projection bias (section `bo`), layers
without rope (`nope_layers`) with Llama 4's temperature tuning, and its weightless q/k
norm after rope (`qk_norm="l2"`).

The C step (prefill panels and decode, a prompt in pieces, every KV storage type) against the numpy
reference (reference.py), and that reference's attention (ops.attention) against a
float64 loop written from the definitions. Prompts of 48 tokens cross windows of 6 and
chunks of 16; decoding continues past them through the cache."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.model import ops
from colibri_core.model.testing import write_random_model

LAYERS = ("dense", "moe", "moe", "dense")
SPAN = dict(attention_window=[6, 0, 6, 0], attention_chunk=[0, 16, 0, 0],
            attention_sinks=True, nope_layers=[3], attn_temperature_floor=4,
            attn_temperature_scale=0.3)


def _attention_f64(q, k, v, scale, start, window, chunk, sinks):
    """Attention of q [n, NH, D] at positions start.. over k, v [S, NKV, D], one query
    and head at a time in float64, from the definitions."""
    n, NH, D = q.shape
    G = NH // k.shape[1]
    out = np.zeros((n, NH, D))
    for t in range(n):
        pos = start + t
        keep = [p for p in range(pos + 1) if (not window or p > pos - window)
                and (not chunk or p // chunk == pos // chunk)]
        for h in range(NH):
            z = np.array([q[t, h] @ k[p, h // G] for p in keep], np.float64) * scale
            e = np.exp(z - z.max())
            den = e.sum() + (np.exp(sinks[h] - z.max()) if sinks is not None else 0.0)
            out[t, h] = (e / den) @ v[keep, h // G].astype(np.float64)
    return out


@pytest.mark.parametrize("window,chunk,sinks", [(5, 0, False), (0, 8, False), (0, 0, True),
                                                (4, 8, True)])
def test_reference_attention_against_float64(window, chunk, sinks):
    rng = np.random.default_rng(window + chunk)
    S, start, NH, NKV, D = 30, 18, 4, 2, 8
    q = rng.standard_normal((S - start, NH, D)).astype(np.float32)
    k, v = (rng.standard_normal((S, NKV, D)).astype(np.float32) for _ in range(2))
    sk = (rng.standard_normal(NH) * 2).astype(np.float32) if sinks else None
    got = ops.attention(q, k, v, 0.3, start, window, chunk, sk)
    np.testing.assert_allclose(got, _attention_f64(q, k, v, 0.3, start, window, chunk, sk),
                               rtol=1e-5, atol=1e-5)


def _run(m, prompts, decode_steps=20):
    caches, rcaches = [m.new_cache(80) for _ in prompts], [m.ref.new_cache(80) for _ in prompts]
    got = m.forward(prompts, caches, all_logits=True)
    want = last = m.ref.forward(prompts, rcaches, all_logits=True)
    for _ in range(decode_steps):                  # decode through both caches
        nxt = [np.array([int(np.argmax(w[-1] if w.ndim > 1 else w))]) for w in last]
        got += m.forward(nxt, caches)
        last = m.ref.forward(nxt, rcaches)
        want = want + last
    return got, want


@pytest.mark.parametrize("act,kv", [("float", "f32"), ("int8", "f32"), ("float", "f16"),
                                    ("float", "q8")])
def test_pipeline_matches_the_reference_with_windows_chunks_sinks(tmp_path, act, kv):
    write_random_model(tmp_path / "m", seed=3, vocab=300, hidden=192, heads=4, kv_heads=2,
                       layers=LAYERS, experts=6, top_k=2, shared=64, out_bias=True,
                       qk_norm="l2", **SPAN)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 300, n) for n in (48, 7, 1)]
    cfg = EngineConfig(threads=2, activations=act, routing="float", kv_dtype=kv)
    with Engine(tmp_path / "m", cfg) as e:
        got, want = _run(e.model, prompts)
    # q8 rows: a value at a rounding tie may take the neighbouring code on one side (the
    # model without any of these fields differs by 1.2e-4 there too)
    bound = 1e-4 if act == "float" and kv != "q8" else 5e-3
    for g, w in zip(got, want):
        assert float(np.abs(g - w).max() / np.abs(w).max()) < bound


def test_a_prompt_in_pieces_matches_it_whole(tmp_path):
    """The scheduler's chunked prefill: a prompt's later pieces start mid-sequence (inside a
    window, across a chunk border) and must see what the whole prompt's tokens see."""
    write_random_model(tmp_path / "m", seed=3, vocab=300, hidden=192, heads=4, kv_heads=2,
                       layers=LAYERS, experts=6, top_k=2, shared=64, out_bias=True,
                       qk_norm="l2", **SPAN)
    ids = np.random.default_rng(5).integers(0, 300, 48)
    with Engine(tmp_path / "m", EngineConfig(activations="float", routing="float")) as e:
        m = e.model
        whole = m.ref.forward([ids], [m.ref.new_cache(64)], all_logits=True)[0]
        cache, got = m.new_cache(64), []
        for a, b in ((0, 13), (13, 30), (30, 31), (31, 48)):     # 13: inside chunk 0, ...
            got.append(m.forward([ids[a:b]], [cache], all_logits=True)[0])
    got = np.concatenate(got)
    assert float(np.abs(got - whole).max() / np.abs(whole).max()) < 1e-4


def test_each_field_changes_the_result(tmp_path):
    """The test above would pass with a field ignored on both sides; here each field,
    switched off in the reference alone, moves the logits far past the bound."""
    write_random_model(tmp_path / "m", seed=3, vocab=300, hidden=192, heads=4, kv_heads=2,
                       layers=LAYERS, experts=6, top_k=2, shared=64, out_bias=True,
                       qk_norm="l2", **SPAN)
    prompt = [np.random.default_rng(2).integers(0, 300, 48)]
    with Engine(tmp_path / "m", EngineConfig(activations="float", routing="float")) as e:
        m = e.model
        got = m.forward(prompt, [m.new_cache(64)], all_logits=True)[0]
        base = m.ref.cfg
        for change in (dict(attention_window=[]), dict(attention_chunk=[]), dict(nope_layers=[]),
                       dict(attn_temperature_floor=0), dict(qk_norm="none")):
            m.ref.cfg = base.model_copy(update=change)
            want = m.ref.forward(prompt, [m.ref.new_cache(64)], all_logits=True)[0]
            assert np.abs(got - want).max() / np.abs(want).max() > 1e-2, change
        m.ref.cfg = base
        for lw in m.ref.w.layers:                    # sinks and the output bias
            for name in ("sinks", "bo"):
                keep = getattr(lw.attn, name)
                setattr(lw.attn, name, None)
                want = m.ref.forward(prompt, [m.ref.new_cache(64)], all_logits=True)[0]
                setattr(lw.attn, name, keep)
                assert np.abs(got - want).max() / np.abs(want).max() > 1e-3, (lw.index, name)


def test_bad_spans_are_refused_naming_the_field(tmp_path):
    from colibri_core.errors import ConfigError
    for over, needle in ((dict(attention_window=[4]), "attention_window"),
                         (dict(attention_chunk=[0, -1, 0, 0]), "attention_chunk"),
                         (dict(nope_layers=[7]), "nope_layers")):
        with pytest.raises((ConfigError, ValueError), match=needle):
            write_random_model(tmp_path / "x", layers=LAYERS, **over)
