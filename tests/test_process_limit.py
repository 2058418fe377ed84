"""EngineConfig.process_limit_mb (residency.derive_budget), the embedding counted by the rows
a forward touches, the KV pool sized to the profile's context, and the shipped 256 MiB
profile (configs/small-256mb.yaml). Fast: no cgroup (benchmarks/speed/bench_256mb.py measures
the profile under one)."""
import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from colibri_core.config import EngineConfig, builtin_model_dir, load_run_config, parse
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl
from colibri_core.memstat import PAGE, drop_file_cache, proc_memory, resident_bytes
from colibri_core.experts.residency import (ENGINE_RESERVE, MiB, activation_bytes, check_budget,
                                    derive_budget, embedding_layout, process_overhead_bytes)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "configs" / "small-256mb.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A large vocabulary (16384 x 256, q4: 2.2 MB of embedding) and 2 MoE layers."""
    from colibri_core.model.testing import write_random_model
    d = tmp_path_factory.mktemp("plimit") / "m"
    write_random_model(d, seed=5, vocab=16384, hidden=256, layers=("moe", "moe"), experts=8,
                       top_k=2, moe_inter=512, shared=0, heads=4, kv_heads=2, context=256)
    return d


def test_limit_minus_the_overhead_is_the_budget(model_dir):
    overhead = 40 * MiB
    cfg, plan = derive_budget(model_dir, EngineConfig(process_limit_mb=100), overhead=overhead)
    assert cfg.max_resident_mb == pytest.approx(60.0)
    assert cfg.process_limit_mb == 100
    assert plan.budget == 60 * MiB and plan.overhead == overhead and plan.process_limit == 100 * MiB
    assert plan.capacity == plan.budget - plan.dense - plan.kv - plan.act


def test_overhead_is_measured_at_start(model_dir):
    rss = proc_memory()["VmRSS"]
    measured = process_overhead_bytes(16)
    assert rss + ENGINE_RESERVE <= measured <= rss + ENGINE_RESERVE + 16 * (16 << 10) + 8 * MiB
    limit = int((measured + 64 * MiB) / MiB)
    with Engine(model_dir, EngineConfig(process_limit_mb=limit)) as eng:
        plan = eng.model.residency.plan
        assert eng.config.max_resident_mb == pytest.approx(limit - plan.overhead / MiB)
        # measured when the engine started: the RSS then, not a constant
        assert abs(plan.overhead - measured) < 16 * MiB
        assert eng.generate([1, 2, 3], max_new_tokens=2, temperature=0.0).run() is not None


def test_too_small_a_limit_is_refused_naming_both_figures(model_dir):
    probe = check_budget(model_dir, EngineConfig(max_resident_mb=1000))
    overhead = 50 * MiB
    need = int(np.ceil((overhead + probe.minimum) / MiB))
    with pytest.raises(ConfigError) as ei:
        derive_budget(model_dir, EngineConfig(process_limit_mb=need - 1), overhead=overhead)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "process_limit_mb=" in msg and "overhead is 50.0 MB" in msg
    assert f"at least {probe.minimum / MiB:.1f} MB" in msg and f">= {need}" in msg
    derive_budget(model_dir, EngineConfig(process_limit_mb=need), overhead=overhead)
    with pytest.raises(ConfigError, match="process_limit_mb=1 is too small"):
        Engine(model_dir, EngineConfig(process_limit_mb=1))


def test_both_limits_are_refused():
    with pytest.raises(ConfigError) as ei:
        parse(EngineConfig, {"process_limit_mb": 256, "max_resident_mb": 200}, "engine")
    assert "both set" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(ValidationError):
        EngineConfig(process_limit_mb=256, max_resident_mb=200)


def test_kv_pool_and_activations_follow_the_profile_context(model_dir):
    small = check_budget(model_dir, EngineConfig(max_resident_mb=100, kv_pool_tokens=32))
    full = check_budget(model_dir, EngineConfig(max_resident_mb=100))
    assert small.kv_tokens == 32 and full.kv_tokens == 256
    assert small.kv * 8 == full.kv
    from colibri_core.config import load_model_config
    cfg = load_model_config(model_dir / "config.json")
    assert small.minimum - small.dense - small.kv - 2 * small.expert_bytes == activation_bytes(cfg, 1, 32)


