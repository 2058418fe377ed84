"""residency.far_guess_margin (issue 31): a guess 2+ MoE layers ahead evicts only an
expert whose use rate (uses per forward since it came in, with one forward's prior of
top_k / num_experts) times the margin is at most the far guesses' measured precision;
pinned experts and guesses whose layer has not run are never its victims. Checked
against this file's own bookkeeping of uses (the eviction order of a scripted cache) and
against the unbudgeted engine's tokens and logits (bit for bit, with the rule skipping
far guesses at a tight budget)."""
import math

import numpy as np
import pytest

from colibri_core.config import EngineConfig, ResidencyConfig
from colibri_core.engine import Engine
from colibri_core.experts.expertcache import BudgetResidency
from residency_helpers import (assert_same_output, experts_mb, five_moe_layer_model,
                               unbudgeted_reference)

PROMPT = [int(t) for t in np.random.default_rng(12).integers(1, 500, 12)]
E, K = 16, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return five_moe_layer_model(tmp_path_factory.mktemp("farguess") / "m", 6, E, K)


def test_far_guesses_evict_only_cold_experts_in_policy_order(model_dir):
    cfg = EngineConfig(max_resident_mb=experts_mb(model_dir, 0.5),
                       residency=ResidencyConfig(policy="lru", speculative=True,
                                                 speculative_layers=3, far_guess_margin=2.0))
    with Engine(model_dir, cfg) as eng:
        res = eng.model.residency
        assert isinstance(res, BudgetResidency)
        L0, L1 = eng.model_cfg.moe_layers[:2]
        exps = eng.model.expert_set.experts
        uses, born, last = {}, {}, {}           # this test's own bookkeeping

        def forward(f, layer_uses):
            res.begin_forward(1, [])
            for L, used in layer_uses:
                res.acquire(L, used, exps[L])
                res.release(L, used)
                for e in used:
                    born.setdefault((L, e), f + 1)      # forwards count from 1
                    uses[(L, e)] = uses.get((L, e), 0) + 1
                    last[(L, e)] = f
        # forwards 0..7: expert 0 every time (hot); 1 once at 0, 3 once at 2 (cold);
        # 2 once at 6 (came in lately: its one use is recent)
        plan = {0: [0, 1], 2: [0, 3], 6: [0, 2]}
        for f in range(8):
            forward(f, [(L0, plan.get(f, [0]))])
        # a guess for L1 whose layer has not run: never a far guess's victim
        g = res._admit((L1, 5), exps[L1][5], 1)
        g.spec, g.uses = True, 0
        # a guess already scored wrong (score -inf): first in line if cold enough
        w = res._admit((L1, 6), exps[L1][6], 1)
        w.spec, w.uses, w.score = True, 0, -math.inf
        n = res.forwards                       # 8 forwards begun

        def rate(key):
            return (uses[key] + K / E) / (n - born[key] + 1)   # forwards it was in
        assert res.use_rate(res.entries[(L0, 1)]) == pytest.approx(rate((L0, 1)))
        assert res.use_rate(res.entries[(L0, 0)]) == pytest.approx(rate((L0, 0)))
        p = 0.4
        expect = [(L1, 6)]                       # scored wrong: score -inf
        expect += sorted((k for k in [(L0, 0), (L0, 1), (L0, 2), (L0, 3)]
                          if 2.0 * rate(k) <= p), key=lambda k: last[k])   # lru order
        assert expect == [(L1, 6), (L0, 1), (L0, 3)]     # the scenario is what it says
        evicted = []
        for _ in range(len(expect) + 1):
            before = set(res.entries)
            ok = res._make_room(res.capacity - res.used + 1, optional=True, far_p=p)
            gone = before - set(res.entries)
            if not ok:
                assert not gone or gone <= set(expect)
                break
            evicted += sorted(gone)
        assert evicted[:len(expect)] == expect
        assert not ok                            # then nothing cold enough is left
        assert {(L0, 0), (L0, 2), (L1, 5)} <= set(res.entries)
        # the policy's own order (a near guess, or a miss) would evict the hot expert too
        res._make_room(res.capacity, optional=True)
        assert (L0, 0) not in res.entries


def test_precision_counts_far_guesses_by_depth(model_dir):
    cfg = EngineConfig(max_resident_mb=experts_mb(model_dir, 0.25),
                       residency=ResidencyConfig(speculative=True, speculative_layers=3))
    with Engine(model_dir, cfg) as eng:
        eng.generate(PROMPT, max_new_tokens=6, temperature=0.0).run()
        res = eng.model.residency
        far = eng.memory_report(page_cache=False)["speculation"]["far"]
        assert set(far) == {1, 2}
        for d, f in far.items():
            assert 0 <= f["correct"] <= f["guessed"] > 0
            assert res.far_precision(d) == (f["correct"] + 1) / (f["guessed"] + 2)


@pytest.fixture(scope="module")
def reference(model_dir):
    return unbudgeted_reference(model_dir, PROMPT)


@pytest.mark.parametrize("mode", ["mmap", "copy"])
def test_rule_changes_no_output_and_every_far_victim_was_cold(model_dir, reference, mode,
                                                              monkeypatch):
    victims, uses, born = [], {}, {}
    admit, acquire, spec_layer, evict = (BudgetResidency._admit, BudgetResidency.acquire,
                                         BudgetResidency._speculate_layer, BudgetResidency._evict)
    depth_now = [None]

    def spy_admit(self, key, ex, prio):
        born[key], uses[key] = self.forwards, 0
        return admit(self, key, ex, prio)

    def spy_acquire(self, layer, used, experts):
        run = acquire(self, layer, used, experts)
        for e in used:
            if (layer, int(e)) in uses:
                uses[(layer, int(e))] += 1
        return run

    def spy_spec(self, L, x, es, k, depth):
        depth_now[0] = depth
        try:
            return spec_layer(self, L, x, es, k, depth)
        finally:
            depth_now[0] = None

    def spy_evict(self, ent):
        if depth_now[0]:                          # a far guess's eviction
            victims.append((ent.spec and ent.score != -math.inf, ent.pins, self.far_margin,
                            self.far_precision(depth_now[0]), uses[ent.key],
                            self.forwards - born[ent.key] + 1))
        del uses[ent.key], born[ent.key]
        return evict(self, ent)
    for name, f in (("_admit", spy_admit), ("acquire", spy_acquire),
                    ("_speculate_layer", spy_spec), ("_evict", spy_evict)):
        monkeypatch.setattr(BudgetResidency, name, f)
    cfg = EngineConfig(max_resident_mb=experts_mb(model_dir, 0.25), load_mode=mode,
                       residency=ResidencyConfig(speculative=True, speculative_layers=3,
                                                 debug_poison=True))
    with Engine(model_dir, cfg) as eng:
        assert_same_output(eng, reference, PROMPT)
        assert eng.memory_report(page_cache=False)["speculation"]["far_skipped"] > 0
    assert victims                                # far guesses did evict
    for pending_guess, pins, margin, p, n_uses, forwards in victims:
        assert not pending_guess and pins == 0
        assert margin * (n_uses + K / E) / forwards <= p + 1e-12
