"""Several expert sets in one step (forward/mixedsets.py, runtime/steprun.py): a pinned
snapshot's, a canary's and the live set's sequences run in one forward pass, each
bit-identical to running alone under its own set."""
import dataclasses
import threading

import numpy as np
import pytest

from colibri_core.engine import Engine
from colibri_core.format.quant import quantize_q4


class QHot:
    """A hot-plugged expert with INT4 weights (run by the C expert block, as a built .so
    with embedded weights is) in `slot` of every MoE layer."""

    def __init__(self, cfg, slot: int, seed: int, bias: float, name: str):
        rng = np.random.default_rng(seed)
        H, I = cfg.hidden_size, 128
        self.q4 = type("Q4", (), {})()
        self.q4.w1 = quantize_q4(rng.standard_normal((I, H)) / np.sqrt(H), 128)
        self.q4.w3 = quantize_q4(rng.standard_normal((I, H)) / np.sqrt(H), 128)
        self.q4.w2 = quantize_q4(rng.standard_normal((H, I)) / np.sqrt(I), 128)
        self.layers = list(cfg.moe_layers)
        self.slot, self.name, self.sha256 = slot, name, f"{seed:064d}"
        self.router_row = (rng.standard_normal(H) / np.sqrt(H)).astype(np.float32)
        self.router_bias = bias
        self.forward = None


def three_sets(eng):
    """(pinned, live, canary): an older snapshot with expert `a` v1; the live set with
    `a` v2 and `b` v1; a canary's set: the live set with `b` v2, named as candidates.py
    names it. The model's own experts are the same objects in all three."""
    cfg, base = eng.model_cfg, eng.model.expert_set
    E = cfg.num_experts
    pinned = base.with_expert(QHot(cfg, E, 1, 1.0, "a"))
    live = pinned.with_expert(QHot(cfg, E, 2, 1.0, "a")).with_expert(QHot(cfg, E + 1, 3, 0.5, "b"))
    canary = dataclasses.replace(live.with_expert(QHot(cfg, E + 1, 4, 2.0, "b")),
                                 version=live.version, candidate="b")
    return pinned, live, canary


def _seqs(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 250, int(rng.integers(3, 20))) for _ in range(n)]


def _alone(m, seq, es, k=2):
    return m.forward([seq], [m.new_cache(64)], [k], all_logits=True, expert_set=es)[0]


def test_one_pass_of_three_sets_is_each_sequence_alone(tiny_model_dir):
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        m = eng.model
        pinned, live, canary = three_sets(eng)
        m.expert_set = live
        seqs = _seqs(9, seed=0)
        sets = [pinned, live, canary] * 3          # interleaved: nine runs of one sequence
        alone = [_alone(m, s, es) for s, es in zip(seqs, sets)]
        # the sets differ where it matters: each sequence's logits depend on its set
        for i in range(3):
            got = {_alone(m, seqs[i], es).tobytes() for es in (pinned, live, canary)}
            assert len(got) == 3
        routes = []                                 # each sequence's routing alone
        for s, es in zip(seqs, sets):
            _alone(m, s, es)
            routes.append([(t.layer, t.routing.ids, t.logits) for t in m.last_routing])
        caches = [m.new_cache(64) for _ in seqs]
        p0 = m.pipeline.passes
        got = m.forward(seqs, caches, [2] * 9, all_logits=True, expert_set=sets)
        assert m.pipeline.passes - p0 == 1                      # one pass, not one per set
        trace, t0 = m.last_routing, 0                # the step's routing: each set's own
        for s, own in zip(seqs, routes):
            for lt, (layer, ids, logits) in zip(trace, own):
                assert lt.layer == layer
                assert np.array_equal(lt.routing.ids[t0:t0 + len(s)], ids)
                assert np.array_equal(lt.logits[t0:t0 + len(s), :logits.shape[1]], logits)
            t0 += len(s)
        mix = m.pipeline._mix
        assert mix is not None and len(mix.tables) == 3
        assert mix.shared_entries() >= 2 * (m.cfg.num_experts + 1)   # the model's and `a`
        for a, b in zip(alone, got):
            assert np.array_equal(a, b)
        # decode steps: one token per sequence, its cache continued
        steps = [np.array([t]) for t in (5, 17, 99, 3, 250, 42, 7, 8, 9)]
        want = []
        for s, es, t in zip(seqs, sets, steps):
            c = m.new_cache(64)
            m.forward([s], [c], [2], expert_set=es)
            want.append(m.forward([t], [c], [2], expert_set=es)[0])
        got = m.forward(steps, caches, [2] * 9, expert_set=sets)
        for a, b in zip(want, got):
            assert np.array_equal(a, b)
        # a set per sequence that is one set: the plain path
        m.forward([seqs[0]], [m.new_cache(64)], [2], expert_set=[live])
        assert m.pipeline._mix is None


