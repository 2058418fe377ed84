"""Hardening of the Engine's own API: one request at a time, lifetimes, unchecked values,
bounded memory and time (docs/ROBUSTNESS.md, "Callers and lifetimes")."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_core import modelfile
from colibri_core.engine import Engine
from colibri_core.errors import (EngineBusyError, EngineClosedError, InsufficientMemoryError,
                                 ModelFormatError, RequestError, RequestTooLarge)
from colibri_core.modelfile import sha256_file
from colibri_core.quant import quantize_q4
from colibri_core.server.errors import from_exception
from colibri_core.testing import write_random_model
from colibri_core.tokenizer import StreamDecoder


@pytest.fixture(scope="module")
def eng():
    with Engine.from_config("builtin", threads=1) as e:
        yield e


def _solo(e, prompt, n=12):
    return e.generate(prompt, max_new_tokens=n, temperature=0).run().token_ids


# ------------------------------------------------------------------ one request at a time
def test_a_second_request_is_refused_while_one_is_active(eng):
    g = iter(eng.generate("The with statement", max_new_tokens=8, temperature=0))
    next(g)                                           # active from its first token
    with pytest.raises(EngineBusyError, match="one request at a time"):
        eng.generate("The import", max_new_tokens=4).run()
    with pytest.raises(EngineBusyError):
        eng.score_batch([[1, 2, 3]])
    with pytest.raises(EngineBusyError):
        eng.next_token_logits([1, 2, 3])
    rest = [ev.token_id for ev in g]                  # the first request goes on unharmed
    assert len(rest) == 7
    assert _solo(eng, "The import", 4)                # and the engine is free again


def test_threads_get_their_solo_tokens_or_a_clear_refusal(eng):
    prompts = ["The assert statement", "The import system", "A class definition",
               "The return value"]
    solo = {p: _solo(eng, p) for p in prompts}
    got, refused, errors = {}, [], []
    start = threading.Barrier(len(prompts))

    def run(p):
        start.wait()
        for _ in range(200):                          # retry until admitted
            try:
                got[p] = _solo(eng, p)
                return
            except EngineBusyError:
                refused.append(p)
                time.sleep(0.002)
            except BaseException as exc:               # pragma: no cover - reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert got == solo                                # never mixed, never wrong
    assert refused                                    # they did collide, and were told


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
        def colibri_token(self, request_id, step, token_id, text, expert_set_version):
            if step == 2:
                e.close()

    e.register_plugin(Closer(), "closer")
    with pytest.raises(EngineClosedError):
        list(e.generate("The with statement", max_new_tokens=20))
    assert e.model.expert_set is None


# ------------------------------------------------------------------ unchecked values
def test_bad_request_values_are_typed_errors(eng):
    with pytest.raises(RequestError, match="stop"):
        eng.generate("x", stop=123)
    with pytest.raises(RequestError, match="list of token-id lists"):
        eng.score_batch(5)
    with pytest.raises(RequestError, match="sequence 1"):
        eng.score_batch([[1, 2], 7])
    with pytest.raises(RequestError, match="sequence 0 is text"):
        eng.score_batch(["ab"])
    with pytest.raises(RequestError, match="temperature"):
        eng.generate("x", temperature="hot")


def test_a_tiny_temperature_is_greedy(eng):
    greedy = _solo(eng, "The with statement", 10)
    tiny = eng.generate("The with statement", max_new_tokens=10, temperature=1e-308,
                        seed=3).run().token_ids
    assert tiny == greedy


def test_gate_and_up_with_different_groups_are_refused_at_load(tmp_path):
    d = tmp_path / "m"
    write_random_model(d, layers=("moe",))
    rng = np.random.default_rng(0)
    mats = [("w1", quantize_q4(rng.standard_normal((128, 128)), 64)),
            ("w3", quantize_q4(rng.standard_normal((128, 128)), 128)),
            ("w2", quantize_q4(rng.standard_normal((128, 128)), 128))]
    modelfile.write_container(d / "expert_0_0.bin", mats)
    _refresh_manifest(d)
    with pytest.raises(ModelFormatError, match="same number type and group size"):
        Engine.from_model_dir(d)


def _refresh_manifest(d):
    """Record the rewritten file's size and hash in config.json, as a conversion would."""
    cfg = json.loads((d / "config.json").read_text())
    for name, info in cfg.get("files", {}).items():
        info["size"] = (d / name).stat().st_size
        if "sha256" in info:
            info["sha256"] = sha256_file(d / name)
    (d / "config.json").write_text(json.dumps(cfg))


