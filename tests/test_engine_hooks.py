"""Hooks fired by the real engine loop, with real plugins (the plugin layer's own tests
are in test_plugins.py)."""
import os
import re

import numpy as np
import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.hookspecs import hookimpl


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def colibri_before_layer(self, layer, hidden):
        self.calls.append(("before", layer))

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        self.calls.append(("after", layer))

    @hookimpl
    def colibri_token(self, request_id, step, token_id, text, expert_set_generation,
                      expert_set_id):
        self.calls.append(("token", step, token_id))

    @hookimpl
    def colibri_request_start(self, request_id, prompt_tokens, k):
        self.calls.append(("start", prompt_tokens, k))

    @hookimpl
    def colibri_request_end(self, request_id, n_tokens, stop_reason):
        self.calls.append(("end", n_tokens, stop_reason))


def test_layer_token_and_request_hooks_fire_in_order(tiny_model_dir):
    with Engine(tiny_model_dir) as eng:
        rec = Recorder()
        eng.register_plugin(rec)
        g = eng.generate([1, 2, 3], max_new_tokens=3, temperature=0).run()
    assert rec.calls[0] == ("start", 3, 2)
    assert rec.calls[1:7] == [("before", 0), ("after", 0), ("before", 1), ("after", 1),
                              ("before", 2), ("after", 2)]
    tokens = [c for c in rec.calls if c[0] == "token"]
    assert [(s, t) for _, s, t in tokens] == list(enumerate(g.token_ids))
    assert rec.calls[-1] == ("end", 3, "length")


class ForceExpert:
    """Routing override: every token goes to expert 3 alone."""

    @hookimpl
    def colibri_routing(self, layer, expert_ids, weights, scores, logits):
        n = expert_ids.shape[0]
        return np.full((n, 1), 3), np.ones((n, 1), np.float32)


def test_routing_override_changes_the_output(tiny_model_dir):
    with Engine(tiny_model_dir, EngineConfig(routing="float", activations="float")) as eng:
        base = eng.next_token_logits([5, 6])
        with_k1_3 = None
        eng.register_plugin(ForceExpert())
        forced = eng.next_token_logits([5, 6])
        assert all((t.routing.ids == 3).all() for t in eng.model.last_routing)
    assert np.abs(forced - base).max() > 1e-3


class KFromPlugin:
    @hookimpl
    def colibri_choose_k(self, prompt_tokens, request, default_k):
        return 3


class AlwaysToken:
    @hookimpl
    def colibri_sample(self, logits, request):
        return 42


class PerTokenK:
    @hookimpl
    def colibri_choose_k_token(self, layer, probs, default_k):
        return np.ones(probs.shape[0], dtype=np.int64)


def test_choose_k_sample_and_per_token_k_hooks(tiny_model_dir):
    with Engine(tiny_model_dir) as eng:
        eng.register_plugin(KFromPlugin())
        g = eng.generate([1, 2], max_new_tokens=2)
        assert (g.k, g.k_source) == (3, "plugin")
        assert eng.generate([1, 2], max_new_tokens=2, experts_per_token=1).k == 1      # argument wins
        eng.register_plugin(AlwaysToken())
        assert g.run().token_ids == [42, 42]
        eng.register_plugin(PerTokenK())
        eng.next_token_logits([1, 2, 3])
        assert all(((t.routing.ids >= 0).sum(1) == 1).all() for t in eng.model.last_routing)


def test_tracer_lines_through_the_engine(tiny_model_dir):
    r, w = os.pipe()
    from colibri_core.builtin_plugins.tracer import Tracer
    with Engine(tiny_model_dir) as eng:
        eng.register_plugin(Tracer(kinds=("routing", "memory", "timing"), fd=w))
        eng.generate([1, 2, 3], max_new_tokens=1, temperature=0).run()
    os.close(w)
    out = os.read(r, 1 << 20).decode()
    os.close(r)
    lines = out.splitlines()
    routing = [l for l in lines if l.startswith("[ROUTING]")]
    assert len(routing) == 3 * 2          # 3 prompt tokens x 2 MoE layers (layers 1, 2)
    for l in routing:
        assert re.fullmatch(r"\[ROUTING\] layer=[12], top_k=\[\d,\d\], scores=\[0\.\d{3},0\.\d{3}\]", l), l
    mem = [l for l in lines if l.startswith("[MEMORY]")]
    assert mem and all(re.fullmatch(r"\[MEMORY\] expert_[12]_\d @ 0x[0-9a-f]+ \(size=\d+\)", l) for l in mem)
    size = os.path.getsize(tiny_model_dir / "expert_1_0.bin")
    assert any(f"(size={size})" in l for l in mem)
    tm = [l for l in lines if l.startswith("[TIME]")]
    assert tm and all(re.fullmatch(r"\[TIME\] expert_[12]_\d FFN: \d+ cycles \(≈\d+\.\dus @ \d+\.\d\dGHz\)", l) for l in tm)


def test_count_routed_tokens_matches_a_routing_observer(tiny_model_dir):
    """The engine's own routed-token counter (what `colibri serve` shows) against an
    observer of colibri_routing counting the same ids, over a prompt and its decode,
    with k varying per request."""
    class Observer:
        def __init__(self):
            self.counts = {}

        @hookimpl
        def colibri_routing(self, layer, expert_ids):
            ids = expert_ids[expert_ids >= 0]
            c = self.counts.setdefault(layer, {})
            for e in ids.ravel().tolist():
                c[e] = c.get(e, 0) + 1

    obs = Observer()
    with Engine(tiny_model_dir, EngineConfig(threads=1)) as eng:
        assert eng.routed_tokens() == {}
        eng.count_routed_tokens()
        eng.register_plugin(obs, "observer")
        eng.generate([5, 6, 7, 8, 9], max_new_tokens=6, temperature=0).run()
        eng.generate([11, 12], max_new_tokens=4, temperature=0, experts_per_token=1).run()
        got = eng.routed_tokens()
    assert sorted(got) == sorted(obs.counts) and got
    for layer, c in obs.counts.items():
        want = np.zeros(got[layer].size, np.int64)
        for e, n in c.items():
            want[e] = n
        assert np.array_equal(got[layer], want), layer
