"""Memory budget (EngineConfig.max_resident_mb) and the expert cache (residency.py).

A small random model whose routed experts are ~4x the budget: the budget holds (peak RSS
growth and the expert files' page-cache residency, measured with mincore while experts are
pinned mid-layer), results are bit-identical to the unbudgeted run, an evicted copy-in frame
(poisoned with NaN) is never one the current token still uses, and a budget too small to
run is refused at start with the minimum.
"""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_core.config import EngineConfig, ResidencyConfig
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl
from colibri_core.experts.residency import MiB, check_budget, file_cache_bytes, proc_memory

PROMPT = [int(t) for t in np.random.default_rng(7).integers(1, 500, 32)]
N_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """5 layers (1 dense, 4 MoE x 16 experts of ~430 KB, top-2): 27 MB of experts."""
    from colibri_core.model.testing import write_random_model
    d = tmp_path_factory.mktemp("budget") / "m"
    write_random_model(d, seed=3, vocab=512, hidden=256, layers=("dense",) + ("moe",) * 4,
                       experts=16, top_k=2, inter=512, moe_inter=1024, shared=0, heads=4,
                       kv_heads=2, context=128)
    return d


def expert_files(d):
    return sorted(d.glob("expert_*.bin"))


def expert_bytes(d):
    return sum(p.stat().st_size for p in expert_files(d))


def budget_mb(d):
    """A quarter of the experts' bytes: the model's experts are 4x the budget."""
    return expert_bytes(d) / 4 / MiB


def run(eng, prompt=PROMPT, n=N_NEW):
    g = eng.generate(prompt, max_new_tokens=n, temperature=0.0)
    g.run()
    return g.token_ids


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens and logits of the unbudgeted engine (closed and collected after, so
    no mapping of it keeps expert pages in the page cache)."""
    def ref():
        with Engine(model_dir, EngineConfig()) as eng:
            toks = run(eng)
            chunk = check_budget(model_dir, EngineConfig(max_resident_mb=budget_mb(model_dir))).chunk_tokens
            short = PROMPT[:min(chunk, 24)]
            logits = eng.next_token_logits(short, all_positions=True)
            long_logits = eng.next_token_logits(PROMPT, all_positions=True)
        return toks, short, logits, long_logits
    out = ref()
    gc.collect()
    return out


class Sampler:
    """Plugin sampling the expert files' page-cache residency (mincore) while experts are
    pinned (after each expert runs) and at each layer's end."""

    def __init__(self, files):
        self.files = files
        self.peak = 0
        self.samples = 0
        self.res = None
        self.peak_used = 0

    def _sample(self):
        self.samples += 1
        self.peak = max(self.peak, sum(file_cache_bytes(f) for f in self.files))
        if self.res is not None:
            self.peak_used = max(self.peak_used, self.res.used)

    @hookimpl
    def colibri_expert_timing(self, layer, expert, cycles, seconds):
        if self.samples % 3 == 0:
            self._sample()
        else:
            self.samples += 1

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        self._sample()


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def test_model_is_4x_the_budget(model_dir):
    plan = check_budget(model_dir, EngineConfig(max_resident_mb=budget_mb(model_dir)))
    assert expert_bytes(model_dir) >= 4 * plan.budget - MiB
    assert expert_bytes(model_dir) >= 4 * plan.capacity        # the cache holds < 1/4
    assert plan.capacity_experts >= plan.top_k


