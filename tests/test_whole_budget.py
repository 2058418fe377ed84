"""A memory budget that holds the whole model (issue 30, item 2): nothing is ever evicted,
so it takes the plain path -- no expert cache counting, loading or pinning per step, the
model's files neither dropped nor re-read, copy-in experts read at load -- under the plan's
KV pool and prefill chunks; one expert short of that, the expert cache runs."""
import gc

import pytest

from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.experts.residency import MiB, check_budget, file_cache_bytes
from colibri_core.memstat import drop_file_cache

PROMPT = [5, 17, 3, 99, 42, 7, 1, 250]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from colibri_core.model.testing import write_random_model
    d = tmp_path_factory.mktemp("whole") / "m"
    write_random_model(d, seed=5, vocab=512, hidden=256, layers=("dense", "moe", "moe"),
                       experts=8, top_k=2, inter=512, moe_inter=512, shared=0, context=128)
    return d


def whole_mb(d, mode):
    """The smallest budget (0.01 MiB steps) that holds every file, by an independent sum:
    all the model's files + the plan's KV reserve and activations."""
    files = sum(p.stat().st_size for p in d.glob("*.bin"))
    mb = files / MiB
    while True:
        p = check_budget(d, EngineConfig(max_resident_mb=mb, load_mode=mode))
        if mb * MiB >= files + p.kv + p.act:
            return mb
        mb = max(mb + 0.01, (files + p.kv + p.act) / MiB)


def tokens(eng):
    return eng.generate(PROMPT, max_new_tokens=6, temperature=0.0).run().token_ids


@pytest.fixture(scope="module")
def reference(model_dir):
    with Engine(model_dir, EngineConfig()) as eng:
        out = tokens(eng)
    gc.collect()
    return out


@pytest.mark.parametrize("mode", ["mmap", "copy"])
def test_a_budget_holding_the_whole_model_runs_the_plain_path(model_dir, reference, mode):
    mb = whole_mb(model_dir, mode)
    plan = check_budget(model_dir, EngineConfig(max_resident_mb=mb, load_mode=mode))
    assert plan.holds_whole_model
    experts = sorted(model_dir.glob("expert_*.bin"))
    for f in experts:                         # the files cached: a budget must not drop them
        f.read_bytes()
    with Engine(model_dir, EngineConfig(max_resident_mb=mb, load_mode=mode,
                                        preload="populate")) as eng:
        res = eng.model.residency
        assert not res.active                 # the one C call per MoE layer, no cache
        if mode == "mmap":
            cached = sum(file_cache_bytes(f) for f in experts)
            assert cached >= sum(f.stat().st_size for f in experts) - 4096 * len(experts)
        else:                                 # read at load, as without a budget
            assert all(ex.ffn is not None for lw in eng.weights.layers for ex in lw.experts)
        assert tokens(eng) == reference
        rep = eng.memory_report(page_cache=False)
        assert rep["budget"] == plan.budget and rep["whole_model"]
        assert rep["loads"] == 0 and rep["capacity"] == plan.capacity
        assert res.chunk_tokens == plan.chunk_tokens     # prefill still in the plan's chunks
        assert eng.kv_pool.capacity_tokens == plan.kv_tokens     # and the KV pool the plan's


@pytest.mark.parametrize("mode", ["mmap", "copy"])
def test_one_expert_short_of_the_whole_model_runs_the_expert_cache(model_dir, reference, mode):
    mb = whole_mb(model_dir, mode)
    plan = check_budget(model_dir, EngineConfig(max_resident_mb=mb, load_mode=mode))
    short = mb - (plan.expert_bytes + 1024) / MiB
    assert not check_budget(model_dir, EngineConfig(max_resident_mb=short,
                                                    load_mode=mode)).holds_whole_model
    for f in model_dir.glob("*.bin"):
        drop_file_cache(f, sync=True)
    with Engine(model_dir, EngineConfig(max_resident_mb=short, load_mode=mode)) as eng:
        assert eng.model.residency.active
        assert tokens(eng) == reference
        assert eng.memory_report(page_cache=False)["loads"] > 0
