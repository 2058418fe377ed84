"""The one pipeline (pipeline.py + ck_step*.c) end to end: against the reference model
(reference.py, which the parity tests hold against numpy float64 and transformers), its
batch invariance (a sequence's logits alone, inside a batch, in chunks or token by token),
hooks, errors, allocation-free decode and thread control.

The C blocks and the reference blocks quantize activations to int8 the same way but
differ in the float rounding of norms, rope and attention, which can flip an int8
rounding: logits agree to ~1e-2 (a routing or layout bug shows as a far larger error)."""
import gc
import tracemalloc

import numpy as np
import pytest

from colibri_core import kernels as K
from colibri_core.config import EngineConfig
from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.hookspecs import hookimpl
from colibri_core.kernels import lib
from colibri_core.forward.pipeline import Pipeline
from colibri_core.forward.reference import ReferenceModel
from colibri_core.model.testing import write_random_model

SHAPES = {
    # dense + MoE with a gated shared expert; hidden 192: partial last group
    "mixed_shared_odd": dict(hidden=192, layers=("dense", "moe", "moe"), experts=6, top_k=2,
                             inter=320, moe_inter=160, shared=96, heads=4, kv_heads=2),
    # group 64, one kv head (MQA), top-3, no shared expert
    "g64_mqa_k3": dict(hidden=128, layers=("moe", "moe"), experts=5, top_k=3, inter=128,
                       moe_inter=192, shared=0, heads=4, kv_heads=1, group=64),
    "dense_only": dict(hidden=256, layers=("dense", "dense"), inter=384, heads=8, kv_heads=8),
    # the q6 format for the lm_head and the attention projections
    "q6_head_attn": dict(hidden=192, layers=("dense", "moe"), experts=4, top_k=2, inter=192,
                         moe_inter=128, shared=64, heads=4, kv_heads=2, head="q6", attn="q6"),
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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", K.available_backends())
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pipeline_matches_the_reference_model(models, shape, backend, threads):
    K.set_backend(backend)
    K._set_parallel_threshold(0)          # these small layers too run on every thread
    try:
        with Engine(models[shape], EngineConfig(threads=threads)) as eng:
            m = eng.model
            ref = ReferenceModel(m.w, eng.config)
            prompt = np.random.default_rng(1).integers(0, 299, 7)
            c, r = m.new_cache(96), ref.new_cache(96)
            a = m.forward([prompt], [c], all_logits=True)[0]
            b = ref.forward([prompt], [r], all_logits=True)[0]
            assert rel(a, b) < 0.03
            tok, errs = 5, []
            ks = [m.cfg.top_k or 1] * 14 + ([1, m.cfg.num_experts] if m.cfg.moe_layers else [])
            for k in ks:
                a = m.decode_step(tok, c, k).copy()
                b = ref.forward([np.array([tok])], [r], [k])[0]
                errs.append(rel(a, b))
                assert c.length == r.length
                tok = int(np.argmax(b))
            assert max(errs) < 0.03, errs
    finally:
        K.set_backend("auto")
        K._set_parallel_threshold(-1)


CONFIGS = {"plain": EngineConfig(), "budget": EngineConfig(max_resident_mb=64, residency={"kv_tokens": 1024}),
           "one thread": EngineConfig(threads=1)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_sequence_gets_the_same_logits_alone_batched_and_chunked(models, config):
    """Batch invariance end to end: sequence 0 decoded alone and among 5 others (of other
    lengths), and its prompt in one step, in chunks, or token by token."""
    rng = np.random.default_rng(4)
    with Engine(models["mixed_shared_odd"], CONFIGS[config]) as eng:
        m = eng.model
        prompts = [rng.integers(1, 299, 9 + 3 * i) for i in range(6)]
        solo, caches = m.new_cache(96), [m.new_cache(96) for _ in prompts]
        alone = [m.forward([prompts[0]], [solo])[0]]
        batch = [m.forward(prompts, caches)[0]]
        for step in range(8):
            tok = int(alone[-1].argmax())
            alone.append(m.forward([[tok]], [solo])[0])
            nxt = [tok] + [int(rng.integers(1, 299)) for _ in prompts[1:]]
            batch.append(m.forward([[t] for t in nxt], caches)[0])
        for a, b in zip(alone, batch):
            assert np.array_equal(a, b)
        p = prompts[5]
        whole = m.forward([p], [m.new_cache(96)], all_logits=True)[0]
        c = m.new_cache(96)
        parts = [m.forward([p[i:j]], [c], all_logits=True)[0]
                 for i, j in ((0, 4), (4, 5), (5, 17), (17, len(p)))]
        c1 = m.new_cache(96)
        singles = [m.forward([p[i:i + 1]], [c1], all_logits=True)[0] for i in range(len(p))]
        assert np.array_equal(whole, np.concatenate(parts))
        assert np.array_equal(whole, np.concatenate(singles))


def test_generation_is_the_same_with_a_budget_one_expert_short_of_the_model(models):
    """The expert cache holding every expert but about one (a budget that holds the whole
    model runs the plain path: test_whole_budget.py)."""
    from colibri_core.experts.residency import MiB, check_budget
    d = models["mixed_shared_odd"]
    mb, step = 64.0, check_budget(d, EngineConfig(max_resident_mb=64)).expert_bytes / 2 / MiB
    while check_budget(d, EngineConfig(max_resident_mb=mb)).holds_whole_model:
        mb -= step
    with Engine(d, EngineConfig()) as plain, Engine(d, EngineConfig(max_resident_mb=mb)) as budget:
        assert budget.model.residency.active
        a = plain.generate([3, 4, 5], max_new_tokens=20, temperature=0).run().token_ids
        b = budget.generate([3, 4, 5], max_new_tokens=20, temperature=0).run().token_ids
        assert a == b


@pytest.mark.parametrize("act", ["float", "int8"])
def test_float_activations_run_in_c_and_match_the_reference(models, act):
    """Float activations run the same C calls (the float tiles) as int8 ones; numpy is
    only the reference, built on first use."""
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig(activations=act, routing="float")) as eng:
        m = eng.model
        assert not hasattr(m.pipeline, "blocks")
        c = m.new_cache(16)
        a = m.forward([np.array([3, 4, 5])], [c])[0]
        a2 = m.decode_step(7, c, m.cfg.top_k).copy()
        assert "_ref" not in m.__dict__            # the reference model is the tests' only
        ref = ReferenceModel(m.w, eng.config)
        r = ref.new_cache(16)
        b = ref.forward([np.array([3, 4, 5])], [r])[0]
        b2 = ref.forward([np.array([7])], [r])[0]
        tol = 1e-4 if act == "float" else 0.03
        assert rel(a, b) < tol and rel(a2, b2) < tol


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


def test_routing_hooks_see_and_change_the_choice(models):
    """The metrics plugin (a routing observer) counts every routed token; a routing
    override (narrower: checked by PluginGuard.check_routing, the one place) is what the
    experts then run."""
    from colibri_core.builtin_plugins.metrics import Metrics
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig()) as eng:
        mt = Metrics()
        eng.register_plugin(mt, name="metrics")
        eng.generate([5, 6, 7], max_new_tokens=12, temperature=0).run()
        counts = {L: c.tolist() for L, c in mt.last.expert_counts.items()}
    assert sum(sum(c) for c in counts.values()) == 2 * 2 * (3 + 11)   # 2 layers, k=2
    with Engine(d, EngineConfig()) as eng:
        eng.register_plugin(ForceExpert(), name="force")
        m = eng.model
        c = m.new_cache(16)
        m.forward([np.array([3, 4])], [c])
        forced = m.decode_step(9, c, 2).copy()
        assert all(t.routing.ids.tolist() == [[0, 1]] for t in m.last_routing)
        c = m.new_cache(16)
        m.forward([np.array([3, 4])], [c])
    with Engine(d, EngineConfig()) as eng:
        m = eng.model
        c = m.new_cache(16)
        m.forward([np.array([3, 4])], [c])
        free = m.decode_step(9, c, 2).copy()
        assert any(t.routing.ids.tolist() != [[0, 1]] for t in m.last_routing)
    assert rel(forced, free) > 1e-3