def test_what_cannot_mix_runs_a_pass_per_set(tiny_model_dir):
    """An experts executor other than the pipeline's own (fleet/expertshard.py's place):
    one pass per set, the same bits."""
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        m = eng.model
        pinned, live, canary = three_sets(eng)
        m.expert_set = live
        seqs, sets = _seqs(6, seed=2), [live, canary, pinned, live, canary, pinned]
        alone = [_alone(m, s, es) for s, es in zip(seqs, sets)]
        pipe = m.pipeline
        pipe.experts = lambda *a: pipe._experts(*a)
        try:
            assert not pipe.mixable([live, canary])
            p0 = pipe.passes
            got = m.forward(seqs, [m.new_cache(64) for _ in seqs], [2] * 6,
                            all_logits=True, expert_set=sets)
            assert pipe.passes - p0 == 3
        finally:
            pipe.experts = pipe._experts
        for a, b in zip(alone, got):
            assert np.array_equal(a, b)
        with pytest.raises(Exception, match="6 token lists but 2 expert sets"):
            m.forward(seqs, [m.new_cache(64) for _ in seqs], [2] * 6, expert_set=[live, canary])


def test_the_scheduler_runs_pinned_canary_and_live_requests_in_one_step(tiny_model_dir):
    """Three score calls -- a pinned snapshot's, a canary's, the live set's -- queued
    together are prefilled in one step (the trace and the pipeline's pass count), and each
    item's logits are those it gets alone under the set its answer names."""
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        m, sched = eng.model, eng.scheduler
        pinned, live, canary = three_sets(eng)
        eng.queue_expert_change(lambda es: live)
        eng.apply_expert_changes()
        assert m.expert_set is live
        calls = {"pinned": (_seqs(3, 10), pinned), "canary": (_seqs(3, 11), canary),
                 "live": (_seqs(3, 12), None)}
        gate = threading.Event()

        def hook(step):                            # hold the first step until all three wait
            if not gate.is_set():
                for _ in range(2000):
                    if sched.queued == 3:
                        break
                    threading.Event().wait(0.005)
                gate.set()
        sched.step_hook, sched.trace = hook, []
        p0 = m.pipeline.passes
        out, errors = {}, []

        def score(name):
            seqs, es = calls[name]
            try:
                out[name] = eng.score(seqs, experts_per_token=2, request_id=name, expert_set=es)
            except Exception as exc:               # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=score, args=(n,)) for n in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        sched.step_hook = None
        assert not errors
        steps = [s for s in sched.trace if s]
        assert len(steps) == 1                     # one step, not one per set
        assert sorted({rid for rid, _, _ in steps[0]}) == ["canary", "live", "pinned"]
        assert m.pipeline.passes - p0 == 1
        sched.trace = None
        names = {"pinned": (pinned, None), "canary": (canary, "b"), "live": (live, None)}
        for name, (seqs, _) in calls.items():
            es, cand = names[name]
            for s, got in zip(seqs, out[name]):
                assert got.expert_set["id"] == es.id
                assert got.expert_set.get("candidate") == cand
                want = m.forward([s], [m.new_cache(64)], [2], expert_set=es)[0]
                assert np.array_equal(got.logits, want)


