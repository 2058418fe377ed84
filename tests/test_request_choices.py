"""A completion's choices are one request (issue 37, item 1): the server's n x prompts
choices go to the scheduler as one submission carrying one Decode job per choice, each
prompt tokenized once; each choice gets the tokens it gets alone, runs at most AHEAD
tokens ahead of its reader on its own, and a failure or a cancel ends them all."""
import asyncio
import threading
import time

import pytest

from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.hookspecs import hookimpl
from colibri_core.runtime.events import End, Start, TokenEvent
from colibri_core.runtime.generate import submit
from colibri_core.runtime.request import AHEAD
from colibri_core.runtime.sampler import SamplingParams
from colibri_core.server.calls import Calls
from colibri_core.server.experts import ExpertBook
from colibri_core.server.work import GenParams, run_generation


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    with Engine.from_model_dir(tiny_model_dir, threads=1) as e:
        yield e


class Ids:
    """Request ids the request hooks saw."""

    def __init__(self):
        self.started, self.ended = [], []

    @hookimpl
    def colibri_request_start(self, request_id, prompt_tokens, k):
        self.started.append(request_id)

    @hookimpl
    def colibri_request_end(self, request_id, n_tokens, stop_reason):
        self.ended.append((request_id, n_tokens, stop_reason))


def _run_call(eng, p: GenParams):
    """run_generation in a real Call (its own thread, the loop's LoopQueue as the sink):
    -> (the events the loop got, the usage)."""
    async def main():
        call = Calls(eng).submit(lambda ctx: run_generation(ctx, p, ExpertBook(eng)),
                                 request_id="cmpl-1", timeout_s=60)
        return [ev async for ev in call], call.result
    return asyncio.run(main())


def _counting(monkeypatch, obj, name: str) -> list:
    calls = []
    real = getattr(obj, name)

    def wrapped(*a, **kw):
        calls.append(a)
        return real(*a, **kw)
    monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_n_choices_of_two_prompts_are_one_submission_each_with_its_solo_tokens(tiny,
                                                                                monkeypatch):
    prompts, n, new = [[5, 6, 7, 8], [9, 10]], 3, 6
    sampling = SamplingParams(temperature=0.9, seed=11)
    # the reference: each choice alone through the Python API (choice i: seed + i)
    solo = [tiny.generate(pr, max_new_tokens=new, sampling=sampling.with_seed(11 + i),
                          request_id="solo").run().token_ids
            for pr in prompts for i in range(n)]
    submits = _counting(monkeypatch, tiny.scheduler, "submit")
    prepared = _counting(monkeypatch, tiny, "prepare_ids")
    ids = Ids()
    tiny.register_plugin(ids, name="ids")
    try:
        events, usage = _run_call(tiny, GenParams(prompts=prompts, n=n, max_tokens=new,
                                                  sampling=sampling))
    finally:
        tiny.pm.unregister(name="ids")
    assert len(submits) == 1 and len(submits[0][0].jobs) == len(prompts) * n
    assert len(prepared) == len(prompts)                   # tokenized once per prompt
    got = {c: [] for c in range(len(prompts) * n)}
    ends = {}
    for ev in events:
        if isinstance(ev, TokenEvent):
            assert ev.choice not in ends, "a token after its choice's End"
            got[ev.choice].append(ev.token_id)
        elif isinstance(ev, End):
            ends[ev.choice] = ev
        else:
            assert isinstance(ev, Start)
    assert [got[c] for c in sorted(got)] == solo
    assert [(e.prompt_tokens, e.completion_tokens, e.finish_reason)
            for _, e in sorted(ends.items())] == [(len(pr), new, "length")
                                                  for pr in prompts for _ in range(n)]
    assert usage["completion_tokens"] == len(prompts) * n * new
    want = [f"cmpl-1.{c}" for c in range(len(prompts) * n)]
    assert sorted(ids.started) == want                     # the hooks still see each choice
    assert sorted(ids.ended) == [(r, new, "length") for r in want]


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_each_choice_runs_at_most_ahead_tokens_ahead_of_its_reader(tiny):
    gens = [tiny.generate([3 + i, 4, 5], max_new_tokens=3 * AHEAD, temperature=0,
                          request_id=f"r.{i}") for i in range(3)]
    for i, g in enumerate(gens):
        g.choice = i
    req = submit(gens, "r")
    # nobody reads: every choice (not the request as a whole) stops AHEAD tokens ahead
    _wait(lambda: all(j.unacked == AHEAD for j in req.jobs), "each choice ran AHEAD ahead")
    steps = tiny.scheduler.steps
    time.sleep(0.2)
    assert tiny.scheduler.steps == steps and [j.unacked for j in req.jobs] == [AHEAD] * 3
    by_choice = {i: [] for i in range(3)}
    while (ev := req.next_event()) is not None:
        by_choice[ev.choice].append(ev.token_id)
    assert [len(v) for v in by_choice.values()] == [3 * AHEAD] * 3
    assert all(j.unacked == 0 and j.stop_reason == "length" for j in req.jobs)


