"""Shared pieces of the expert-cache depth tests (tests/test_expertcache_depth.py,
tests/test_far_guess_rule.py): a random model with five MoE layers after a dense one, its
experts' size, and the unbudgeted engine's greedy tokens and logits (the reference)."""
from __future__ import annotations

import numpy as np

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.experts.residency import MiB


def five_moe_layer_model(d, seed: int, experts: int = 16, top_k: int = 2):
    """A random model in folder `d`: vocab 512, hidden 256, one dense layer then five MoE
    layers of `experts` experts (top_k, moe_inter 1024, no shared expert)."""
    from colibri_core.model.testing import write_random_model
    write_random_model(d, seed=seed, vocab=512, hidden=256, layers=("dense",) + ("moe",) * 5,
                       experts=experts, top_k=top_k, inter=512, moe_inter=1024, shared=0,
                       heads=4, kv_heads=2, context=128)
    return d


def experts_mb(d, share: float) -> float:
    """`share` of the size of the model's expert files, in MiB (a residency budget)."""
    return sum(p.stat().st_size for p in d.glob("expert_*.bin")) * share / MiB


def unbudgeted_reference(model_dir, prompt, new_tokens: int = 8):
    """(greedy token ids of `new_tokens`, logits at every position of prompt[:6]) from the
    engine with every expert resident."""
    with Engine(model_dir, EngineConfig()) as eng:
        g = eng.generate(prompt, max_new_tokens=new_tokens, temperature=0.0)
        g.run()
        return g.token_ids, eng.next_token_logits(prompt[:6], all_positions=True)


def assert_same_output(eng, reference, prompt, new_tokens: int = 8):
    """eng's greedy tokens and prompt[:6]'s logits equal unbudgeted_reference's, bit for bit."""
    toks, logits = reference
    g = eng.generate(prompt, max_new_tokens=new_tokens, temperature=0.0)
    g.run()
    assert g.token_ids == toks
    assert np.array_equal(eng.next_token_logits(prompt[:6], all_positions=True), logits)