@pytest.mark.parametrize("load_mode", ["mmap", "copy"])
def test_budget_holds(model_dir, reference, load_mode):
    gc.collect()
    files = expert_files(model_dir)
    budget = budget_mb(model_dir)
    cfg = EngineConfig(max_resident_mb=budget, load_mode=load_mode)
    before = proc_memory()
    can_reset = _reset_peak_rss()
    with Engine(model_dir, cfg) as eng:
        res = eng.model.residency
        assert sum(file_cache_bytes(f) for f in files) == 0      # starts from nothing cached
        probe = Sampler(files)
        probe.res = res
        eng.register_plugin(probe, name="probe")
        toks = run(eng)
        rep = eng.memory_report()
        after = proc_memory()
    assert toks == reference[0]
    assert probe.samples > 20
    # the expert files' page cache (mapped or not) never exceeds the cache's capacity by
    # more than one expert per I/O thread: each load job drops its evicted experts' pages
    # before it reads, but with n threads, n-1 other jobs may have read before this one
    # dropped, and the sampler's mincore sum over the files is not one instant either (a
    # file counted before its drop, another after its load: seen on a loaded CI machine)
    one_expert = max(f.stat().st_size for f in files)
    slack = cfg.residency.io_threads * one_expert
    assert probe.peak <= res.capacity + slack, (probe.peak, res.capacity, slack)
    assert probe.peak_used <= res.capacity and rep["expert_cache_peak"] <= res.capacity
    if load_mode == "copy":
        assert probe.peak == 0                                   # O_DIRECT or dropped
        assert rep["frames"] * rep["frame_bytes"] <= res.capacity
    else:
        assert probe.peak > 0
    assert rep["misses"] > 0 and rep["evictions"] > 0
    # RSS growth over the whole run, peak included, stays under the budget (the Python
    # objects of an engine get 2 MB of slack)
    if can_reset:
        grew = after["VmHWM"] - before["VmRSS"]
        assert grew <= budget * MiB + 2 * MiB, (grew / MiB, budget)
    # model footprint: page cache of every model file + private memory gained
    footprint = sum(rep["page_cache"].values()) + max(0, rep["anon_growth"])
    assert footprint <= budget * MiB + 2 * MiB, (footprint / MiB, budget)


def test_unbudgeted_run_is_larger(model_dir):
    """The same measurement without a budget (control for the test above)."""
    gc.collect()
    before = proc_memory()
    if not _reset_peak_rss():
        pytest.skip("cannot reset the peak RSS here")
    with Engine(model_dir, EngineConfig(prefetch="populate")) as eng:
        run(eng)
        after = proc_memory()
    gc.collect()
    assert after["VmHWM"] - before["VmRSS"] > 2 * budget_mb(model_dir) * MiB


@pytest.mark.parametrize("settings", [
    dict(load_mode="mmap"),
    dict(load_mode="mmap", residency=ResidencyConfig(policy="lru", speculative=True)),
    dict(load_mode="copy", residency=ResidencyConfig(speculative=True, debug_poison=True)),
])
def test_bit_identical_to_unbudgeted(model_dir, reference, settings):
    toks, short, logits, long_logits = reference
    with Engine(model_dir, EngineConfig(max_resident_mb=budget_mb(model_dir), **settings)) as eng:
        assert run(eng) == toks
        got = eng.next_token_logits(short, all_positions=True)
        assert np.array_equal(got, logits)
        # a prompt longer than the budget's prefill chunk runs in chunks: same argmax,
        # logits equal up to float reassociation in the chunked attention
        got_long = eng.next_token_logits(PROMPT, all_positions=True)
        assert eng.model.residency.chunk_tokens < len(PROMPT)
        np.testing.assert_allclose(got_long, long_logits, rtol=1e-4, atol=1e-4)
        assert np.array_equal(got_long.argmax(-1), long_logits.argmax(-1))
        rep = eng.memory_report(page_cache=False)
        if settings.get("residency") and settings["residency"].speculative:
            assert rep["speculation"]["guessed"] > 0


def test_smallest_budget_copy_poison_never_frees_a_pinned_expert(model_dir):
    """The smallest budget that runs (the cache holds a single token's experts, so every
    prefill layer runs in waves and every token evicts); evicted frames are overwritten with
    NaN: a view still in use would make the logits NaN or different."""
    plan = check_budget(model_dir, EngineConfig(max_resident_mb=1000))
    smallest = np.ceil(plan.minimum / MiB * 10) / 10
    cfg = EngineConfig(max_resident_mb=smallest, load_mode="copy",
                       residency=ResidencyConfig(debug_poison=True, speculative=True))
    prompt = PROMPT[:12]
    with Engine(model_dir, EngineConfig()) as ref:
        want_toks = run(ref, prompt, 6)
        want = ref.next_token_logits(prompt, all_positions=True)
    with Engine(model_dir, cfg) as eng:
        res = eng.model.residency
        assert res.n_frames < 2 * plan.top_k + 2
        assert run(eng, prompt, 6) == want_toks
        got = eng.next_token_logits(prompt, all_positions=True)
        rep = eng.memory_report(page_cache=False)
    assert rep["evictions"] > 50
    assert np.isfinite(got).all()
    # prefilled one token per forward here (chunk 1): equal up to float reassociation
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_pinned_experts_are_never_evicted(model_dir):
    cfg = EngineConfig(max_resident_mb=budget_mb(model_dir), load_mode="copy",
                       residency=ResidencyConfig(debug_poison=True))
    with Engine(model_dir, cfg) as eng:
        res, es = eng.model.residency, eng.model.expert_set
        L1, L2 = eng.model_cfg.moe_layers[:2]
        full = np.arange(res.n_frames)
        run1 = res.acquire(L1, full, es.experts[L1])            # fills every frame, pinned
        ffns = [run1[e].ffn for e in full]
        snap = [f.w2.scales.copy() for f in ffns]
        with pytest.raises(RuntimeError, match="pinned"):
            res.acquire(L2, np.array([0]), es.experts[L2])       # no room: refused, not evicted
        assert all(np.array_equal(f.w2.scales, s) for f, s in zip(ffns, snap))
        res.release(L1, full)
        run2 = res.acquire(L2, np.array([0]), es.experts[L2])    # now one of L1's goes
        assert np.isfinite(run2[0].ffn.w2.scales).all()
        res.release(L2, np.array([0]))
        changed = [f for f, s in zip(ffns, snap) if not np.array_equal(f.w2.scales, s)]
        assert len(changed) == 1                  # the evicted one: its frame holds L2's now