def test_per_layer_hooks_run_between_the_c_calls(models):
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig()) as eng:
        w = LayerWatcher()
        eng.register_plugin(w, name="watch")
        eng.generate([1, 2], max_new_tokens=3, temperature=0).run()
        assert w.layers == 3 * 3                 # prefill + 2 decode steps, 3 layers each


def test_decode_step_errors(models):
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        m = eng.model
        c = m.new_cache(8)
        m.forward([np.array([1, 2])], [c])
        with pytest.raises(RequestError, match="token id 300 out of range"):
            m.decode_step(300, c, 2)
        with pytest.raises(RequestError, match="top_k=7 out of range 1..6"):
            m.decode_step(1, c, 7)
        for _ in range(6):
            m.decode_step(1, c, 2)
        with pytest.raises(RequestError, match="cache holds 8"):
            m.decode_step(1, c, 2)
        assert c.length == 8


@pytest.mark.parametrize("kv", ["f32", "f16", "q8"])
def test_decode_allocates_nothing_per_token(tmp_path, kv):
    """tracemalloc sees every numpy buffer and Python object: the peak traced memory of
    many decode steps stays below one activation vector (a per-token numpy temporary of
    the hidden size, the logits or the KV rows would exceed it), whatever the cache's
    storage type."""
    d = tmp_path / "m"
    write_random_model(d, seed=3, vocab=300, context=96, hidden=512, layers=("dense", "moe"),
                       experts=4, top_k=2, inter=256, moe_inter=256, shared=128, heads=8,
                       kv_heads=2)
    with Engine(d, EngineConfig()) as eng:
        m = eng.model
        c = m.new_cache(96, kv)
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


