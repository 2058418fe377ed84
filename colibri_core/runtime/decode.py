"""A completion's choice on the scheduler: one Decode job, one sequence.

After its prompt, each step: sample (sampler.py, or a plugin's colibri_sample), cut stop
strings (stops.StopCutter: text that may begin one is held back), compute the token's
log-prob when asked, run the token hook and push a TokenEvent (events.py) to its
request's reader. What it ends with (`stop_reason`, the held-back `tail`, `n_tokens`)
is its own: a request (generate._Stream) carries one Decode per choice, and calls its
`on_choice_end(job)` on the scheduler's thread as each choice ends. Choices of one prompt
run its prefill once: the first computes it, the others (`followers`, waiting) get its
rows and logits copied (`_hand_over`).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from ..errors import ModelFormatError
from ..model.kvcache import copy_rows, paste_rows
from .events import TokenEvent, TokenTexts, token_logprob
from .request import Job
from .speculative import PromptLookup
from .stops import StopCutter
from .tokenizer import StreamDecoder

log = logging.getLogger("colibri")


class Decode(Job):
    """A generation's sequence: after its prompt, sample, stream, stop; one token per
    step, or with speculative decoding (EngineConfig.speculative_decoding) the decode
    token and a draft, of which the tokens sampled as plain decoding samples them are
    kept (speculative.py). Runs on the scheduler's thread."""

    decodes = True

    def __init__(self, request, gen, capacity: int):
        """`gen`: the choice's generate.Generation (read here, not kept: dropping it
        cancels its request)."""
        super().__init__(request, gen.prompt_ids, gen.k, capacity, pin=gen.pin_experts)
        eng = gen.engine
        self.hooks = eng.hooks
        self.vocab_size = eng.model_cfg.vocab_size
        self.model_dir = eng.model_dir
        self.eos = set(eng.model_cfg.eos_token_ids).union(gen.stop_token_ids)
        self.max_new_tokens = gen.max_new_tokens
        self.sampler = gen.sampler
        self.cut = StopCutter(gen.stop)          # stop strings, their starts held back
        self.request_id = gen.request_id
        self.choice = gen.choice
        self.top_n = gen.logprobs                 # log-probs on each event (None: off)
        self.texts = TokenTexts(eng.tokenizer) if gen.logprobs is not None else None
        self.logprob = None                       # the sampled token's, for its event
        self.decoder = StreamDecoder(eng.tokenizer) if eng.tokenizer is not None else None
        self.text = ""
        self.stop_reason: Optional[str] = None   # "length" | "eos" | "stop" | "context"
        self.tail = ""              # text after its last token's event (decoder, held back)
        self.n_tokens = 0
        self.last_set = None        # (generation, id) of its last token's expert set
        self.step = 0
        self.t_prev = 0.0
        self._warned_nonfinite = False
        cfg = eng.config
        self.lookup = None                  # the draft (None: plain decoding)
        self.max_draft = cfg.draft_tokens
        if cfg.speculative_decoding == "prompt_lookup" and gen.max_new_tokens > 1:
            self.lookup = PromptLookup(gen.prompt_ids, cfg.draft_ngram_max, cfg.draft_ngram_min)
        self.draft: list[int] = []          # what the running step feeds after `feed`
        self.rounds = self.drafted_total = self.accepted_total = 0
        self.followers: list = []           # jobs of its prompt waiting on its prefill
        # the audit log (audit.py): the prompt's routing, the tokens and their sets
        self.audit = getattr(eng, "audit", None)
        self.sink = eng.model.route_sink if self.audit is not None else None
        self.prompt_routed = False
        self.routes: list = []
        self.out_tokens: list[int] = []
        self.sets: list = []                # [(first token index, es)]
        # a caller's own sampler may wrap a Sampler (`inner`) and mask tokens (`mask`)
        inner = getattr(gen.sampler, "inner", gen.sampler)
        # penalties count this sequence's tokens (sampler.py); None: nothing per token
        self.penalties = getattr(inner, "penalties", None)
        if self.penalties is not None:
            self.penalties.start(gen.prompt_ids)
        self.sampling = getattr(inner, "audit_params", None) if self.audit is not None else None
        mask = getattr(gen.sampler, "mask", None)                # ignore_eos: EOS masked
        if self.sampling is not None and mask is not None and "mask" not in self.sampling:
            self.sampling = {**self.sampling, "mask": [int(t) for t in mask]}

    def ready(self) -> bool:
        return self.feed is not None and self.unacked < self.request._sched.ahead

    @property
    def outcome(self) -> Optional[str]:
        """How the choice ended, as its reader and the hooks see it: its stop_reason once
        it finished, else "error" when its request failed, None when it was cancelled."""
        if self.stop_reason is not None:
            return self.stop_reason
        return "error" if self.request.error is not None else None

    def decode_tokens(self, room: int) -> np.ndarray:
        """The step's tokens: `feed`, then up to `room` draft tokens (none past
        max_new_tokens or the cache's end)."""
        draft = []
        if self.lookup is not None and room > 0:
            limit = min(room, self.max_draft, self.max_new_tokens - self.step - 1,
                        self.cache.capacity - self.cache.length - 1)
            draft = self.lookup.draft(limit)
        self.draft = draft
        if not draft:
            return np.array([self.feed], np.int64)
        return np.array([self.feed] + draft, np.int64)

    def _finish(self, reason: str) -> None:
        self.stop_reason = reason
        if reason != "stop":      # the decoder's tail and what was held back as a stop's start
            self.tail = self.cut.finish(self.decoder.flush() if self.decoder is not None else "")
        self.done = True
        end = self.request.on_choice_end
        if end is not None:
            end(self)

    def after_step(self, logits: np.ndarray, es, final: bool) -> None:
        if self.sink is not None:
            parts = self.sink.take(self.cache)
            if not self.prompt_routed:          # the prompt's chunks; decode rows dropped
                self.routes += parts
                self.prompt_routed = final
        if not final:
            return
        if self.followers:                      # its prompt is complete: theirs too
            self._hand_over(logits, es)
        if self.step >= self.max_new_tokens:
            return self._finish("length")
        draft, self.draft = self.draft, []
        if not draft:
            tok = self._sample(logits)
            if self._emit(tok, es) and self._room():
                self.feed = tok
            return
        # logits [1 + len(draft), V]: row i follows draft[:i]; keep sampling while the
        # sampled token is the draft's
        self.rounds += 1
        self.drafted_total += len(draft)
        fed = self.cache.length - len(draft)      # positions up to the decode token's
        for i, row in enumerate(logits):
            tok = self._sample(row)
            if not self._emit(tok, es):
                return
            if i < len(draft) and tok == draft[i]:
                self.accepted_total += 1
                continue
            self.cache.truncate(fed + i)          # drop the rows of rejected tokens
            break
        if self._room():
            self.feed = tok

    def _hand_over(self, logits: np.ndarray, es) -> None:
        """Its prompt's rows and last logits to the choices of the same prompt that wait
        on them (generate._Stream made them followers): copied, the same bits as
        computing them (batch invariance), so each samples its first token with its own
        sampler as it would alone. One that is not admitted yet, or is pinned to
        another snapshot, computes its prompt itself."""
        rows = None
        for f in self.followers:
            f.waiting = False
            if f.cache is None or f.es is not self.es:
                continue
            if rows is None:
                rows = copy_rows(self.cache, 0, len(self.tokens))
            paste_rows(f.cache, 0, rows)
            f.cache.length = f.fed = len(f.tokens)
            f.after_step(logits.copy(), es, True)     # a sampler may change its logits
        self.followers = []

    def _room(self) -> bool:
        """Whether the cache has a place for the next token (else: finished)."""
        if self.cache.length >= self.cache.capacity:
            self._finish("context")
            return False
        return True

    def _emit(self, tok: int, es) -> bool:
        """One sampled token: EOS, text and stop strings, the event and the token hook.
        -> whether the sequence goes on."""
        if tok in self.eos:
            self._finish("eos")
            return False
        piece = self.decoder.push(tok) if self.decoder is not None else ""
        piece, stop_hit = self.cut.push(piece)
        self.text += piece
        now = time.perf_counter()
        ev = TokenEvent(self.step, tok, piece, es.generation, es.id, now - self.t_prev,
                        self.logprob, self.choice)
        self.t_prev = now
        self.n_tokens += 1
        self.last_set = (es.generation, es.id)
        if self.penalties is not None:
            self.penalties.push(tok)
        if self.audit is not None:
            self.out_tokens.append(tok)
            if not self.sets or self.sets[-1][1] is not es:
                self.sets.append((self.step, es))
        hooks = self.hooks
        if hooks is not None and hooks.token is not None:
            hooks.token(request_id=self.request_id, step=self.step, token_id=tok, text=piece,
                        expert_set_generation=es.generation, expert_set_id=es.id)
        self.request.push(ev, self)
        self.step += 1
        if self.lookup is not None:
            self.lookup.push(tok)
        if stop_hit:
            self._finish("stop")
            return False
        if self.step >= self.max_new_tokens:
            self._finish("length")
            return False
        return True

    def _sample(self, logits: np.ndarray) -> int:
        hooks = self.hooks
        if hooks is not None and hooks.sample is not None:
            got = hooks.sample(logits=logits, request={"id": self.request_id, "k": self.k})
            if got is not None:
                tok = hooks.guard.check_sample(got, self.vocab_size)
                c = self.sampler.constraint
                # a grammar is the request's contract: the plugin's token must fit it (the
                # matcher takes it), else the sampler picks among the grammar's tokens
                if c is None or c.allows(tok):
                    if c is not None:
                        c.advance(tok)
                    if self.top_n is not None:
                        self.logprob = token_logprob(logits, tok, self.top_n, self.texts)
                    return tok
        if not np.isfinite(logits.max()):          # NaN or +Inf somewhere (no temporary array)
            logits = self._finite_logits(logits)
        tok = self.sampler(logits)
        if self.top_n is not None:                 # carried on the token's event
            self.logprob = token_logprob(logits, tok, self.top_n, self.texts)
        return tok

    def _finite_logits(self, logits: np.ndarray) -> np.ndarray:
        """NaN logits never win; +Inf ones always do. All NaN (weights with NaN/Inf, which a
        load does not scan for) is a typed error naming the check to run, not a crash."""
        logits = np.asarray(logits, dtype=np.float64)
        big = np.finfo(np.float64).max / 4
        fixed = np.nan_to_num(logits, nan=-np.inf, posinf=big, neginf=-np.inf)
        if not np.isfinite(fixed).any():
            d = self.model_dir
            raise ModelFormatError(
                f"{d}: the model produced no finite logit at step {self.step} (NaN/Inf in "
                f"its weights?); check it with `colibri inspect {d} --verify`")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("non-finite logits at step %d of %s: NaN ones are never sampled",
                        self.step, self.request_id)
        return fixed
