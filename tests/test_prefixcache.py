"""Automatic prefix caching (runtime/prefixcache.py): a request whose prompt starts with
the tokens of an ended one copies their KV rows instead of computing them, and gets the
same logits, bit for bit, as an engine without the cache (the reference here: the same
model with prefix_cache_mb=0), on the built-in model (f32 and q8 rows, speculative
decoding) and on random tiny Hugging Face models (grouped-query attention, and MLA's
latent cache); never across an expert-set change, another k or while a routing hook is
registered; evicted least recently used within its cap; counted in /metrics."""
import numpy as np
import pytest

from colibri_core.config import EngineConfig, builtin_model_dir
from colibri_core.engine import Engine
from colibri_core.hookspecs import hookimpl
from colibri_core.model.kvcache import kv_bytes_per_position
from colibri_core.runtime.prefixcache import BLOCK

ON = dict(prefix_cache_mb=8)


def run(eng, prompt, n=4, **kw):
    """Greedy tokens and every step's logits (copied), stop reason."""
    logits = []

    def pick(row):
        logits.append(np.array(row, copy=True))
        return int(np.argmax(row))
    g = eng.generate(prompt, max_new_tokens=n, sampler=pick, **kw).run()
    return g.token_ids, logits, g.stop_reason


def same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and \
        all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def rows_kept(prompt, out) -> int:
    """Rows a generation leaves: its prompt and the tokens fed after it (the last sampled
    token is fed only when it did not end the sequence by length)."""
    toks, _, why = out
    return len(prompt) + (len(toks) if why == "eos" else len(toks) - 1)