def test_embedding_counted_by_rows(model_dir):
    lay = embedding_layout(model_dir)
    assert lay.nbytes > 2 * MiB and lay.row_pages == 3      # q4: data, scales, zeros
    rows = check_budget(model_dir, EngineConfig(max_resident_mb=100, kv_pool_tokens=32))
    assert rows.embed_total == lay.nbytes and rows.embed_rows == 32
    assert rows.embed_reserve == 32 * 3 * PAGE
    copy = check_budget(model_dir, EngineConfig(max_resident_mb=100, kv_pool_tokens=32,
                                                load_mode="copy"))
    assert copy.embed_reserve == copy.embed_total and copy.embed_rows == 0
    assert copy.dense - rows.dense == lay.nbytes - rows.embed_reserve


class EmbedProbe:
    """The embedding's resident bytes (mincore over its parts), after every layer."""

    def __init__(self, main, parts):
        self.ranges = [(main.base_address + off // PAGE * PAGE,
                        -(-(off + n) // PAGE) * PAGE - off // PAGE * PAGE) for off, n in parts]
        self.peak = 0

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        self.peak = max(self.peak, sum(resident_bytes(a, n) for a, n in self.ranges))


def test_embedding_pages_stay_within_their_rows(model_dir):
    """Two requests of 24 distinct tokens each with a pool of 32 positions: the second
    drops the embedding's pages first; its resident pages never exceed the reserve, and
    the tokens are those of the unbudgeted engine."""
    rng = np.random.default_rng(1)
    ids = rng.permutation(16384)[:48].tolist()
    prompts = [ids[:20], ids[24:44]]
    with Engine(model_dir, EngineConfig()) as eng:
        want = [eng.generate(p, max_new_tokens=4, temperature=0.0).run().token_ids for p in prompts]
    gc.collect()
    # the plain engine's preload left model.bin in 2 MB folios, which a drop of the
    # embedding's range alone cannot split: start from the file out of the page cache
    drop_file_cache(model_dir / "model.bin", sync=True)
    with Engine(model_dir, EngineConfig(max_resident_mb=11, kv_pool_tokens=32)) as eng:   # < whole
        res = eng.model.residency
        main = next(f for f in eng.weights.files if f.path.name == "model.bin")
        probe = EmbedProbe(main, embedding_layout(model_dir).parts)
        eng.register_plugin(probe, name="embed-probe")
        got = [eng.generate(p, max_new_tokens=4, temperature=0.0).run().token_ids for p in prompts]
        plan = res.plan
        assert res.embed_drops >= 1
    assert got == want
    assert 0 < probe.peak <= plan.embed_reserve, (probe.peak, plan.embed_reserve)


def test_shipped_profile_loads_and_runs():
    """configs/small-256mb.yaml validates, and runs the built-in model under its limit (in
    a fresh process: the limit covers the process, whose RSS a test run inflates)."""
    cfg, model_dir = load_run_config(PROFILE)
    assert cfg.engine.process_limit_mb == 256 and cfg.engine.max_resident_mb is None
    assert cfg.engine.kv_pool_tokens == 512 and cfg.engine.kv_dtype == "f16"
    assert model_dir.name == "colibri_q4"          # the benchmark model (not in the repo)
    code = ("import json, sys; from colibri_core.engine import Engine; "
            "from colibri_core.config import builtin_model_dir; "
            f"eng = Engine.from_config({str(PROFILE)!r}, model=builtin_model_dir(), threads=1); "
            "g = eng.generate([1, 2, 3, 4], max_new_tokens=3); g.run(); "
            "p = eng.model.residency.plan; "
            "print(json.dumps([eng.config.max_resident_mb, p.overhead, p.process_limit, "
            "len(g.token_ids)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    budget_mb, overhead, limit, n = json.loads(r.stdout.splitlines()[-1])
    assert limit == 256 * MiB and n == 3
    assert budget_mb == pytest.approx(256 - overhead / MiB) and 0 < overhead < 200 * MiB


def test_docs_describe_the_limit_and_the_profile():
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    bench = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "process_limit_mb" in arch and "small-256mb" in arch
    assert "An x86 host under a 256 MB limit" in bench and "bench_256mb.py" in bench
    assert "process_limit_mb" in PROFILE.read_text()
