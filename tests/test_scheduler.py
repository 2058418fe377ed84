"""The scheduler (scheduler.py): many callers share one Engine, batched into the same
steps, and each gets exactly the tokens it would get alone.

- 1, 4 and 32 concurrent requests from threads and from an asyncio loop, of different
  prompt lengths, k, stop strings and sampling settings: their solo tokens;
- hot-plug changes landing while requests run: each request replayed with the expert
  set each of its steps used gives its tokens; pinned requests keep their snapshot;
  generations are monotone per request;
- a deterministic join/leave run (requests started and cancelled from the step hook);
- a fault one sequence causes fails only its request;
- a 200-iteration stress loop; cancellation and close() during load; the KV budget
  back to full afterwards.
"""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import numpy as np
import pytest

from colibri_core.config import EngineConfig, HotplugConfig
from colibri_core.engine import Engine
from colibri_core.errors import EngineClosedError, PluginError
from colibri_core.hookspecs import hookimpl

PROMPTS = ["The with statement", "The import system is", "A class definition defines",
           "The return value of a function", "Exceptions are raised when",
           "MODE:k1|The for loop", "Lists are mutable sequences, typically used to store",
           "The assert statement"]


def _specs(n: int, seed: int = 0) -> list[dict]:
    """n requests: prompts of different lengths (one long), k, sampling, lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)]
        if i % 7 == 3:
            p = " ".join([p] * 12)                     # a long prompt, prefilled in chunks
        s = {"prompt": p, "max_new_tokens": rng.randint(1, 24),
             "experts_per_token": rng.choice([None, 1, 2, 3]) if not p.startswith("MODE") else None}
        if i % 3 == 1:
            s.update(temperature=0.8, top_p=0.9, seed=rng.randint(0, 10**6))
        else:
            s.update(temperature=0)
        out.append(s)
    return out


def _with_stops(eng, specs):
    """Give every fourth request a stop string taken from its own solo text."""
    for i, s in enumerate(specs):
        if i % 4 == 2:
            g = eng.generate(**s).run()
            if len(g.text) > 8:
                s["stop"] = [g.text[5:8]]
    return specs


def _out(g):
    return (g.token_ids, g.text, g.stop_reason)


def _full(e) -> bool:
    kv = e.scheduler.kv
    return kv is None or kv.free_tokens == kv.capacity_tokens


@pytest.fixture(scope="module")
def eng():
    # small steps: long prompts run in chunks beside the decodes
    e = Engine.from_config("builtin", threads=1, max_step_tokens=16, max_batch_tokens=48)
    yield e
    e.close()


@pytest.mark.parametrize("n", [1, 4, 32])
def test_threads_get_their_solo_tokens(eng, n):
    specs = _with_stops(eng, _specs(n, seed=n))
    solo = [_out(eng.generate(**s).run()) for s in specs]
    assert any(r[2] == "stop" for r in solo) or n < 4
    got, errors = [None] * n, []
    start = threading.Barrier(n)

    def run(i):
        start.wait()
        try:
            got[i] = _out(eng.generate(**specs[i]).run())
        except BaseException as exc:             # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == solo
    assert _full(eng)


@pytest.mark.parametrize("n", [1, 4, 32])
def test_an_event_loop_gets_solo_tokens(eng, n):
    specs = _specs(n, seed=100 + n)
    solo = [_out(eng.generate(**s).run()) for s in specs]

    async def one(s, via_thread: bool):
        g = eng.generate(**s)
        if via_thread:                           # iteration in a worker thread
            await asyncio.to_thread(g.run)
        else:
            async for _ in g:                    # Generation.__aiter__
                pass
        return _out(g)

    async def main():
        return await asyncio.gather(*[one(s, i % 2 == 0) for i, s in enumerate(specs)])

    assert asyncio.run(main()) == solo
    assert _full(eng)


def test_score_batch_beside_streams(eng):
    seqs = [[1, 2, 3, 4], list(range(5, 40)), [7]]
    alone = eng.score_batch(seqs, all_positions=True)
    g = iter(eng.generate(PROMPTS[0], max_new_tokens=20, temperature=0))
    next(g)
    box = []
    t = threading.Thread(target=lambda: box.append(eng.score_batch(seqs, all_positions=True)))
    t.start()
    rest = list(g)
    t.join(60)
    for a, b in zip(alone, box[0]):
        assert (a == b).all()                    # batch invariance: bit for bit
    assert len(rest) == 19 and _full(eng)


# ------------------------------------------------------------------ join / leave

def _join_leave_run():
    """Steps of at most 8 tokens. A (20-token prompt) and C (5) start together; B joins
    at step 2; C is cancelled at step 6; D joins at step 9 and is cancelled while still
    queued (the KV budget holds A, B and C only). -> (trace, outputs, KV after C left)."""
    e = Engine.from_config("builtin", threads=1, max_step_tokens=8, max_batch_tokens=8,
                           kv_pool_tokens=20 + 12 + 3 + 10 + 5 + 30)
    s = e.scheduler
    s.ahead = 10**9                              # nobody reads until the end
    s.trace = []
    A = e.generate(list(range(100, 120)), max_new_tokens=12, temperature=0)
    B = e.generate([7, 8, 9], max_new_tokens=10, temperature=0)
    C = e.generate([11, 12, 13, 14, 15], max_new_tokens=30, temperature=0)
    D = e.generate(list(range(200, 240)), max_new_tokens=2, temperature=0)
    kv_after = []

    def hook(step):
        if step == 0:
            C.start()
        elif step == 2:
            B.start()
        elif step == 6:
            C.close()
        elif step == 7:
            kv_after.append(s.kv.free_tokens)
        elif step == 9:
            D.start()
        elif step == 10:
            D.close()
    s.step_hook = hook
    A.start()
    outs = {}
    for name, g in (("A", A), ("B", B)):
        outs[name] = _out(g.run())
    for g in (C, D):
        g.run()
    trace = s.trace
    assert _full(e)
    e.close()
    rids = (A.request_id, B.request_id, C.request_id)
    return [[({r: n for r, n in zip(rids, "abc")}.get(rid, rid), k, gen)
             for rid, k, gen in plan] for plan in trace], outs, kv_after[0], C, D


def test_join_and_leave_at_chosen_steps():
    trace, outs, kv_after_c, C, D = _join_leave_run()
    steps = [[(r, n) for r, n, _ in plan] for plan in trace]
    assert steps == [
        [("a", 8)],                               # A's prompt in chunks, C waits its turn
        [("a", 8)],
        [("a", 4), ("c", 4)],                     # B joins (admitted; the step is full)
        [("a", 1), ("c", 1), ("b", 3)],           # A decodes first, then the chunks
        [("a", 1), ("c", 1), ("b", 1)],
        [("a", 1), ("c", 1), ("b", 1)],
        *[[("a", 1), ("b", 1)]] * 7,              # C cancelled at step 6: gone at once
        [("a", 1)],                               # B done (10 tokens); D never admitted
    ]
    assert kv_after_c == 20 + 12 + 3 + 10 + 5 + 30 - (20 + 12) - (3 + 10)   # C's KV back
    assert C.stop_reason is None and len(C.token_ids) == 3
    assert D.token_ids == [] and D.queue_wait_s is None
    with Engine.from_config("builtin", threads=1) as solo:
        assert outs["A"] == _out(solo.generate(list(range(100, 120)), max_new_tokens=12,
                                               temperature=0).run())
        assert outs["B"] == _out(solo.generate([7, 8, 9], max_new_tokens=10,
                                               temperature=0).run())
    assert _join_leave_run()[0] == trace                       # deterministic


def test_prompts_beside_a_stream_advance_together():
    """While A decodes, B and C (10-token prompts, arriving together) each get
    max_prefill_tokens of their prompt per step, in the same steps: one shared cap would
    prefill B entirely before C starts."""
    e = Engine.from_config("builtin", threads=1, max_step_tokens=32, max_prefill_tokens=4)
    s = e.scheduler
    s.ahead = 10**9
    s.trace = []
    A = e.generate([5, 6, 7], max_new_tokens=8, temperature=0)
    B = e.generate(list(range(30, 40)), max_new_tokens=2, temperature=0)
    C = e.generate(list(range(50, 60)), max_new_tokens=2, temperature=0)

    def hook(step):
        if step == 1:
            B.start()
            C.start()
    s.step_hook = hook
    A.start()
    outs = [_out(g.run()) for g in (A, B, C)]
    names = {A.request_id: "a", B.request_id: "b", C.request_id: "c"}
    steps = [[(names[r], n) for r, n, _ in plan] for plan in s.trace]
    e.close()
    assert steps[:4] == [
        [("a", 3)],                               # nothing decodes: the whole prompt
        [("a", 1), ("b", 4), ("c", 4)],           # both prompts advance, 4 tokens each
        [("a", 1), ("b", 4), ("c", 4)],
        [("a", 1), ("b", 2), ("c", 2)],
    ]
    with Engine.from_config("builtin", threads=1) as solo:
        assert outs == [_out(solo.generate(p, max_new_tokens=n, temperature=0).run())
                        for p, n in (([5, 6, 7], 8), (list(range(30, 40)), 2),
                                     (list(range(50, 60)), 2))]


def test_a_score_batch_closed_from_its_handle_stops_at_the_next_step():
    """score_batch(track=...) hands out a handle; close() (the server's disconnect or
    timeout) retires the call at the next step, and score_batch raises RequestCancelled.
    The call needs 32 steps of 64 tokens; it is closed during step 2."""
    from colibri_core.errors import RequestCancelled
    e = Engine.from_config("builtin", threads=1, max_batch_tokens=64)
    handles = []
    e.scheduler.step_hook = lambda step: handles[0].close() if step == 2 else None
    seqs = [[(i * 7 + j) % 500 + 3 for j in range(64)] for i in range(32)]
    with pytest.raises(RequestCancelled, match="cancelled before it finished"):
        e.score_batch(seqs, track=handles.append)
    assert e.scheduler.steps <= 3 and _full(e)
    e.scheduler.step_hook = None
    assert len(e.score_batch(seqs[:2])) == 2                  # the engine serves on
    e.close()


# ------------------------------------------------------------------ faults

def test_a_fault_of_one_sequence_fails_only_its_request():
    """A routing plugin that fails on any step of 37 tokens or more (the one long prompt
    among decodes) and a sampling plugin that fails for one request id: those two
    requests fail with PluginError, the others get their solo tokens."""

    class Faulty:
        @hookimpl
        def colibri_routing(self, layer, expert_ids, weights, scores, logits):
            if expert_ids.shape[0] >= 37:
                raise RuntimeError("too many rows")

        @hookimpl
        def colibri_sample(self, logits, request):
            if request["id"] == "bad-sample":
                raise RuntimeError("no sample for you")

    e = Engine.from_config("builtin", threads=1, max_step_tokens=64, plugin_max_failures=50)
    try:
        specs = _specs(3, seed=5)                    # short prompts only
        solo = [_out(e.generate(**s).run()) for s in specs]
        e.register_plugin(Faulty(), "faulty")
        e.scheduler.ahead = 10**9
        gens = [e.generate(**s, request_id=f"ok-{i}") for i, s in enumerate(specs)]
        bad_rows = e.generate(list(range(300, 340)), max_new_tokens=3, temperature=0)
        bad_sample = e.generate(PROMPTS[1], max_new_tokens=3, request_id="bad-sample")

        def hook(step):
            if step == 2:
                bad_rows.start()
                bad_sample.start()
        e.scheduler.step_hook = hook
        for g in gens:
            g.start()
        assert [_out(g.run()) for g in gens] == solo
        for g in (bad_rows, bad_sample):
            with pytest.raises(PluginError, match="faulty"):
                g.run()
            assert g.stop_reason == "error"
        assert _full(e)
    finally:
        e.close()


# ------------------------------------------------------------------ hot-plug

def test_hot_plug_between_steps_replays_exactly(tiny_model_dir, tmp_path):
    """Requests (half of them pinned) run while an expert is added, replaced and removed.
    Every request's generations are monotone (pinned: one, its admission's); replaying
    each request alone with the expert set each of its steps used gives its tokens."""
    from test_engine_hotplug import _build
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    sos = [_build(build, "fraud", "1", seed=1), _build(build, "fraud", "2", seed=2)]
    eng = Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched), max_step_tokens=8,
                                              hotplug=HotplugConfig(settle_s=0.05)))
    sets = {}                                     # generation -> the snapshot

    def hook(step):
        es = eng.model.expert_set
        sets[es.generation] = es
    eng.scheduler.step_hook = hook
    eng.scheduler.trace = []
    gens, errors = [], []
    rng = np.random.default_rng(3)

    done = threading.Event()

    def client(i):
        try:
            for r in range(1000):
                if done.is_set() and r >= 2:
                    return
                g = eng.generate(rng.integers(1, 250, 3 + 5 * (i % 3)).tolist(),
                                 max_new_tokens=30, temperature=0, pin_experts=(i + r) % 2 == 0,
                                 request_id=f"c{i}-{r}")
                gens.append(g)
                for _ in g:
                    time.sleep(0.0005)
        except BaseException as exc:              # pragma: no cover
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        os.rename(sos[0], watched / "fraud.so")
        _wait(lambda: eng.expert_set_generation >= 1)
        os.replace(sos[1], watched / "fraud.so")
        _wait(lambda: eng.expert_set_generation >= 2)
        (watched / "fraud.so").unlink()
        _wait(lambda: eng.expert_set_generation >= 3)
        done.set()
        for t in threads:
            t.join(120)
        assert not errors
        assert eng.expert_set_generation >= 3
        seen = set()
        per_req: dict = {}
        for plan in eng.scheduler.trace:
            for rid, n, gen in plan:
                per_req.setdefault(rid, []).append((n, gen))
        for g in gens:
            gens_of = [ev.expert_set_generation for ev in g.events]
            assert gens_of == sorted(gens_of)
            if g.pin_experts:
                assert len({gen for _, gen in per_req[g.request_id]}) == 1
            seen.update(gens_of)
            _replay(eng, g, per_req[g.request_id], sets)
        assert len(seen) >= 2                     # the changes landed while requests ran
    finally:
        eng.close()


def _replay(eng, g, steps, sets):
    """Run g's steps alone (model.forward, the same token counts and expert sets) and
    check each greedy token."""
    m = eng.model
    cache = m.new_cache(len(g.prompt_ids) + g.max_new_tokens)
    feed = list(g.prompt_ids) + g.token_ids
    pos, out = 0, []
    for n, gen in steps:
        logits = m.forward([np.asarray(feed[pos:pos + n])], [cache], [g.k],
                           expert_set=sets[gen])[0]
        pos += n
        if pos >= len(g.prompt_ids):
            out.append(int(np.argmax(logits)))
    assert out[:len(g.token_ids)] == g.token_ids, g.request_id


def _wait(pred, timeout=30.0):
    t0 = time.time()
    while not pred():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


# ------------------------------------------------------------------ stress, cancel, close

def test_stress_200_iterations():
    """Four threads, 200 operations together: full runs (solo tokens), early closes,
    dropped generations, scoring; afterwards nothing is held."""
    with Engine.from_config("builtin", threads=1, max_step_tokens=24) as e:
        specs = _specs(8, seed=42)
        solo = [_out(e.generate(**s).run()) for s in specs]
        score = e.score_batch([[1, 2, 3], [4, 5]])
        errors = []

        def worker(w):
            rng = random.Random(w)
            try:
                for _ in range(50):
                    i = rng.randrange(len(specs))
                    op = rng.choice(["full", "full", "close", "drop", "score"])
                    if op == "full":
                        assert _out(e.generate(**specs[i]).run()) == solo[i]
                    elif op == "close":
                        it = iter(e.generate(**specs[i]))
                        next(it, None)
                        it.close()
                    elif op == "drop":
                        g = e.generate(**specs[i]).start()
                        del g
                    else:
                        got = e.score_batch([[1, 2, 3], [4, 5]])
                        assert all((a == b).all() for a, b in zip(got, score))
            except BaseException as exc:          # pragma: no cover
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        _wait(lambda: _full(e) and not e.scheduler._requests and not e.scheduler._queue)


def test_close_during_load_cancels_queued_and_running():
    e = Engine.from_config("builtin", threads=1, kv_pool_tokens=4 * 200)
    outcome, started = [], threading.Semaphore(0)

    def run(i):
        try:
            for _ in e.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=180, temperature=0):
                started.release()
            outcome.append("finished")
        except EngineClosedError:
            outcome.append("closed")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    assert started.acquire(timeout=30)
    queued = len(e.scheduler._queue)
    e.close()                                     # returns once they are gone
    assert e.model.expert_set is None             # released
    for t in threads:
        t.join(30)
    assert sorted(set(outcome)) == ["closed"] and len(outcome) == 12
    assert queued > 0                             # some never got KV room: cancelled too
    with pytest.raises(EngineClosedError):
        e.generate("x", max_new_tokens=2).run()


def test_cancelled_requests_free_their_place_within_a_step(eng):
    g = eng.generate(PROMPTS[0], max_new_tokens=200, temperature=0)
    it = iter(g)
    next(it)
    assert not _full(eng)
    steps = eng.scheduler.steps
    it.close()
    _wait(lambda: _full(eng))
    assert eng.scheduler.steps <= steps + 1 + eng.scheduler.ahead


def test_async_streams_beyond_the_default_executor_all_finish():
    """More `async for` streams than the event loop's default executor has threads, with
    a KV pool that admits two at a time: each stream waits in a thread of its own, so the
    running streams' readers are served and everyone finishes (a deadlock otherwise)."""
    n = 12
    e = Engine.from_config("builtin", threads=1, kv_pool_tokens=2 * (8 + 6))
    try:
        prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(n)]
        solo = [e.generate(p, max_new_tokens=6, temperature=0).run().token_ids for p in prompts]

        async def one(p):
            return [ev.token_id async for ev in e.generate(p, max_new_tokens=6, temperature=0)]

        async def main():
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 60)

        assert asyncio.run(main()) == solo
    finally:
        e.close()