def reusable(kept: int, prompt_len: int) -> int:
    """Tokens a prompt reuses from a kept run of `kept` matching rows: whole blocks, and
    at least its last token computed."""
    return min(kept // BLOCK, (prompt_len - 1) // BLOCK) * BLOCK


def engines(model=None, **kw):
    model = model or builtin_model_dir()
    return Engine(model, EngineConfig(**ON, **kw)), Engine(model, EngineConfig(**kw))


@pytest.mark.parametrize("kv_dtype", ["f32", "q8"])
def test_shared_prefix_and_multi_turn_are_bit_identical(kv_dtype):
    cached, plain = engines(kv_dtype=kv_dtype)
    with cached, plain:
        V = cached.model_cfg.vocab_size
        rng = np.random.default_rng(1)
        system = rng.integers(1, V, 50).tolist()
        expect = 0
        for i in range(4):                               # one system prompt, four users
            p = system + rng.integers(1, V, 6).tolist()
            got = run(cached, p)
            assert same(got, run(plain, p)), i
            expect += 0 if i == 0 else reusable(len(system), len(p))
        st = cached.scheduler.prefix.stats()
        assert (st["hits"], st["misses"], st["reused_tokens"]) == (3, 1, expect)
        p = rng.integers(1, V, 37).tolist()                 # a chat: each turn extends it
        for turn in range(4):
            before = cached.scheduler.prefix.stats()["reused_tokens"]
            got = run(cached, p, n=5)
            assert same(got, run(plain, p, n=5)), turn
            reused = cached.scheduler.prefix.stats()["reused_tokens"] - before
            assert reused == (0 if turn == 0 else reusable(kept, len(p))), turn
            kept = rows_kept(p, got)
            p = p + got[0] + rng.integers(1, V, 11).tolist()   # the reply, then the user
        assert cached.scheduler.prefix.bytes <= cached.scheduler.prefix.capacity_bytes


def test_speculative_decoding_keeps_only_accepted_rows():
    """With drafts rejected (their rows cut back), what is kept are the emitted tokens'
    rows: a following turn reuses them and still matches plain decoding."""
    spec = dict(speculative_decoding="prompt_lookup", draft_tokens=4)
    cached, plain = engines(**spec)
    with cached, plain:
        p = [5, 9, 14, 5, 9, 14, 5, 9, 14, 7, 5, 9] * 4
        for turn in range(3):
            before = cached.scheduler.prefix.stats()["reused_tokens"] if turn else 0
            got = run(cached, p, n=40)
            assert same(got, run(plain, p, n=40)), turn
            reused = cached.scheduler.prefix.stats()["reused_tokens"] - before
            assert reused == (0 if turn == 0 else reusable(kept, len(p))), turn
            kept = rows_kept(p, got)
            p = p + got[0] + [3, 5, 9, 14, 5, 9]
        assert cached.scheduler.prefix.stats()["hits"] == 2
        assert cached.generate(p, max_new_tokens=40).run().speculation["drafted"] > 0


class Hot:
    """A hot-plugged expert always routed to (its router bias), adding nothing: a new
    expert set whose logits differ from the old one's."""
    q4 = None
    router_bias = 50.0
    name, sha256 = "hot", "0" * 64

    def __init__(self, cfg):
        self.layers = [cfg.moe_layers[0]]
        self.slot = cfg.num_experts
        self.router_row = np.zeros(cfg.hidden_size, np.float32)

    def forward(self, x, y):
        y[...] = 0.0


def test_an_expert_set_change_is_never_served_old_rows():
    cached, plain = engines()
    with cached, plain:
        p = list(range(3, 60))
        old = run(cached, p)
        assert same(run(cached, p), old)                  # a hit under the same set
        assert cached.scheduler.prefix.stats()["hits"] == 1
        for eng in (cached, plain):
            eng.queue_expert_change(lambda es: es.with_expert(Hot(eng.model_cfg)))
            eng.apply_expert_changes()
        new = run(cached, p)
        assert not same(new, old)                         # the old rows would be wrong
        assert same(new, run(plain, p))
        st = cached.scheduler.prefix.stats()
        assert (st["hits"], st["misses"]) == (1, 2)       # looked, found nothing
        assert same(run(cached, p), new)                  # ... then kept under the new set
        assert cached.scheduler.prefix.stats()["hits"] == 2


def test_another_k_misses_and_a_routing_hook_turns_it_off():
    cached, plain = engines()
    with cached, plain:
        p = list(range(3, 40))
        run(cached, p, experts_per_token=1)
        got = run(cached, p)                              # the model's k: other rows
        assert same(got, run(plain, p))
        assert cached.scheduler.prefix.stats()["hits"] == 0
        assert same(run(cached, p, experts_per_token=1), run(plain, p, experts_per_token=1))
        assert cached.scheduler.prefix.stats()["hits"] == 1

        class Observer:
            @hookimpl
            def colibri_routing(self, layer, expert_ids, weights, scores, logits):
                self.seen = self.seen + len(expert_ids)

            seen = 0
        obs = Observer()
        cached.register_plugin(obs, "observer")
        before = cached.scheduler.prefix.stats()
        run(cached, p)
        assert cached.scheduler.prefix.stats() == before  # neither used nor looked up
        assert obs.seen >= len(p)                         # it saw every prompt row
        cached.pm.unregister(obs)
        run(cached, p)
        assert cached.scheduler.prefix.stats()["hits"] == 2


def test_least_recently_used_blocks_go_within_the_cap():
    model = builtin_model_dir()
    with Engine(model, EngineConfig()) as plain:
        block = kv_bytes_per_position(plain.model_cfg, "f32") * BLOCK
        mb = 5 * block / 2**20                            # five blocks
        with Engine(model, EngineConfig(prefix_cache_mb=mb)) as cached:
            a, b = list(range(3, 70)), list(range(100, 167))   # four blocks kept each
            run(cached, a)
            pc = cached.scheduler.prefix
            assert pc.stats()["blocks"] == 4 and pc.bytes == 4 * block
            run(cached, b)                                # a's oldest (leaf first) go
            st = pc.stats()
            assert st["blocks"] == 5 and st["evictions"] == 3 and pc.bytes <= pc.capacity_bytes
            for p, blocks in ((b, 4), (a, 1)):            # b whole, a's first block only
                before = pc.stats()["reused_tokens"]
                assert same(run(cached, p), run(plain, p))
                assert pc.stats()["reused_tokens"] - before == blocks * BLOCK
            assert pc.evict_bytes(1) >= block and pc.bytes <= 4 * block
            pc.clear()
            assert pc.stats()["blocks"] == 0 and pc.bytes == 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_random_hf_models(tmp_path, family):
    """Converted random checkpoints: grouped-query attention with a shared expert, and
    DeepSeek-V3's MLA (its latent cache's rows are what is kept)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri_core.convert import convert
    from hf_helpers import make_hf_model, save
    save(make_hf_model(family, seed=3), tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "out", bits=4)
    cached, plain = engines(tmp_path / "out")
    with cached, plain:
        rng = np.random.default_rng(2)
        system = rng.integers(1, 300, 40).tolist()
        for i in range(3):
            p = system + rng.integers(1, 300, 5).tolist()
            assert same(run(cached, p), run(plain, p)), i
        assert cached.scheduler.prefix.stats()["reused_tokens"] == 2 * reusable(40, 45)


def test_server_on_by_default_with_metrics(tmp_path):
    """`colibri serve`: on at 256 MB unless told (or a memory limit in the config), and
    its hits, misses and reused tokens in /metrics and /status.json."""
    import argparse

    import httpx

    from colibri_core.errors import ConfigError
    from colibri_core.server import add_arguments
    from colibri_core.server.serve import resolve
    from server_helpers import LiveServer, metric

    def engine_cfg(*argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return resolve(p.parse_args(list(argv)))[1]
    assert engine_cfg().prefix_cache_mb == 256
    assert engine_cfg("--prefix-cache-mb", "0").prefix_cache_mb == 0
    assert engine_cfg("--config", "small-256mb").prefix_cache_mb == 0     # a process limit
    with pytest.raises(ConfigError, match="--prefix-cache-mb -1"):
        engine_cfg("--prefix-cache-mb", "-1")

    srv = LiveServer(experts_dir=tmp_path)
    try:
        prompt = list(range(3, 73))
        answers = [httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 3, "temperature": 0}).json() for _ in range(2)]
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        assert metric(text, "colibri_prefix_cache_hits_total") == 1
        assert metric(text, "colibri_prefix_cache_misses_total") == 1
        assert metric(text, "colibri_prefix_cache_reused_tokens_total") == 64
        assert metric(text, "colibri_prefix_cache_capacity_bytes") == 256 * 2**20
        st = httpx.get(srv.url + "/status.json", timeout=10).json()["prefix_cache"]
        assert st["hits"] == 1 and 0 < st["bytes"] <= st["capacity_bytes"]
    finally:
        srv.stop()


def test_counted_in_the_pool_size_the_budget_and_the_memory_check(monkeypatch):
    from colibri_core import memstat
    from colibri_core.config import load_model_config
    from colibri_core.errors import InsufficientMemoryError
    from colibri_core.experts.residency import check_budget
    from colibri_core.model import kvcache
    model = builtin_model_dir()
    cfg = load_model_config(model / "config.json")
    per = kv_bytes_per_position(cfg, "f32")
    avail = kvcache.model_bytes(cfg) + 2 * per * 9000        # 9,000 positions' worth
    plain = kvcache.kv_pool_tokens(cfg, EngineConfig(), available=avail)
    kept = kvcache.kv_pool_tokens(cfg, EngineConfig(prefix_cache_mb=2 * per * 1000 / 2**20),
                                  available=avail)
    assert (plain, kept) == (9000, 8000)                  # its cap set aside first
    big = dict(max_resident_mb=4096, kv_pool_tokens=256)
    grow = check_budget(model, EngineConfig(**big, prefix_cache_mb=10)).minimum \
        - check_budget(model, EngineConfig(**big)).minimum
    assert grow == 10 * 2**20

    with Engine(model, EngineConfig(prefix_cache_mb=8)) as eng:
        run(eng, list(range(3, 70)))
        pc = eng.scheduler.prefix
        held = pc.bytes
        assert held == 4 * BLOCK * per
        monkeypatch.setattr(memstat, "available_bytes", lambda: 1000)
        kvcache.check_memory(held // 2, "a cache", pc.evict_bytes)     # room made first
        assert 0 < pc.bytes <= held // 2
        with pytest.raises(InsufficientMemoryError, match="a cache needs"):
            kvcache.check_memory(held * 4, "a cache", pc.evict_bytes)
        assert pc.bytes == 0                              # it gave all it had
