"""The decode fast path (decode.py + ck_decode.c) against the general path (model.forward),
which the parity tests hold against numpy float64 and transformers.

Both paths use the same int8 tiles and fixed-point routing; they differ only in the float
rounding of norms, rope and router dot products, so logits agree to ~1e-6 (a routing or
int8 rounding flip would show as a much larger error: the bound catches it)."""
import gc
import tracemalloc

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.hookspecs import hookimpl
from colibri_core.kernels import ffi, lib
from colibri_core.routing import _EXP2_TABLE, route
from colibri_core.testing import write_random_model

SHAPES = {
    # dense + MoE with a gated shared expert; hidden 192: partial last group
    "mixed_shared_odd": dict(hidden=192, layers=("dense", "moe", "moe"), experts=6, top_k=2,
                             inter=320, moe_inter=160, shared=96, heads=4, kv_heads=2),
    # group 64, one kv head (MQA), top-3, no shared expert
    "g64_mqa_k3": dict(hidden=128, layers=("moe", "moe"), experts=5, top_k=3, inter=128,
                       moe_inter=192, shared=0, heads=4, kv_heads=1, group=64),
    "dense_only": dict(hidden=256, layers=("dense", "dense"), inter=384, heads=8, kv_heads=8),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for i, (name, kw) in enumerate(SHAPES.items()):
        d = tmp_path_factory.mktemp(name) / "m"
        write_random_model(d, seed=10 + i, vocab=300, context=96, **kw)
        out[name] = d
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def clone(m, c):
    n = m.new_cache(c.capacity)
    n.k[:], n.v[:], n.length = c.k, c.v, c.length
    return n


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", K.available_backends())
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_step_matches_forward(models, shape, backend, threads):
    """Each step runs both paths from the same cache. The paths agree to ~1e-7 except
    where that difference flips the rounding of an int8 activation (one quantum, ~1e-3
    of the logits): rare, so at most a few steps may show it."""
    K.set_backend(backend)
    K._set_parallel_threshold(0)          # these small layers too run on every thread
    try:
        with Engine(models[shape], EngineConfig(threads=threads)) as eng:
            m = eng.model
            assert not isinstance(m.decode_plan(), str), m.decode_plan()
            prompt = np.random.default_rng(1).integers(0, 299, 7)
            ref = m.new_cache(96)
            m.forward([prompt], [ref])
            tok, errs = 5, []
            ks = [m.cfg.top_k or 1] * 14 + ([1, m.cfg.num_experts] if m.cfg.moe_layers else [])
            for k in ks:
                fast = clone(m, ref)
                a = m.decode_step(tok, fast, k).copy()
                fast_routing = [(t.layer, t.routing.ids.tolist(), t.routing.weights) for t in m.last_routing]
                b = m.forward([np.array([tok])], [ref], [k])[0]
                errs.append(rel(a, b))
                assert fast.length == ref.length
                if errs[-1] < 1e-5:          # no flip: the routing and the KV rows agree
                    for (la, ia, wa), t in zip(fast_routing, m.last_routing):
                        assert la == t.layer and ia == t.routing.ids.tolist()
                        np.testing.assert_allclose(wa, t.routing.weights, rtol=1e-6)
                    p = ref.length - 1
                    np.testing.assert_allclose(fast.k[:, p], ref.k[:, p], rtol=1e-5, atol=1e-5)
                    np.testing.assert_allclose(fast.v[:, p], ref.v[:, p], rtol=1e-5, atol=1e-5)
                tok = int(np.argmax(b))
            assert max(errs) < 0.05, errs
            assert sum(e < 1e-5 for e in errs) >= len(errs) - 3, errs
    finally:
        K.set_backend("auto")
        K._set_parallel_threshold(-1)


def test_generation_uses_the_fast_path_and_matches(models):
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig()) as fast, Engine(d, EngineConfig(fast_decode=False)) as slow:
        assert fast.model.decode_plan().__class__.__name__ == "DecodePlan"
        assert slow.model.decode_plan() == "fast_decode is off"
        a = fast.generate([3, 4, 5], max_new_tokens=20, temperature=0).run().token_ids
        b = slow.generate([3, 4, 5], max_new_tokens=20, temperature=0).run().token_ids
        assert a == b


class LayerWatcher:
    def __init__(self):
        self.layers = 0

    @hookimpl
    def colibri_after_layer(self, layer, hidden):
        self.layers += 1


class ForceExpert:
    """A routing override: every token of every MoE layer goes to experts (0, 1)."""

    @hookimpl
    def colibri_routing(self, layer, expert_ids, weights):
        ids = np.zeros_like(expert_ids)
        ids[:, 1:] = 1
        return ids, np.full_like(weights, 1.0 / expert_ids.shape[1])


