"""Scoring: many short sequences through the scheduler, prefill only (Engine.score,
Engine.score_batch).

Every scored sequence is pinned to the expert set current at its admission: all of its
prompt chunks run with that one snapshot, so a batch that straddles a hot-plug change is
computed item by item under one set each, and each result names the set that computed
it (`Scored.expert_set`, {generation, id}) -- read from the job, not stamped around the
call. With the audit log on (audit.py), each item is also one line of the log.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from .audit import now_iso, score_lines, set_name
from ..errors import RequestCancelled, RequestError, RequestTooLarge
from ..model.kvcache import check_memory
from .request import Job, Request
from .scheduler import ensure_not_on_thread

_score_ids = itertools.count(1)


class ScoreJob(Job):
    """A scored sequence: its prompt only, pinned; `result` the logits, `es` (set at
    admission) the expert set every chunk of it ran with; `routes` the routing parts
    while the audit is on. Jobs sharing a `box` (an item's candidates) share one set:
    the first of them admitted pins it for all."""

    def __init__(self, request, tokens, k: int, all_logits: bool, sink=None, box=None,
                 tap=None):
        self._box = box if box is not None else [None]
        super().__init__(request, tokens, k, len(tokens), pin=True)
        self.all_logits = all_logits
        self.parts: list = []
        self.result = None
        self.sink = sink
        self.routes: list = []
        self.tap = tap            # the shadow's routing tap (candidates.py), or None
        self.shadow: tuple = ()   # the shadow candidates its routing chose (their names)
        self.hidden: dict = {}    # {layer: its rows' input there} (the tap's, for a shadow)

    @property
    def es(self):
        return self._box[0]

    @es.setter
    def es(self, value) -> None:        # the scheduler's pin at admission: first one wins
        if self._box[0] is None:
            self._box[0] = value
        if getattr(self, "tap", None) is not None and self.cache is not None and self.fed == 0:
            self.tap.want(self.cache)    # admitted: its cache is allocated

    def after_step(self, logits, es, final: bool) -> None:
        if self.sink is not None:
            self.routes += self.sink.take(self.cache)
        if self.all_logits:
            self.parts.append(logits)
        if final:
            if self.tap is not None:
                self.shadow = self.tap.take(self.cache)
                rows = self.tap.take_rows(self.cache, len(self.tokens))   # freed either way
                self.hidden = rows if self.shadow else {}
            self.result = logits if not self.all_logits else (
                self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts, axis=0))
            self.parts = []
            self.done = True


@dataclass
class Scored:
    """One scored sequence: its logits ([V], or [n, V] with all_positions), the expert
    set that computed it ({generation, id}), its k and its token ids; `shadow`: the
    candidates in shadow whose slot its routing chose under the live set (candidates.py);
    `hidden` ({layer: rows}) where it did: its input of their first layers."""
    logits: np.ndarray
    expert_set: dict
    k: int
    tokens: list
    shadow: tuple = ()
    hidden: Optional[dict] = None


class _Closer:
    """What score's `track` receives: close() cancels the request."""

    def __init__(self, req: Request):
        self.close = req.cancel


def score(eng, sequences: Sequence[Sequence[int]], experts_per_token: Optional[int] = None,
          all_positions: bool = False, track: Optional[Callable[[object], None]] = None,
          request_id: Optional[str] = None, groups: Optional[Sequence[int]] = None,
          expert_set=None) -> list[Scored]:
    """Engine.score's body (see Engine.score_batch for the contract). `groups`: one
    label per sequence; sequences with the same label (an item's candidates) run under
    one expert set; `expert_set`: every sequence under that one."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise RequestError(f"sequences of type {type(sequences).__name__}: expected a list "
                           f"of token-id lists")
    if not len(sequences):
        return []
    prepared = []
    for i, seq in enumerate(sequences):
        if isinstance(seq, str):
            raise RequestError(f"sequence {i} is text: score_batch takes token ids "
                               f"(engine.encode(text) gives them)")
        try:
            prepared.append(eng.prepare_ids(seq, reserve=0)[0])
        except RequestError as e:
            raise RequestError(f"sequence {i}: {e}") from None
    total = sum(len(p) for p in prepared)
    cfg = eng.config
    if total > cfg.max_call_tokens:
        raise RequestTooLarge(f"score_batch of {total} tokens: more than max_call_tokens="
                              f"{cfg.max_call_tokens} (engine config); split the call")
    V = eng.model_cfg.vocab_size
    out_rows = total if all_positions else len(prepared)
    check_memory(4 * V * out_rows, f"logits of {out_rows} positions")
    rid = request_id or f"score-{next(_score_ids)}"
    k, _ = eng.choose_k(max(len(p) for p in prepared), experts_per_token, None, {"id": rid})
    ensure_not_on_thread(eng.scheduler, "score_batch")
    audit = eng.audit
    sink = eng.model.route_sink if audit is not None else None
    req = Request(rid)
    if groups is not None and len(groups) != len(prepared):
        raise RequestError(f"groups: {len(groups)} labels for {len(prepared)} sequences")
    boxes: dict = {}
    tap = eng.model.moe_tap if expert_set is None else None
    req.jobs = [ScoreJob(req, p, k, all_positions, sink,
                         [expert_set] if expert_set is not None else
                         None if groups is None else boxes.setdefault(groups[i], [None]), tap)
                for i, p in enumerate(prepared)]
    eng.scheduler.submit(req)
    try:
        if track is not None:
            track(_Closer(req))
        req.wait()
    finally:
        req.cancel()                 # interrupted while waiting: not wanted any more
    if any(j.result is None for j in req.jobs):
        raise RequestCancelled(f"score_batch {rid} was cancelled before it finished")
    out = [Scored(j.result, set_name(j.es), k, p, j.shadow, j.hidden)
           for j, p in zip(req.jobs, prepared)]
    if audit is not None:
        when = now_iso()                 # the call's answer time, one for its items
        # rendered here, not on the writer: a thread of its own took as much CPU and more
        # of the cores the next call's forward needs (measured: 0.90x vs 0.95x)
        audit.put_many(score_lines(rid, [(p, j.es, j.result, j.routes) for j, p in
                                         zip(req.jobs, prepared)], k, all_positions, when))
    return out
