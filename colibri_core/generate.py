"""Token generation: prefill, then decode one token at a time, streaming.

Between two tokens (and only there) the engine applies queued expert changes, so every
token is computed with exactly one expert set, whose generation and id are recorded on
the token.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import numpy as np

from .config import ModelConfig
from .errors import ModelFormatError
from .model import Model
from .sampler import Sampler
from .tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger("colibri")


class Host(Protocol):
    """What a Generation uses of its engine (engine.Engine is the one host)."""
    model_cfg: ModelConfig
    model: Model
    model_dir: Path
    tokenizer: Optional[Tokenizer]
    hooks: Any                      # plugins.HookRelay
    kv_pool: Any                    # kvcache.KVPool: the sequence's cache comes from it

    def apply_expert_changes(self) -> Any: ...

    def claim(self, request_id: str) -> None: ...      # one active request (or refuse)

    def release(self, request_id: str) -> None: ...

    def step(self) -> Any: ...                          # context manager around compute


@dataclass(frozen=True)
class TokenEvent:
    step: int                  # 0-based index of the generated token
    token_id: int
    text: str                  # new text this token completed (may be "")
    expert_set_generation: int  # the expert set the token was computed with: its counter
    expert_set_id: str          # ... and its digest (expertset.expert_set_id)
    latency_s: float           # time from the previous token (or request start)


@dataclass
class Generation:
    """Iterate to stream tokens; afterwards `stop_reason`, `token_ids`, `text` are set."""

    engine: Host
    prompt_ids: list[int]
    k: int
    k_source: str
    max_new_tokens: int
    sampler: Sampler
    stop: list[str]
    pin_experts: bool = False
    request_id: str = ""
    truncated_from: Optional[int] = None
    stop_reason: Optional[str] = None      # "length" | "eos" | "stop" | "context" | "error"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    events: list[TokenEvent] = field(default_factory=list)
    _warned_nonfinite: bool = field(default=False, repr=False)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._run()

    def run(self) -> "Generation":
        for _ in self:
            pass
        return self

    def _run(self) -> Iterator[TokenEvent]:
        eng = self.engine
        cfg = eng.model_cfg
        ctx = cfg.max_position_embeddings
        eng.claim(self.request_id)       # one active request per engine: refused, not mixed
        try:
            yield from self._steps(eng, cfg, ctx)
        finally:
            eng.release(self.request_id)

    def _steps(self, eng, cfg, ctx) -> Iterator[TokenEvent]:
        capacity = min(ctx, len(self.prompt_ids) + self.max_new_tokens)
        decoder = StreamDecoder(eng.tokenizer) if eng.tokenizer is not None else None
        hooks = eng.hooks
        if hooks is not None and hooks.request_start is not None:
            hooks.request_start(request_id=self.request_id, prompt_tokens=len(self.prompt_ids), k=self.k)
        # From the engine's pool; back to it in the finally below, however the generation
        # ends: run to the end, failed, closed early or garbage-collected (a generator's
        # close() raises GeneratorExit at its yield).
        cache = eng.kv_pool.alloc(max(capacity, len(self.prompt_ids)))
        # No collector pauses inside a token; the caller's own code between two tokens runs
        # with the collector as it was.
        gc_was_enabled = gc.isenabled()
        try:
            t_prev = time.perf_counter()
            gc.disable()
            with eng.step():
                eng.apply_expert_changes()
                es = eng.model.expert_set        # a pinned request keeps this snapshot
                logits = eng.model.forward([np.asarray(self.prompt_ids)], [cache], [self.k],
                                           expert_set=es)[0]
            eos = set(cfg.eos_token_ids)
            step = 0
            while True:
                if step >= self.max_new_tokens:
                    self.stop_reason = "length"
                    break
                tok = self._sample(logits)
                if tok in eos:
                    self.stop_reason = "eos"
                    break
                self.token_ids.append(tok)
                piece = decoder.push(tok) if decoder is not None else ""
                piece, stop_hit = self._cut_at_stop(piece)
                self.text += piece
                now = time.perf_counter()
                ev = TokenEvent(step, tok, piece, es.generation, es.id, now - t_prev)
                t_prev = now
                self.events.append(ev)
                if hooks is not None and hooks.token is not None:
                    hooks.token(request_id=self.request_id, step=step, token_id=tok, text=piece,
                                expert_set_generation=es.generation, expert_set_id=es.id)
                if gc_was_enabled:
                    gc.enable()
                yield ev
                gc.disable()
                step += 1
                if stop_hit:
                    self.stop_reason = "stop"
                    break
                if step >= self.max_new_tokens:
                    self.stop_reason = "length"
                    break
                if cache.length >= cache.capacity:
                    self.stop_reason = "context"
                    break
                with eng.step():                        # close() waits for this, not longer
                    if not self.pin_experts:
                        eng.apply_expert_changes()      # between two tokens, on this thread
                        es = eng.model.expert_set
                    logits = eng.model.decode_step(tok, cache, self.k, expert_set=es)
            if decoder is not None and self.stop_reason != "stop":
                tail = decoder.flush()
                self.text += tail
        except Exception:
            self.stop_reason = "error"         # what colibri_request_end reports
            raise
        finally:
            eng.kv_pool.free(cache)
            if gc_was_enabled:
                gc.enable()
            if hooks is not None and hooks.request_end is not None:
                hooks.request_end(request_id=self.request_id, n_tokens=len(self.token_ids),
                                  stop_reason=self.stop_reason)

    def _sample(self, logits: np.ndarray) -> int:
        hooks = self.engine.hooks
        if hooks is not None and hooks.sample is not None:
            got = hooks.sample(logits=logits, request={"id": self.request_id, "k": self.k})
            if got is not None:
                return hooks.guard.check_sample(got, self.engine.model_cfg.vocab_size)
        if not np.isfinite(logits.max()):          # NaN or +Inf somewhere (no temporary array)
            logits = self._finite_logits(logits)
        return self.sampler(logits)

    def _finite_logits(self, logits: np.ndarray) -> np.ndarray:
        """NaN logits never win; +Inf ones always do. All NaN (weights with NaN/Inf, which a
        load does not scan for) is a typed error naming the check to run, not a crash."""
        logits = np.asarray(logits, dtype=np.float64)
        big = np.finfo(np.float64).max / 4
        fixed = np.nan_to_num(logits, nan=-np.inf, posinf=big, neginf=-np.inf)
        if not np.isfinite(fixed).any():
            eng = self.engine
            raise ModelFormatError(
                f"{eng.model_dir}: the model produced no finite logit at step "
                f"{len(self.token_ids)} (NaN/Inf in its weights?); check it with "
                f"`colibri inspect {eng.model_dir} --verify`")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("non-finite logits at step %d of %s: NaN ones are never sampled",
                        len(self.token_ids), self.request_id)
        return fixed

    def _cut_at_stop(self, piece: str) -> tuple[str, bool]:
        """Cut the new text before the first stop string (which may straddle tokens)."""
        if not self.stop:
            return piece, False
        candidate = self.text + piece
        cuts = [i for i in (candidate.find(s) for s in self.stop) if i >= 0]
        if not cuts:
            return piece, False
        return candidate[len(self.text):max(min(cuts), len(self.text))], True