class _Scratch:
    threads = 0


class ScriptedControl:
    """steptables.ThreadControl fed scripted pool statistics instead of the pool's."""

    def __init__(self):
        from colibri_core.forward.steptables import ThreadControl
        self.c = ThreadControl(_Scratch())
        self.c.p_stats = K.ffi.cast("int64_t *", K.ffi.from_buffer(np.zeros(4, np.int64)))

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


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_unquantized_embedding_rows(models, dtype):
    """An embedding kept at 16/32 bits (`--embed-bits 16|32`) is read by the C row
    conversion (ck_mat_row; bf16 sections are uint16: widened, not cast), bit for bit as
    the reference's."""
    from colibri_core.format.quant import dequantize_q4
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        m = eng.model
        e = dequantize_q4(m.w.embed).astype(np.float32)
        if dtype == "bfloat16":
            e = (e.view(np.uint32) >> 16).astype(np.uint16)     # truncated to bf16 bits
        elif dtype == "float16":
            e = e.astype(np.float16)
        m.w.embed = e
        m.pipeline = Pipeline(m)                # as a model converted with --embed-bits 16
        assert m.pipeline.embed_mat.kind == {"float32": lib.CK_W_F32, "float16": lib.CK_W_F16,
                                             "bfloat16": lib.CK_W_BF16}[dtype]
        ref = ReferenceModel(m.w, eng.config)
        x = np.zeros((3, m.cfg.hidden_size), np.float32)
        m.pipeline._embed(np.array([3, 4, 7]), x)
        assert np.array_equal(x, ref._embed(np.array([3, 4, 7])))
        c, r = m.new_cache(16), ref.new_cache(16)
        a = m.forward([np.array([3, 4, 7])], [c])[0]
        b = ref.forward([np.array([3, 4, 7])], [r])[0]
        assert rel(a, b) < 0.03


@pytest.mark.parametrize("act", ["int8", "float"])
def test_an_expert_of_another_group_size_runs_in_c(models, act):
    """One C call quantizes a layer's input once for the experts of its group; an expert
    stored with another group size (a hot-plugged INT4 expert converted differently)
    quantizes its own rows inside the same call, and the layer's result matches the
    reference."""
    from types import SimpleNamespace

    from colibri_core.format.quant import dequantize_q4, quantize_q4
    from colibri_core.model.weights import FFNWeights
    with Engine(models["mixed_shared_odd"], EngineConfig(activations=act)) as eng:
        m = eng.model
        es = m.expert_set
        regroup = lambda t: quantize_q4(dequantize_q4(t).astype(np.float32), group=64)  # noqa: E731
        es.experts[1] = list(es.experts[1])
        for e in (0, 2, 4):                         # half the layer's experts
            old = es.experts[1][e]
            ffn = FFNWeights(regroup(old.ffn.w1), regroup(old.ffn.w3), regroup(old.ffn.w2))
            es.experts[1][e] = SimpleNamespace(layer=1, index=e, ffn=ffn, file=None,
                                               name=f"e1_{e}", address=0, nbytes=0)
        m.drop_tables()
        tables = m.pipeline.tables_for(es)
        assert tables.layers[1].table[2].w1.group == 64
        ref = ReferenceModel(m.w, eng.config)
        prompt = np.arange(3, 15)
        c, r = m.new_cache(16), ref.new_cache(16)
        a = m.forward([prompt], [c], all_logits=True)[0]
        b = ref.forward([prompt], [r], all_logits=True, expert_set=es)[0]
        assert rel(a, b) < (0.03 if act == "int8" else 1e-4)
        ids = next(t.routing.ids for t in m.last_routing if t.layer == 1)
        assert np.isin(ids, [0, 2, 4]).any() and np.isin(ids, [1, 3, 5]).any()