def test_too_small_budget_refused_with_minimum(model_dir):
    plan = check_budget(model_dir, EngineConfig(max_resident_mb=1000))
    need = np.ceil(plan.minimum / MiB * 10) / 10
    with pytest.raises(ConfigError) as ei:
        Engine(model_dir, EngineConfig(max_resident_mb=need - 0.5))
    msg = str(ei.value)
    assert "\n" not in msg and f"at least {need:.1f} MB" in msg and "max_resident_mb" in msg
    with Engine(model_dir, EngineConfig(max_resident_mb=need, load_mode="copy")) as eng:
        assert len(run(eng, PROMPT[:6], n=2)) == 2


def test_hot_plugged_expert_runs_outside_the_budget(model_dir, reference):
    """A hot-plugged expert (no file) passes through the cache untouched."""
    class Hot:
        layers = [1]
        q4 = None
        router_bias = 50.0                    # always routed
        name, sha256 = "hot", "0" * 64

        def __init__(self, slot, hidden):
            self.slot = slot
            self.router_row = np.zeros(hidden, np.float32)
            self.calls = 0

        def forward(self, x, y):
            self.calls += 1
            y[...] = 0.0

    with Engine(model_dir, EngineConfig(max_resident_mb=budget_mb(model_dir))) as eng:
        hot = Hot(eng.model_cfg.num_experts, eng.model_cfg.hidden_size)
        eng.queue_expert_change(lambda es: es.with_expert(hot))
        toks = run(eng, n=3)
        assert hot.calls > 0 and len(toks) == 3
        assert all(key[1] < eng.model_cfg.num_experts for key in eng.model.residency.entries)
        assert eng.memory_report(page_cache=False)["hot_plugged_bytes"] == 0   # no INT4 weights


def test_cli_reports_memory(model_dir):
    from colibri_core.config import builtin_model_dir
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--prompt", "The assert",
                        "-n", "6", "--temperature", "0", "--max-resident-mb", "7",
                        "--speculative"], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stderr.splitlines() if l.startswith("colibri: memory:")]
    assert line and "budget 7 MB" in line[0] and "hit rate" in line[0] and "MB/token" in line[0]
    r = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--model", str(model_dir),
                        "--max-resident-mb", "1"], capture_output=True, text=True, timeout=120,
                       cwd="/")
    assert r.returncode == 2 and "too small" in r.stderr and "at least" in r.stderr


def test_preload_brings_the_model_in_at_load(model_dir):
    """EngineConfig.preload (no budget): "populate" returns with every model file in the
    page cache (mincore), "willneed" has them there once its background thread is done,
    "none" leaves the files where they were (dropped: nothing)."""
    from colibri_core.memstat import drop_file_cache
    files = sorted(model_dir.glob("*.bin"))
    total = sum(f.stat().st_size for f in files)
    for mode in ("none", "populate", "willneed"):
        gc.collect()
        for f in files:
            drop_file_cache(f, sync=True)
        with Engine(model_dir, EngineConfig(preload=mode)) as eng:
            if mode == "willneed":
                eng.model.residency.wait_preload()
            cached = sum(file_cache_bytes(f) for f in files)
            if mode != "none":
                assert cached >= total - 4096 * len(files), (cached, total)
                assert all(eng.model.residency.all_prefetched(L) for L in eng.model_cfg.moe_layers)
            else:
                assert cached < total / 4, (cached, total)   # section tables and headers only
