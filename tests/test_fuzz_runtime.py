"""Structural fuzzers of what callers and plugins do (hypothesis; fuzz_helpers.py):

- lifetime races: random sequences of API operations on one Engine (generations started,
  advanced, abandoned, closed early; scoring; calls from a second thread; close() at any
  point) -- every operation returns or raises a typed error, every generation that runs
  to its end gives its solo greedy tokens, and nothing stays held afterwards;
- plugin return values: whatever a `colibri_sample` / `colibri_choose_k` plugin returns,
  the request either runs (a valid answer) or fails with PluginError naming the plugin,
  and the engine then serves a normal request;
- model files replaced by FIFOs, folders or symlinks, truncated, or truncated while
  mapped and in use (the SIGBUS guard, mapguard.py): typed errors only, no hang.
"""
from __future__ import annotations

import gc
import os
import shutil
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from colibri_core.engine import Engine
from colibri_core.errors import ColibriError, PluginError
from colibri_core.hookspecs import hookimpl

from fuzz_helpers import TRIED, fuzz, guarded
from fuzz_helpers import scratch  # noqa: F401  (a fixture)

PROMPTS = ["The with statement", "The import system", "A class definition"]
N_NEW = 6


@pytest.fixture(scope="module")
def solo():
    with Engine.from_config("builtin", threads=1) as e:
        return {p: e.generate(p, max_new_tokens=N_NEW, temperature=0).run().token_ids
                for p in PROMPTS}


OPS = st.lists(st.one_of(
    st.tuples(st.just("start"), st.sampled_from(PROMPTS)),
    st.tuples(st.just("next"), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 3)),
    st.tuples(st.just("close_gen"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.integers(0, 3)),
    st.tuples(st.just("score"), st.integers(1, 3)),
    st.tuples(st.just("thread"), st.sampled_from(PROMPTS)),
    st.tuples(st.just("close_engine"), st.just(0)),
), min_size=1, max_size=14)


@fuzz(40)
@given(ops=OPS)
def test_fuzz_lifetime_races(ops, solo):
    TRIED["lifetimes"] += 1
    e = Engine.from_config("builtin", threads=1)
    gens: list = []                      # [prompt, iterator, tokens so far, closed]
    g = None
    try:
        for op, arg in ops:
            try:
                if op == "start":
                    gens.append([arg, iter(e.generate(arg, max_new_tokens=N_NEW,
                                                      temperature=0)), [], False])
                elif op in ("next", "finish") and gens:
                    g = gens[arg % len(gens)]
                    for ev in g[1]:
                        g[2].append(ev.token_id)
                        if op == "next":
                            break
                    else:
                        if not g[3]:
                            assert g[2] == solo[g[0]]        # ran to its end: its solo tokens
                elif op == "close_gen" and gens:
                    g = gens[arg % len(gens)]
                    g[1].close()                             # a closed one yields nothing more
                    g[3] = True
                elif op == "drop" and gens:
                    gens.pop(arg % len(gens))
                    gc.collect()
                elif op == "score":
                    out = e.score_batch([[1, 2, 3]] * arg)
                    assert len(out) == arg
                elif op == "thread":
                    box = []
                    t = threading.Thread(target=lambda: box.append(_run_or_error(e, arg)))
                    t.start()
                    t.join(30)
                    assert box and (box[0] == solo[arg] or isinstance(box[0], ColibriError))
                elif op == "close_engine":
                    e.close()
            except ColibriError as exc:                      # closed: typed, one line
                assert str(exc).strip() and "\n" not in str(exc)
                if op in ("next", "finish") and g is not None:
                    g[3] = True                              # it ended with that error
    finally:
        gens.clear()
        g = None                                             # the last reference to one
        gc.collect()
        e.close()
    assert e.scheduler.kv is None or e.scheduler.kv.free_tokens == e.scheduler.kv.capacity_tokens  # nothing holds KV


def _run_or_error(e, prompt):
    try:
        return e.generate(prompt, max_new_tokens=N_NEW, temperature=0).run().token_ids
    except ColibriError as exc:
        return exc


ANSWERS = st.one_of(st.none(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=4), st.booleans(), st.lists(st.integers(0, 3), max_size=3))


@fuzz(60)
@given(sample=ANSWERS, k=ANSWERS)
def test_fuzz_plugin_return_values(sample, k, solo):
    TRIED["plugin_values"] += 1

    class Answers:
        @hookimpl
        def colibri_sample(self, logits, request):
            return sample

        @hookimpl
        def colibri_choose_k(self, prompt_tokens, request, default_k):
            return k

    with Engine.from_config("builtin", threads=1) as e:
        e.register_plugin(Answers(), "answers")
        V = e.model_cfg.vocab_size
        try:
            g = e.generate(PROMPTS[0], max_new_tokens=3, temperature=0).run()
            ok_k = k is None or (type(k) is int and 1 <= k <= e.num_experts)
            assert ok_k, f"k={k!r} was accepted"
            if sample is not None:
                assert type(sample) is int and 0 <= sample < V, f"sample={sample!r} was accepted"
                assert all(t == sample for t in g.token_ids) or g.stop_reason == "eos"
        except (PluginError, ColibriError) as exc:
            assert "answers" in str(exc) or "k" in str(exc)
        e.pm.unregister(name="answers")
        assert e.generate(PROMPTS[0], max_new_tokens=N_NEW, temperature=0).run().token_ids \
            == solo[PROMPTS[0]]


# ------------------------------------------------------------------ special and shrinking files
FILE_ACTIONS = st.sampled_from(["fifo", "dir", "symlink_zero", "symlink_other", "truncate",
                                "truncate_while_mapped"])


@fuzz(40)
@given(action=FILE_ACTIONS, pick=st.integers(0, 10**6), frac=st.floats(0, 0.99))
def test_fuzz_model_files_replaced_or_shrunk(tiny_model_dir, scratch, action, pick, frac):
    """Any file of a model directory turned into a FIFO, a folder, a symlink (to
    /dev/zero or to another of its files), truncated, or truncated while mapped and in
    use: a typed error within the time limit (never a hang, a crash or a bus error), and
    an intact copy serves afterwards."""
    TRIED["model files"] += 1
    dst = scratch / "files"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(tiny_model_dir, dst)
    names = sorted(p.name for p in dst.iterdir() if p.is_file())
    victim = dst / names[pick % len(names)]

    def damage():
        if action == "truncate" or action == "truncate_while_mapped":
            os.truncate(victim, int(victim.stat().st_size * frac))
            return
        victim.unlink()
        if action == "fifo":
            os.mkfifo(victim)
        elif action == "dir":
            victim.mkdir()
        elif action == "symlink_zero":
            victim.symlink_to("/dev/zero")
        else:
            victim.symlink_to(dst / names[(pick + 1) % len(names)])

    def go():
        if action != "truncate_while_mapped":
            damage()
        with Engine.from_model_dir(dst, threads=1) as e:
            if action == "truncate_while_mapped":
                e.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
                damage()
            e.generate([1, 2, 3], max_new_tokens=3, temperature=0).run()

    guarded(f"model files: {action}", go, (ColibriError,))
    with Engine.from_model_dir(tiny_model_dir, threads=1) as e:
        assert len(e.generate([1, 2, 3], max_new_tokens=3, temperature=0).run().token_ids) <= 3
