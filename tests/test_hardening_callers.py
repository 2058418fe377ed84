"""Many callers, one Engine, and its lifetimes: requests side by side, a full queue,
close() during a request, use after close, abandoned generations, no leaks
(docs/ROBUSTNESS.md, "Callers and lifetimes"; the scheduler: tests/test_scheduler.py)."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from colibri_core.engine import Engine

from robust_helpers import solo_tokens as _solo
from colibri_core.errors import (EngineBusyError, EngineClosedError, InsufficientMemoryError,
                                 ModelFormatError, RequestError)
from colibri_core.server.errors import from_exception


def test_a_second_request_runs_beside_an_active_one(eng):
    g = iter(eng.generate("The with statement", max_new_tokens=8, temperature=0))
    first = next(g)                                   # active from its first token
    assert _solo(eng, "The import", 4)                # served meanwhile, not refused
    assert len(eng.score_batch([[1, 2, 3]])) == 1
    assert eng.next_token_logits([1, 2, 3]).shape == (eng.model_cfg.vocab_size,)
    rest = [ev.token_id for ev in g]                  # the first request goes on unharmed
    assert [first.token_id] + rest == _solo(eng, "The with statement", 8)


def test_threads_get_their_solo_tokens(eng):
    prompts = ["The assert statement", "The import system", "A class definition",
               "The return value"]
    solo = {p: _solo(eng, p) for p in prompts}
    got, errors = {}, []
    start = threading.Barrier(len(prompts))

    def run(p):
        start.wait()
        try:
            got[p] = _solo(eng, p)
        except BaseException as exc:                  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert got == solo                                # never mixed, never wrong


def test_a_full_queue_refuses_or_waits(tiny_model_dir):
    """max_queued_requests=1: with when_full="refuse" a request beyond the one waiting
    gets EngineBusyError (503, one line); with "wait" it waits for the place."""
    from colibri_core.config import EngineConfig
    for mode in ("refuse", "wait"):
        e = Engine(tiny_model_dir, EngineConfig(max_queued_requests=1, when_full=mode,
                                                kv_pool_tokens=64))
        try:
            running = e.generate([1, 2, 3], max_new_tokens=60, temperature=0).start()
            deadline = time.time() + 10                       # the first one admitted:
            while running.queue_wait_s is None and time.time() < deadline:
                time.sleep(0.001)                             # the second fits no more KV
            queued = e.generate([4, 5, 6], max_new_tokens=2, temperature=0).start()
            if mode == "refuse":
                with pytest.raises(EngineBusyError, match="max_queued_requests=1"):
                    e.generate([7, 8], max_new_tokens=2).start()
                list(running)
            else:
                third = e.generate([7, 8], max_new_tokens=2, temperature=0)
                t = threading.Thread(target=third.run)
                t.start()
                list(running)                                 # frees the KV: the queue moves
                t.join(30)
                assert len(third.token_ids) == 2 and third.queue_wait_s > 0
            assert len(queued.run().token_ids) == 2
        finally:
            e.close()


def test_an_abandoned_generation_frees_the_engine(eng):
    g = iter(eng.generate("The with statement", max_new_tokens=8))
    next(g)
    del g
    gc.collect()                                      # finalization closes the generator
    assert _solo(eng, "The import", 3)
    g = iter(eng.generate("The with statement", max_new_tokens=8))
    next(g)
    g.close()                                         # closed early
    assert _solo(eng, "The import", 3)


def test_the_collector_runs_between_tokens():
    with Engine.from_config("builtin", threads=1) as e:
        assert gc.isenabled()
        states = [gc.isenabled() for _ in e.generate("The with", max_new_tokens=5)]
        assert states == [True] * 5 and gc.isenabled()


# ------------------------------------------------------------------ lifetimes
def test_iterating_after_close_and_reports_after_close():
    e = Engine.from_config("builtin", threads=1)
    g = e.generate("The with", max_new_tokens=5)
    e.close()
    with pytest.raises(EngineClosedError):
        list(g)
    with pytest.raises(EngineClosedError):
        e.memory_report()
    with pytest.raises(EngineClosedError):
        e.score_batch([[1, 2]])
    e.close()                                         # idempotent


def test_close_from_another_thread_during_generate():
    e = Engine.from_config("builtin", threads=1)
    seen, outcome = [], []
    started = threading.Event()

    def run():
        try:
            for ev in e.generate("The with statement", max_new_tokens=200, temperature=0):
                seen.append(ev.token_id)
                started.set()
                time.sleep(0.001)
            outcome.append("finished")
        except EngineClosedError:
            outcome.append("closed")

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    e.close()                                         # waits for the running step only
    t.join(30)
    assert outcome == ["closed"] and 0 < len(seen) < 200
    assert e.model.expert_set is None                 # released


def test_close_inside_a_hook_releases_at_the_end_of_the_step():
    e = Engine.from_config("builtin", threads=1)

    class Closer:
        from colibri_core.hookspecs import hookimpl

        @hookimpl
        def colibri_token(self, request_id, step, token_id, text, expert_set_generation,
                          expert_set_id):
            if step == 2:
                e.close()

    e.register_plugin(Closer(), "closer")
    with pytest.raises(EngineClosedError):
        list(e.generate("The with statement", max_new_tokens=20))
    assert e.model.expert_set is None


def test_errors_carry_their_http_answer():
    for exc, status, code in [(EngineBusyError("b"), 429, "engine_busy"),
                              (EngineClosedError("c"), 503, "engine_closed"),
                              (InsufficientMemoryError("m"), 503, "insufficient_memory"),
                              (RequestError("r"), 400, "invalid_value"),
                              (ModelFormatError("f"), 500, "model_error")]:
        err = from_exception(exc, "req-1")
        assert (err.status, err.code) == (status, code)
        assert (err.headers.get("Retry-After") is not None) == (status in (429, 503))


def test_lifetime_cases_do_not_leak():
    """benchmarks/robustness/leaks.py at 20 repetitions (the documented run is 200)."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "benchmarks.robustness.leaks", "--reps", "20",
                        "--json"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    bad = [x for x in results if not x["ok"]]
    assert not bad, bad
