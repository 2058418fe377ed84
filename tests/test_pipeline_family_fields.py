"""The config fields issue 32's families brought into the one pipeline, C against the numpy
reference (reference.py, routing.route): Granite's embedding / attention / residual /
logit multipliers, GLM's partial rotary (`rotary_dim`), ERNIE's selection bias on the
softmax probabilities (`select_bias_on_probs`). The converted families' parity with
transformers is tests/test_convert_families_more.py; here the C blocks themselves, on a
random model with every field away from its default: a batch of sequences (prefill and
decode through the KV cache), float and int8 activations, and the router bit for bit."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.model.routing import route
from colibri_core.model.testing import write_random_model

from pipeline_kernel_helpers import route_c

FIELDS = dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.3,
              logits_scaling=4.0, rotary_dim=16)


@pytest.mark.parametrize("act", ["float", "int8"])
def test_pipeline_matches_the_reference_with_the_family_fields(tmp_path, act):
    write_random_model(tmp_path / "m", seed=7, vocab=300, hidden=192, heads=4, kv_heads=2,
                       layers=("dense", "moe", "moe"), experts=6, top_k=2, shared=64, **FIELDS)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 300, n) for n in (48, 5, 1)]
    with Engine(tmp_path / "m", EngineConfig(threads=2, activations=act, routing="float")) as e:
        m = e.model
        assert (m.cfg.rotary_dim, m.cfg.head_size) == (16, 48)
        caches, rcaches = [m.new_cache(64) for _ in prompts], [m.ref.new_cache(64) for _ in prompts]
        got = m.forward(prompts, caches, all_logits=True)
        want = last = m.ref.forward(prompts, rcaches, all_logits=True)
        for _ in range(3):                       # decode steps through both caches
            nxt = [np.array([int(np.argmax(w[-1] if w.ndim > 1 else w))]) for w in last]
            got += m.forward(nxt, caches)
            last = m.ref.forward(nxt, rcaches)
            want = want + last
    bound = 1e-4 if act == "float" else 5e-3
    for g, w in zip(got, want):
        err = float(np.abs(g - w).max() / np.abs(w).max())
        assert err < bound, err
    # each field matters: without the multipliers the reference is far from the pipeline
    assert float(np.abs(got[0] - want[0] * FIELDS["logits_scaling"]).max()) > 10 * bound


def _route_c(logits, k, select_bias, *, fixed, bias_on_probs):
    """ck_step_route on `logits` [n, E] exactly (identity router over padded rows)."""
    rc, ids, w = route_c(logits, k, scoring="fixed" if fixed else "float", norm=1, scaling=1.0,
                         select_bias=select_bias, bias_on_probs=bias_on_probs)
    assert rc == 0
    return ids, w


@pytest.mark.parametrize("seed", range(12))
def test_router_selection_bias_on_probabilities(seed):
    """ERNIE-4.5's choice (softmax probabilities + bias) in C equals routing.route's, ids and
    weights (fixed-point bit for bit), and differs from the choice on logits + bias."""
    rng = np.random.default_rng(seed)
    E, n = int(rng.integers(4, 16)), int(rng.integers(1, 9))
    k = rng.integers(1, min(E, 6) + 1, n)
    logits = (rng.standard_normal((n, E)) * rng.choice([0.3, 2.0])).astype(np.float32)
    sb = (rng.standard_normal(E) * 0.2).astype(np.float32)
    fixed = bool(seed % 2)
    ids, w = _route_c(logits, k, sb, fixed=fixed, bias_on_probs=1)
    ref = route(logits, k, mode="fixed" if fixed else "float", bias=sb, bias_on_probs=True)
    assert ids.tolist() == ref.ids.tolist()
    if fixed:
        assert w.tolist() == ref.weights.tolist()
    else:
        np.testing.assert_allclose(w, ref.weights, rtol=1e-6, atol=1e-7)
    on_logits = route(logits, k, mode="float", bias=sb * 50)     # a bias that matters on logits
    on_probs = route(logits, k, mode="float", bias=sb * 50, bias_on_probs=True)
    ids2, _ = _route_c(logits, k, sb * 50, fixed=False, bias_on_probs=1)
    assert ids2.tolist() == on_probs.ids.tolist()
    if seed == 0:
        assert on_logits.ids.tolist() != on_probs.ids.tolist() or n == 1