# ------------------------------------------------------------------ memory and time bounds
def test_a_kv_cache_larger_than_memory_is_refused(tmp_path):
    d = tmp_path / "m"
    write_random_model(d, context=2**40)
    with Engine.from_model_dir(d, threads=1) as e:
        with pytest.raises(InsufficientMemoryError, match="KV cache"):
            e.generate([1, 2, 3], max_new_tokens=2**39).run()
        assert e.generate([1, 2, 3], max_new_tokens=3).run().token_ids   # still serves


def test_score_batch_is_chunked_and_capped(tmp_path):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 1000, rng.integers(3, 40)).tolist() for _ in range(30)]
    with Engine.from_config("builtin", threads=1) as whole:
        ref = whole.score_batch(seqs, all_positions=True)
    with Engine.from_config("builtin", threads=1, max_batch_tokens=50,
                            max_call_tokens=2000) as chunked:
        got = chunked.score_batch(seqs, all_positions=True)
        for a, b in zip(ref, got):            # kernels tile by batch: float32 rounding
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        with pytest.raises(RequestTooLarge, match="max_call_tokens=2000"):
            chunked.score_batch([list(range(1, 200))] * 11)
        assert from_exception(RequestTooLarge("x"), "r").status == 413


def test_a_huge_prompt_is_cut_before_tokenizing(eng, monkeypatch):
    seen = []
    real = eng.tokenizer.encode
    monkeypatch.setattr(eng.tokenizer, "encode", lambda t: seen.append(len(t)) or real(t))
    ids, _, truncated = eng.prepare_ids("word " * 4_000_000)
    ctx = eng.model_cfg.max_position_embeddings
    assert len(ids) == ctx - 1 and truncated
    assert seen and seen[0] <= (ctx + 16) * eng.tokenizer.max_token_chars


def test_stream_decoding_is_incremental_and_exact(eng):
    tok = eng.tokenizer
    rng = np.random.default_rng(2)
    widths = []
    real = tok.decode
    tok.decode = lambda ids: widths.append(len(ids)) or real(ids)
    try:
        for _ in range(50):
            ids = rng.integers(0, 1024, rng.integers(1, 300)).tolist()
            d = StreamDecoder(tok)
            assert "".join(d.push(i) for i in ids) + d.flush() == real(ids)
    finally:
        del tok.decode
    assert max(widths) < 16                           # a window, never the whole text


def test_a_tokenizer_library_panic_is_a_typed_error(eng, monkeypatch):
    class PanicException(BaseException):             # what pyo3 raises on a Rust panic
        pass

    class Panicking:
        def encode(self, *a, **k):
            raise PanicException("regex engine panicked")

    monkeypatch.setattr(eng.tokenizer, "_tok", Panicking())
    with pytest.raises(ModelFormatError, match="tokenizer failed encoding"):
        eng.generate("x")


def test_errors_carry_their_http_answer():
    for exc, status, code in [(EngineBusyError("b"), 503, "engine_busy"),
                              (EngineClosedError("c"), 503, "engine_closed"),
                              (InsufficientMemoryError("m"), 503, "insufficient_memory"),
                              (RequestError("r"), 400, "invalid_value"),
                              (ModelFormatError("f"), 500, "model_error")]:
        err = from_exception(exc, "req-1")
        assert (err.status, err.code) == (status, code)
        assert (err.headers.get("Retry-After") is not None) == (status == 503)


def test_lifetime_cases_do_not_leak():
    """benchmarks/leaks.py at 20 repetitions (the documented run is 200)."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "leaks.py"), "--reps", "20",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    bad = [x for x in results if not x["ok"]]
    assert not bad, bad