def test_a_set_whose_router_gives_nan_takes_the_fallback_for_its_rows_only(tiny_model_dir):
    """Non-finite router logits (a hot expert's NaN router row) send that set's run to
    routing.route's fallback, as alone; the other sets' runs route in C."""
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        m, cfg = eng.model, eng.model_cfg
        _, live, _ = three_sets(eng)
        bad = QHot(cfg, cfg.num_experts + 2, 5, 0.0, "c")
        bad.router_row[:] = np.nan
        nan_set = live.with_expert(bad)
        m.expert_set = live
        seqs, sets = _seqs(4, seed=3), [live, nan_set, nan_set, live]
        alone = [_alone(m, s, es) for s, es in zip(seqs, sets)]
        p0 = m.pipeline.passes
        got = m.forward(seqs, [m.new_cache(64) for _ in seqs], [2] * 4, all_logits=True,
                        expert_set=sets)
        assert m.pipeline.passes - p0 == 1
        for a, b in zip(alone, got):
            assert np.isfinite(b).all() and np.array_equal(a, b)


def test_pinned_canary_and_live_streams_decode_in_one_step_each(tiny_model_dir):
    """Three greedy streams -- one pinned to the snapshot current at its admission, one
    whose request the canary picks, one live -- decode together: their tokens share steps
    (one pass per step), and each stream's tokens are those it gets alone, replayed step by
    step with its set."""
    with Engine.from_model_dir(tiny_model_dir, threads=1) as eng:
        m, sched = eng.model, eng.scheduler
        pinned, live, canary = three_sets(eng)
        eng.queue_expert_change(lambda es: pinned)
        eng.apply_expert_changes()
        picked = {"canary-0": canary}                 # the canary's choice by request id
        eng.set_for = lambda rid: picked.get(rid, m.expert_set)
        sched.trace, p0 = [], m.pipeline.passes
        g_pin = eng.generate([5, 9, 31, 7], max_new_tokens=24, temperature=0,
                             pin_experts=True, request_id="pinned-0")
        stream = iter(g_pin)
        first = next(stream)                          # admitted under `pinned`
        assert first.expert_set_generation == pinned.generation
        eng.queue_expert_change(lambda es: live)
        eng.apply_expert_changes()
        g_can = eng.generate([11, 3, 200], max_new_tokens=24, temperature=0,
                             pin_experts=True, request_id="canary-0")
        g_live = eng.generate([42, 17, 8, 99, 4], max_new_tokens=24, temperature=0,
                              request_id="live-0")
        # all three submitted before any is consumed, then consumed in lockstep from this
        # thread: with the run-ahead limit no stream can get far ahead of the others, so
        # they share steps however the machine schedules threads (consumer threads
        # scheduled late on a loaded machine left no step with all three)
        g_can.start()
        g_live.start()
        running = [stream, iter(g_can), iter(g_live)]
        while running:
            running = [it for it in running if next(it, None) is not None]
        steps = [s for s in sched.trace if s]
        sched.trace = None
        assert m.pipeline.passes - p0 == len(steps)   # one pass per step, whatever the sets
        together = [s for s in steps if len({rid for rid, _, _ in s}) == 3]
        assert len(together) >= 10                    # the three decoded side by side
        by_id = {"pinned-0": pinned, "canary-0": canary, "live-0": live}
        for g in (g_pin, g_can, g_live):
            es = by_id[g.request_id]
            counts = [n for s in steps for rid, n, _ in s if rid == g.request_id]
            cache = m.new_cache(len(g.prompt_ids) + g.max_new_tokens)
            feed, pos, out = list(g.prompt_ids) + g.token_ids, 0, []
            for n in counts:
                logits = m.forward([np.asarray(feed[pos:pos + n])], [cache], [g.k],
                                   expert_set=es)[0]
                pos += n
                if pos >= len(g.prompt_ids):
                    out.append(int(np.argmax(logits)))
            assert len(g.token_ids) == 24
            assert out[:len(g.token_ids)] == g.token_ids, g.request_id
        # the three sets give each prompt different logits (the replay's set matters)
        for g in (g_pin, g_can, g_live):
            got = {m.forward([np.asarray(g.prompt_ids)], [m.new_cache(40)], [g.k],
                             expert_set=es)[0].tobytes() for es in (pinned, live, canary)}
            assert len(got) == 3
