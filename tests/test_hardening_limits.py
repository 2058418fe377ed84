"""Bounded memory and time: KV cache and logits against available memory, score_batch
chunked and capped, long prompt text cut before tokenizing, incremental stream decoding,
tokenizer panics (docs/ROBUSTNESS.md, "Unbounded memory and time")."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_core.engine import Engine
from colibri_core.errors import InsufficientMemoryError, ModelFormatError, RequestTooLarge
from colibri_core.server.errors import from_exception
from colibri_core.model.testing import write_random_model
from colibri_core.runtime.tokenizer import StreamDecoder



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
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
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





def test_a_requests_kv_caches_are_checked_together_once(monkeypatch):
    """The memory check counts all of a request's sequences (two that fit alone may not
    fit together), and reads the machine's memory once per request, not per sequence."""
    from colibri_core import memstat
    calls = []
    with Engine.from_config("builtin", threads=1) as e:
        real = memstat.available_bytes
        monkeypatch.setattr(memstat, "available_bytes", lambda: calls.append(1) or real())
        e.score_batch([[1, 2, 3]])
        one = len(calls)
        e.score_batch([[1, 2, 3]] * 50)
        assert len(calls) - one == one            # as many reads for 50 sequences as for 1
        bpp = e.scheduler.budget().bytes_per_position
        monkeypatch.setattr(memstat, "available_bytes", lambda: 5 * bpp)
        assert len(e.score_batch([[1, 2, 3]])) == 1            # one 3-token sequence fits
        with pytest.raises(InsufficientMemoryError, match="2 sequences"):
            e.score_batch([[1, 2, 3], [4, 5, 6]])