def test_a_failing_choice_fails_the_whole_request_and_frees_its_kv(tiny):
    free = tiny.kv_pool.free_tokens
    steps = []

    def failing(logits):
        steps.append(1)
        if len(steps) == 3:
            raise ValueError("choice 1 broke")
        return int(logits.argmax())
    ok = tiny.generate([1, 2, 3], max_new_tokens=50, temperature=0, request_id="f.0")
    bad = tiny.generate([1, 2, 3], max_new_tokens=50, sampler=failing, request_id="f.1")
    done = threading.Event()
    req = submit([ok, bad], "f", on_done=done.set)
    assert done.wait(30)
    assert isinstance(req.error, ValueError) and "choice 1 broke" in str(req.error)
    assert all(j.outcome == "error" and j.n_tokens < 50 for j in req.jobs)
    _wait(lambda: tiny.kv_pool.free_tokens == free, "every choice's KV cache freed")
    assert tiny.scheduler.running == 0


def test_closing_one_choice_cancels_them_all_and_a_shared_one_is_not_iterated(tiny):
    free = tiny.kv_pool.free_tokens
    gens = [tiny.generate([7, 8], max_new_tokens=200, temperature=0, request_id=f"c.{i}")
            for i in range(2)]
    req = submit(gens, "c")
    with pytest.raises(RequestError, match="submitted with others"):
        next(iter(gens[0]))
    with pytest.raises(RequestError, match="not started yet"):
        submit(gens, "again")
    gens[1].close()
    assert req.wait_done(30)
    assert req.cancelled and req.error is None
    assert [j.outcome for j in req.jobs] == [None, None]   # neither finished
    _wait(lambda: tiny.kv_pool.free_tokens == free, "both KV caches freed")


def _tokens_ran(eng, p: GenParams) -> tuple[int, dict]:
    """-> (tokens the steps ran for the request, {choice: token ids})."""
    eng.scheduler.trace = []
    try:
        events, _ = _run_call(eng, p)
    finally:
        trace, eng.scheduler.trace = eng.scheduler.trace, None
    got: dict = {}
    for ev in events:
        if isinstance(ev, TokenEvent):
            got.setdefault(ev.choice, []).append(ev.token_id)
    return sum(t for step in trace for _, t, _ in step), got


def test_a_prompts_choices_run_its_prefill_once(tiny):
    prompts, n, new = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], 3, 5
    sampling = SamplingParams(temperature=0.9, seed=4)
    solo = [tiny.generate(pr, max_new_tokens=new, sampling=sampling.with_seed(4 + i)
                          ).run().token_ids for pr in prompts for i in range(n)]
    ran, got = _tokens_ran(tiny, GenParams(prompts=prompts, n=n, max_tokens=new,
                                           sampling=sampling))
    assert [got[c] for c in sorted(got)] == solo       # the copied rows: the same tokens
    # each prompt once, then every choice's decode tokens (its last one is not run)
    assert ran == sum(map(len, prompts)) + len(prompts) * n * (new - 1)


def test_a_choice_admitted_after_its_prompts_prefill_computes_it_itself(tiny_model_dir):
    prompt, new = [5, 6, 7, 8, 9, 10, 11, 12], 4
    # a KV pool with room for one choice at a time: the second is admitted only once
    # the first is done, too late for its rows
    with Engine.from_model_dir(tiny_model_dir, threads=1,
                               kv_pool_tokens=len(prompt) + new) as eng:
        solo = [eng.generate(prompt, max_new_tokens=new, sampling=SamplingParams(
            temperature=0.9, seed=2 + i)).run().token_ids for i in range(2)]
        ran, got = _tokens_ran(eng, GenParams(prompts=[prompt], n=2, max_tokens=new,
                                              sampling=SamplingParams(temperature=0.9,
                                                                      seed=2)))
    assert [got[0], got[1]] == solo
    assert ran == 2 * len(prompt) + 2 * (new - 1)