E2E = {"awq": ("awq", {}), "f16 weights, float activations": ("f16_float_act", {}),
       "bf16 weights": ("bf16", {}), "q8 FFNs": ("q8_ffn", {}), "q6 FFNs": ("q6_ffn", {}),
       "experts of two group sizes": ("expert_groups", {}),
       "copy-in experts, float activations": (None, dict(activations="float", max_resident_mb=64,
                                                          load_mode="copy"))}


@pytest.mark.parametrize("name", list(E2E))
def test_every_configuration_runs_the_c_pipeline_and_matches_the_reference(models, name):
    """The configurations that once ran numpy blocks at run time, end to end through the C
    calls: a prompt and decode steps against the reference model, and a sequence's logits
    alone and beside another (batch invariance)."""
    from pipeline_kernel_helpers import VARIANTS, assert_decodes_as_reference
    variant, over = E2E[name]
    kw, change = VARIANTS[variant] if variant else ({}, None)
    d = models["mixed_shared_odd"]
    with Engine(d, EngineConfig(routing="float", **kw, **over)) as eng, \
            Engine(d, EngineConfig(routing="float", **kw)) as mapped:
        m = eng.model
        if change is not None:
            change(m.w, np.random.default_rng(5))
            m.pipeline = Pipeline(m)
        # (copy-in: the reference reads the mapped weights of the same files)
        ref = ReferenceModel(mapped.model.w if over else m.w, eng.config)
        prompt = np.random.default_rng(2).integers(0, 299, 9)
        c, r, c2 = m.new_cache(32), ref.new_cache(32), m.new_cache(32)
        a = m.forward([prompt], [c], all_logits=True)[0]
        b = ref.forward([prompt], [r], all_logits=True)[0]
        floats = m.act == "float" or name == "bf16 weights"
        bound = 1e-4 if floats else 0.03
        assert rel(a, b) < bound
        m.forward([prompt[:4]], [c2])
        assert_decodes_as_reference(m, ref, prompt, c, r, b[-1], 4, bound)


def _gate_up_scales(w):
    f = w.layers[0].dense
    f.act_scales = {"w1": np.ones(f.w1.cols, np.float32), "w3": np.full(f.w1.cols, 2.0, np.float32)}


def _three_qkv_inputs(w):
    a = w.layers[1].attn
    a.act_scales = {n: np.full(a.wq.cols, v, np.float32) for n, v in (("wq", 1), ("wk", 2), ("wv", 3))}


@pytest.mark.parametrize("change,error", [
    (_gate_up_scales, "layer 0 dense FFN: act_scales w1 and w3 differ"),
    (_three_qkv_inputs, "layer 1: wq, wk, wv need more than two kinds of input")])
def test_what_the_c_calls_cannot_run_is_refused_at_load(models, change, error):
    """Rare layouts the C calls do not take are refused when the pipeline is made, with
    the field named, rather than run by another path."""
    from colibri_core.errors import ConfigError
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        change(eng.model.w)
        with pytest.raises(ConfigError, match=error):
            Pipeline(eng.model)


def test_an_expert_larger_than_the_models_grows_the_scratch(models):
    """A hot-plugged INT4 expert with a wider intermediate and a group size none of the
    model's matrices has: the new set's tables grow the step's scratch to it (between two
    steps), and the C call runs it."""
    from types import SimpleNamespace

    from colibri_core.format.quant import quantize_q4
    from colibri_core.model.weights import FFNWeights
    rng = np.random.default_rng(3)
    with Engine(models["mixed_shared_odd"], EngineConfig()) as eng:
        m = eng.model
        H, cp0, hld0 = m.cfg.hidden_size, m.pipeline.scratch.cp_max, m.pipeline.scratch.hld
        m.forward([np.array([1, 2])], [m.new_cache(16)])           # a step at the old size
        mat = lambda r, c: quantize_q4(rng.standard_normal((r, c)) / np.sqrt(c), 320)  # noqa: E731
        es = m.expert_set
        es.experts[1] = [SimpleNamespace(layer=1, index=e, ffn=FFNWeights(mat(448, H), mat(448, H),
                                                                          mat(H, 448)),
                                         file=None, name=f"big{e}", address=0, nbytes=0)
                         for e in range(len(es.experts[1]))]
        m.drop_tables()
        ref = ReferenceModel(m.w, eng.config)
        c, r = m.new_cache(16), ref.new_cache(16)
        a = m.forward([np.arange(3, 9)], [c], all_logits=True)[0]
        b = ref.forward([np.arange(3, 9)], [r], all_logits=True, expert_set=es)[0]
        sc = m.pipeline.scratch
        assert sc.cp_max > cp0 and sc.hld > hld0
        assert rel(a, b) < 0.03
