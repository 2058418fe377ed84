"""residency.speculative_layers (issue 31): the expert cache guesses the experts of the
next d MoE layers from one hidden state and loads them, nearer layers first. Checked
against independent references: the unbudgeted engine's greedy tokens and logits (bit for
bit, mmap and copy-in with evicted frames poisoned), and the order the loads were asked
for (each guess's layers ascending, at priorities 1, 2, 3 after the demand loads' 0)."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig, ResidencyConfig
from colibri_core.engine import Engine
from colibri_core.experts.expertcache import BudgetResidency
from residency_helpers import (assert_same_output, experts_mb, five_moe_layer_model,
                               unbudgeted_reference)

PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 500, 12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return five_moe_layer_model(tmp_path_factory.mktemp("depth") / "m", 5)


def quarter(d):
    return experts_mb(d, 0.25)


@pytest.fixture(scope="module")
def reference(model_dir):
    return unbudgeted_reference(model_dir, PROMPT)


@pytest.mark.parametrize("mode", ["mmap", "copy"])
@pytest.mark.parametrize("depth", [1, 3])
def test_guessing_layers_ahead_changes_no_output(model_dir, reference, mode, depth):
    cfg = EngineConfig(max_resident_mb=quarter(model_dir), load_mode=mode,
                       residency=ResidencyConfig(speculative=True, speculative_layers=depth,
                                                 debug_poison=True))
    with Engine(model_dir, cfg) as eng:
        assert_same_output(eng, reference, PROMPT)
        assert eng.memory_report(page_cache=False)["speculation"]["guessed"] > 0


def test_loads_are_asked_for_layers_ahead_nearest_first(model_dir, monkeypatch):
    asked = []
    admit = BudgetResidency._admit

    def spy(self, key, ex, prio):
        asked.append((key[0], prio))
        return admit(self, key, ex, prio)
    monkeypatch.setattr(BudgetResidency, "_admit", spy)
    # far_guess_margin 0: every far guess is loaded (the rule that skips some is
    # tests/test_far_guess_rule.py's)
    cfg = EngineConfig(max_resident_mb=quarter(model_dir),
                       residency=ResidencyConfig(speculative=True, speculative_layers=3,
                                                 far_guess_margin=0))
    with Engine(model_dir, cfg) as eng:
        eng.generate(PROMPT, max_new_tokens=4, temperature=0.0).run()
        moe = eng.model_cfg.moe_layers
    spec = [(L, p) for L, p in asked if p > 0]
    assert {p for _, p in spec} == {1, 2, 3}
    for L, p in spec:                      # priority 1 + depth: the depth-th MoE layer ahead
        assert moe.index(L) >= p - 1
    # within a run of guesses (one speculate call), layers and priorities never go back
    runs, cur = [], []
    for L, p in asked:
        if p == 0 or (cur and p < cur[-1][1]):
            if cur:
                runs.append(cur)
            cur = [] if p == 0 else [(L, p)]
        else:
            cur.append((L, p))
    runs.append(cur)
    assert any(len({p for _, p in r}) == 3 for r in runs)
    for r in runs:
        assert [L for L, _ in r] == sorted(L for L, _ in r)