def test_routing_hooks_run_in_the_fast_path(models):
    """The metrics plugin (a routing observer) and a routing override keep the fast path
    and see / do what they do in the general path."""
    from colibri_core.builtin_plugins.metrics import Metrics
    d = models["mixed_shared_odd"]
    counts, toks = {}, {}
    for fast in (True, False):
        with Engine(d, EngineConfig(fast_decode=fast)) as eng:
            m = Metrics()
            eng.register_plugin(m, name="metrics")
            assert isinstance(eng.model.decode_plan(), str) != fast
            toks[fast] = eng.generate([5, 6, 7], max_new_tokens=12, temperature=0).run().token_ids
            counts[fast] = {L: c.tolist() for L, c in m.last.expert_counts.items()}
    assert toks[True] == toks[False] and counts[True] == counts[False]
    assert sum(sum(c) for c in counts[True].values()) == 2 * 2 * (3 + 11)   # 2 layers, k=2
    forced = {}
    for fast in (True, False):
        with Engine(d, EngineConfig(fast_decode=fast)) as eng:
            eng.register_plugin(ForceExpert(), name="force")
            m = eng.model
            c = m.new_cache(16)
            m.forward([np.array([3, 4])], [c])
            forced[fast] = m.decode_step(9, c, 2).copy()
            assert all(t.routing.ids.tolist() == [[0, 1]] for t in m.last_routing)
    assert rel(forced[True], forced[False]) < 1e-5


def test_per_layer_hooks_and_settings_take_the_general_path(models, tmp_path):
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig()) as eng:
        w = LayerWatcher()
        eng.register_plugin(w, name="watch")
        assert "per-layer hook" in eng.model.decode_plan()
        eng.generate([1, 2], max_new_tokens=3, temperature=0).run()
        assert w.layers == 3 * 3                 # prefill + 2 decode steps, 3 layers each
    for cfg, why in [(EngineConfig(activations="float"), "float activations"),
                     (EngineConfig(routing="float"), "float routing"),
                     (EngineConfig(max_resident_mb=64), "memory budget")]:
        with Engine(d, cfg) as eng:
            assert why in eng.model.decode_plan()


def test_decode_step_errors(models):
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        m = eng.model
        c = m.new_cache(8)
        m.forward([np.array([1, 2])], [c])
        with pytest.raises(RequestError, match="token id 300 out of range"):
            m.decode_step(300, c, 2)
        with pytest.raises(RequestError, match="top_k=7 out of range"):
            m.decode_step(1, c, 7)
        for _ in range(6):
            m.decode_step(1, c, 2)
        with pytest.raises(RequestError, match="cache holds 8"):
            m.decode_step(1, c, 2)
        assert c.length == 8


def test_decode_allocates_nothing_per_token(tmp_path):
    """tracemalloc sees every numpy buffer and Python object: the peak traced memory of
    many decode steps stays below one activation vector (a per-token numpy temporary of
    the hidden size, the logits or the KV rows would exceed it)."""
    d = tmp_path / "m"
    write_random_model(d, seed=3, vocab=300, context=96, hidden=512, layers=("dense", "moe"),
                       experts=4, top_k=2, inter=256, moe_inter=256, shared=128, heads=8,
                       kv_heads=2)
    with Engine(d, EngineConfig()) as eng:
        m = eng.model
        c = m.new_cache(96)
        m.forward([np.arange(1, 9)], [c])
        hidden_bytes = m.cfg.hidden_size * 4
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            tok = 3
            for _ in range(5):      # plan built, scratch sized, cffi's first-call caches
                tok = int(m.decode_step(tok, c, 2).argmax())
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(40):
                tok = int(m.decode_step(tok, c, 2).argmax())
            cur, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            gc.enable()
        assert peak - base < hidden_bytes // 2, (peak - base, hidden_bytes)
        assert cur - base < 256, cur - base


def _route_c(logits, k, norm, scaling, bias=None):
    """ck_decode_route on `logits` exactly: xn = logits padded, router = identity."""
    E = len(logits)
    H = E + 3
    xn = np.zeros(H, np.float32)
    xn[:E] = logits
    router = np.zeros((E, H), np.float32)
    router[np.arange(E), np.arange(E)] = 1.0
    out_l = np.zeros(E, np.float32)
    ids = np.zeros(k, np.int64)
    w = np.zeros(k, np.float32)
    b = ffi.NULL if bias is None else ffi.cast("float *", ffi.from_buffer(bias))
    exp2 = np.ascontiguousarray(_EXP2_TABLE, np.int64)
    r = ffi.new("ck_router *", {"weight": ffi.cast("float *", ffi.from_buffer(router)), "bias": b,
                                "e": E, "h": H, "norm_topk": norm, "scaling": scaling,
                                "exp2_q30": ffi.cast("int64_t *", ffi.from_buffer(exp2))})
    rc = lib.ck_decode_route(r, ffi.cast("float *", ffi.from_buffer(xn)), k,
                             ffi.cast("float *", ffi.from_buffer(out_l)),
                             ffi.cast("int64_t *", ffi.from_buffer(ids)),
                             ffi.cast("float *", ffi.from_buffer(w)))
    return rc, ids, w


