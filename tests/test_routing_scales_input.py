"""`routing_scales_input` (Llama 4): a routed expert's weight multiplies its input, expert(w x),
not its output. The C expert block (tiles and, from 12 tokens an expert, the panels)
against the numpy reference over a 48-token prompt and decode steps; and the field
matters (expert(w x) != w expert(x) through the SiLU)."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.model.testing import write_random_model


def _model(path):
    return write_random_model(path, seed=5, vocab=300, hidden=192, heads=4, kv_heads=2,
                              layers=("dense", "moe", "moe"), experts=4, top_k=2, shared=64,
                              routing_scales_input=True, scoring_func="sigmoid",
                              norm_topk_prob=False, residual_multiplier=0.7)


@pytest.mark.parametrize("act", ["float", "int8"])
def test_expert_block_matches_the_reference(tmp_path, act):
    _model(tmp_path / "m")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 300, n) for n in (48, 3)]
    with Engine(tmp_path / "m", EngineConfig(activations=act, routing="float")) as e:
        m = e.model
        caches, rcaches = [m.new_cache(64) for _ in prompts], [m.ref.new_cache(64) for _ in prompts]
        got = m.forward(prompts, caches, all_logits=True)
        want = last = m.ref.forward(prompts, rcaches, all_logits=True)
        for _ in range(4):
            nxt = [np.array([int(np.argmax(w[-1] if w.ndim > 1 else w))]) for w in last]
            got += m.forward(nxt, caches)
            last = m.ref.forward(nxt, rcaches)
            want = want + last
        bound = 1e-4 if act == "float" else 5e-3
        for g, w in zip(got, want):
            assert float(np.abs(g - w).max() / np.abs(w).max()) < bound
        if act == "float":                          # the field off in the reference alone
            m.ref.cfg = m.ref.cfg.model_copy(update=dict(routing_scales_input=False))
            off = m.ref.forward(prompts[:1], [m.ref.new_cache(64)], all_logits=True)[0]
            assert float(np.abs(got[0] - off).max() / np.abs(off).max()) > 1e-2