@pytest.mark.parametrize("seed", range(40))
def test_c_router_equals_python_router(seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(2, 70))
    k = int(rng.integers(1, min(E, 9) + 1))
    logits = (rng.standard_normal(E) * rng.choice([0.1, 3.0, 40.0])).astype(np.float32)
    if seed % 5 == 0:                                   # ties resolve to the lower index
        logits[rng.integers(0, E, 3)] = logits.max()
    bias = (rng.standard_normal(E).astype(np.float32) if seed % 3 == 0 else None)
    norm, scaling = bool(seed % 2), float(rng.choice([1.0, 2.5]))
    rc, ids, w = _route_c(logits, k, norm, scaling, bias)
    assert rc == 0
    ref = route((logits + (bias if bias is not None else 0))[None, :].astype(np.float32),
                np.array([k]), mode="fixed", norm_topk_prob=norm, scaling=scaling)
    assert ids.tolist() == ref.ids[0].tolist()
    assert w.tolist() == ref.weights[0].tolist()          # bit for bit


def test_c_router_refuses_nonfinite_logits():
    logits = np.array([0.5, np.nan, 1.0], np.float32)
    assert _route_c(logits, 2, True, 1.0)[0] == lib.CK_E_NONFINITE


@pytest.mark.parametrize("n,nth", [(1, 2), (2, 2), (3, 2), (97, 2), (1000, 2), (50, 5)])
def test_pool_runs_every_chunk_exactly_once(n, nth):
    """The decode path's work-stealing loops (ck_pool.c): every chunk once per loop, over
    many back-to-back loops (where a late thread must never run a newer loop's chunk with
    an older loop's function), with more threads than chunks too."""
    assert lib.ck_pool_check(n, nth, 300) == 0


class _Scratch:
    threads = 0


class ScriptedControl:
    """decode.ThreadControl fed scripted pool statistics instead of the pool's."""

    def __init__(self):
        from colibri_core.decode import ThreadControl
        self.c = ThreadControl(_Scratch())
        self.c.read_stats = lambda: None

    def step(self, others_share: float, wait_frac: float = 0.0) -> int:
        """One step with the given share of chunks run by other threads; returns the cap
        the next step runs under (0: all threads)."""
        if self.c.s.threads == 1:
            self.c.stats[:] = 0                  # a single-threaded step: no pool loops
        else:
            self.c.stats[:] = [round(100 * (1 - others_share)), round(100 * others_share),
                               1000, round(1000 * wait_frac)]
        self.c.after_step()
        return self.c.s.threads


def test_thread_control_falls_back_and_probes_with_backoff():
    t = ScriptedControl()
    assert [t.step(0.5) for _ in range(20)] == [0] * 20          # healthy: never capped
    assert [t.step(0.45, wait_frac=0.5) for _ in range(3)] == [0, 0, 1]   # caller waits
    assert [t.step(0.0) for _ in range(4)] == [1, 1, 1, 0]       # 4 steps alone, then probe
    assert t.step(0.05) == 1                                     # failed probe: back off
    assert [t.step(0.0) for _ in range(8)] == [1] * 7 + [0]      # ... for 8 steps
    assert t.step(0.5) == 0                                      # a good probe: stay
    assert [t.step(0.5) for _ in range(10)] == [0] * 10
    assert [t.step(0.1) for _ in range(3)] == [0, 0, 1]          # backoff restarted at 4
    assert [t.step(0.0) for _ in range(4)] == [1, 1, 1, 0]
    # two bad steps then a good one: a short hiccup is not enough
    t2 = ScriptedControl()
    assert [t2.step(s) for s in (0.1, 0.1, 0.5, 0.1, 0.1, 0.5)] == [0] * 6
    assert t.c.single_steps >= 15 and t2.c.single_steps == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unquantized_embedding_rows(models, dtype):
    """An embedding kept at 16/32 bits (`--embed-bits 16|32`) is read through the model's
    own row conversion (bf16 sections are uint16: widened, not cast)."""
    from colibri_core.quant import dequantize_q4
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        m = eng.model
        e = dequantize_q4(m.w.embed).astype(np.float32)
        if dtype == "bfloat16":
            e = (e.view(np.uint32) >> 16).astype(np.uint16)     # truncated to bf16 bits
        m.w.embed = e
        m.drop_decode_plans()
        ref = m.new_cache(16)
        m.forward([np.array([3, 4])], [ref])
        fast = clone(m, ref)
        a = m.decode_step(7, fast, 2).copy()
        b = m.forward([np.array([7])], [ref], [2])[0]
        assert rel(a, b) < 1e-5
