"""Candidates: new experts tried on live traffic before they serve it all.

A file dropped into the watched folder's `shadow/` subfolder (or uploaded there:
`PUT /v1/experts/candidates/NAME`) is settled, checked, staged, probed and loaded by a
hot-plug manager of its own, exactly as a live expert is, in the slot its name has (or
gets) in the live folder, but it is not joined to the live set. Each candidate gets its
own expert set: the live set with the candidate in its slot (`ExpertSet.candidate` names
it; its generation is the live set's, its id its own), rebuilt when the live set changes.

Life cycle (each step one event in the engine's history, `GET /v1/experts/events`):

    candidate   arrived (or a new version of it): in shadow, fraction 0
    canary      its fraction changed: that share of request ids (a sha256 of the id, so
                the same id always lands in the same place) run on its set
    promote     its file moved into the live folder (the live manager adopts it there)
    drop        its file moved to shadow/dropped/ (the folder keeps it)
    demote      a promotion undone: the live manager's previous version back, or (a new
                name) its file back into shadow/
    withdraw    its file left shadow/ by other hands

In shadow, every item the live set scores is checked against the candidate's router row
at the candidate's first layer (ShadowTap, Model.moe_tap): the items whose routing
chooses the candidate's slot are scored again under its set by the server
(server/candidates.py), the outputs recorded for the gate (gates.py) and never returned.

Threads: apply() and set_for() run on the scheduler's thread (they build sets); the
operations (configure, promote, drop, demote, feedback) on any thread, under `lock`.
Nothing here imports hot-plug: the two managers are handed in by engine.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import weakref

import numpy as np

from .expertchanges import release_all, with_change
from .gates import Gate

log = logging.getLogger("colibri.hotplug")
ACTIVE = ("shadow", "canary")


class CandidateError(ValueError):
    """A candidate operation that cannot be done; `status`: the HTTP status it means."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def canary_point(request_id: str) -> float:
    """Where a request id lands in [0, 1): the first 8 bytes of its sha256."""
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


class Candidate:
    """One candidate: its loaded expert, its state, canary fraction, gate and set."""

    def __init__(self, hot, gate: Gate):
        self.hot, self.name, self.gate = hot, hot.name, gate
        self.state = "shadow"          # shadow | canary | promoted | dropped
        self.fraction = 0.0
        self.es = None                 # its set, built on `built_on` (a live set)
        self.built_on = None
        self.sets: list = []           # weakrefs to every set built with it

    def info(self, **extra) -> dict:
        h = self.hot
        return {"name": h.name, "version": h.version, "slot": h.slot,
                "layers": list(h.layers), "sha256": h.sha256, "binding": h.binding,
                "path": h.source_path, **extra}


class ShadowTap:
    """Model.moe_tap while candidates exist: in each candidate's first layer, under the
    live set only, which tokens' top-k would include the candidate's slot (its router
    row and bias against the live router logits); per KV cache, the candidates any of
    its tokens chose, until its scoring job takes them."""

    def __init__(self):
        self.layers: frozenset = frozenset()
        self.watch: list = []          # (name, layer, router row, bias, slot)
        self.live = None               # the live set the checks run under
        self.step: dict = {}           # name -> chosen [n] bool, this forward
        self.pass_id = -1              # the pass whose rows `step` holds (rows=)
        self.hits: dict = {}           # id(cache) -> (weakref to it, set of names)
        self.keep_layers: frozenset = frozenset()   # the layers whose input rows are kept
        self.rows: dict = {}           # id(cache) -> (weakref, {layer: {start pos: rows}})

    def __call__(self, layer, xn, logits, kt, es, rows=None) -> None:
        """rows=(t0, n, pass): these are rows t0.. of forward pass `pass` of n tokens (a
        pass of several expert sets calls once per run of one set, forward/mixedsets.py;
        what an earlier pass that failed left is dropped)."""
        if es is not self.live:
            return
        if rows is not None and rows[2] != self.pass_id:
            self.step, self.pass_id = {}, rows[2]
        for name, L, row, bias, slot in self.watch:
            if L != layer:
                continue
            mine = xn @ row + np.float32(bias)
            above = (logits > mine[:, None]).sum(axis=1)
            if slot < logits.shape[1]:             # a new version: not against the old one
                above -= logits[:, slot] > mine
            if rows is None:
                self.step[name] = above < kt
                continue
            t0, n, _ = rows
            got = self.step.get(name)
            if got is None or len(got) != n:
                got = self.step[name] = np.zeros(n, bool)
            got[t0:t0 + len(above)] = above < kt

    def done(self, spans) -> None:
        if not self.step:
            return
        hits = self.hits
        if len(hits) > 2 * len(spans) + 256:       # caches nobody took (generations): gone
            for key in [k for k, (r, _) in hits.items() if r() is None]:
                del hits[key]
        for name, chosen in self.step.items():
            for t0, t1, cache in spans:
                if chosen[t0:t1].any():
                    got = hits.get(id(cache))
                    if got is None or got[0]() is not cache:
                        got = hits[id(cache)] = (weakref.ref(cache), set())
                    got[1].add(name)
        self.step = {}

    def want(self, cache) -> None:
        """A scored job's cache (at admission): keep its rows' input of the candidates'
        first layers, so that its shadow pass starts there (server/candidates.py)."""
        if len(self.rows) > 256:                   # caches of jobs that never finished
            for key in [k for k, (r, _) in self.rows.items() if r() is None]:
                del self.rows[key]
        self.rows[id(cache)] = (weakref.ref(cache), {})

    def keep(self, layer: int, x, spans) -> None:
        """Before `layer` runs (forward/pipeline.py): the wanted caches' rows of x, by
        their first position (a pass retried alone overwrites its own)."""
        for t0, t1, cache in spans:
            got = self.rows.get(id(cache))
            if got is not None and got[0]() is cache:
                got[1].setdefault(layer, {})[cache.length] = x[t0:t1].copy()

    def take_rows(self, cache, n: int) -> dict:
        """{layer: [n, H] rows} of a finished job's n positions (the layers kept whole)."""
        got = self.rows.pop(id(cache), None)
        if got is None or got[0]() is not cache:
            return {}
        out = {}
        for layer, parts in got[1].items():
            rows = [parts[p] for p in sorted(parts)]
            if sum(map(len, rows)) == n and all(p == sum(map(len, rows[:i])) for i, p in
                                                 enumerate(sorted(parts))):
                out[layer] = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return out

    def take(self, cache) -> tuple:
        got = self.hits.pop(id(cache), None)
        return tuple(sorted(got[1])) if got is not None and got[0]() is cache else ()


class Candidates:
    """Engine.candidates: `manager` watches `shadow/`, `live` is the engine's manager,
    `history` the engine's ExpertEvents."""

    def __init__(self, engine, manager, live, history):
        self.engine, self.manager, self.live, self.history = engine, manager, live, history
        self.lock = threading.RLock()
        self.entries: dict[str, Candidate] = {}
        self.promoted: dict[str, dict] = {}      # name -> what demote() undoes
        self.gate_defaults = {"threshold": 0.5, "min_positives": 20, "auto": True}
        self.tap = ShadowTap()
        self._refs: dict = {}                    # weakrefs that release retired experts
        self._dirty = False                      # states changed: apply() looks again
        manager.on_event = self.on_event

    @property
    def folder(self) -> str:
        return self.manager.experts_dir

    # ------------------------------------------------------------------ manager side
    def on_event(self, kind: str, info: dict) -> None:
        if kind == "rejected":                   # a refused candidate file: in the history
            self._record("rejected", info)

    def _record(self, kind: str, info: dict) -> None:
        es = self.engine.model.expert_set
        if es is not None:
            self.history.record(kind, info, es.generation, es.id)

    def apply(self) -> None:
        """On the scheduler's thread, between two steps: adopt the candidates' manager's
        changes, (re)build each candidate's set on the live one, set the tap."""
        try:
            changes = self.manager.drain()
        except Exception:  # noqa: BLE001 - candidates stop; the live set keeps serving
            log.exception("candidates: applying the shadow folder's changes failed")
            changes = []
        model = self.engine.model
        live = model.expert_set
        if not changes and live is self.tap.live and not self._dirty:
            return                               # (every step: nothing to do)
        with self.lock:
            self._dirty = False
            gone = set()
            for ch in changes:
                old = self.entries.get(ch.expert.name)
                if old is not None:
                    self._retire(old)
                if ch.kind == "remove":
                    if old is not None and old.state in ACTIVE:
                        self._record("withdraw", old.info(reason=ch.reason or "deleted"))
                    if old is not None and old.state != "promoted":
                        gone.add(ch.expert.name)
                    continue
                entry = self.entries[ch.expert.name] = Candidate(
                    ch.expert, Gate(**self.gate_defaults))
                self._record("candidate", entry.info(
                    previous_version=old.hot.version if old is not None else None))
            for name in gone - set(self.entries):   # dropped or withdrawn, not back
                self._free_slot(name)
            active = [e for e in self.entries.values() if e.state in ACTIVE]
            for e in active:
                if e.built_on is not live:
                    self._build(e, live)
            model.kept_sets = tuple(e.es for e in active)
            tap = self.tap
            tap.live = live
            tap.watch = [(e.name, min(e.hot.layers), np.asarray(e.hot.router_row, np.float32),
                          float(e.hot.router_bias), e.hot.slot) for e in active]
            tap.layers = tap.keep_layers = frozenset(w[1] for w in tap.watch)
            model.moe_tap = tap if tap.watch else None

    def _free_slot(self, name: str) -> None:
        """A candidate that left without going live: the slot its name took in the live
        book goes back (the next new name's), and the shadow book forgets the name too, so
        that a later file of it asks the live book again."""
        try:
            if self.live.book.forget_name(name):        # (a rare event: saved now)
                self.live.book.save()
                if self.manager.book.forget_name(name, only_unused=False):
                    self.manager.book.save()
        except Exception:  # noqa: BLE001 - the slot stays taken; serving goes on
            log.exception("candidates: freeing the slot of %s failed", name)

    def _build(self, e: Candidate, live) -> None:
        prev = next((h for h in live.hot_experts() if h.name == e.name), None)
        es = with_change(live, "replace" if prev is not None else "add", e.hot, prev)
        e.es = dataclasses.replace(es, version=live.version, candidate=e.name)
        e.built_on = live
        e.sets = [r for r in e.sets if r() is not None] + [weakref.ref(e.es)]

    def _retire(self, e: Candidate) -> None:
        """`e` left the manager (replaced, removed): its expert is released once no set
        built with it is alive (a pinned sequence may still run on one)."""
        self.entries.pop(e.name, None)
        alive = [s for s in (r() for r in e.sets) if s is not None]
        e.es = e.built_on = None
        e.sets = []
        if not alive:
            release_all(self.manager, [e.hot])
            return
        left = [len(alive)]

        def gone(ref, hot=e.hot, left=left):
            self._refs.pop(id(ref), None)
            left[0] -= 1
            if left[0] == 0:
                release_all(self.manager, [hot])
        for s in alive:
            ref = weakref.ref(s, gone)
            self._refs[id(ref)] = ref

    def set_for(self, request_id: str):
        """On the scheduler's thread: the set a request runs with (canary fractions,
        in name order, cover [0, sum) of canary_point's range)."""
        live = self.engine.model.expert_set
        with self.lock:
            canary = [e for _, e in sorted(self.entries.items())
                      if e.state == "canary" and e.fraction > 0]
            if not canary:
                return live
            p, edge = canary_point(request_id), 0.0
            for e in canary:
                edge += e.fraction
                if p < edge:
                    if e.built_on is not live:
                        self._build(e, live)
                    return e.es
        return live

    # ------------------------------------------------------------------ operations
    def get(self, name: str) -> Candidate:
        with self.lock:
            e = self.entries.get(name)
        if e is None or e.state not in ACTIVE:
            known = ", ".join(sorted(n for n, x in self.entries.items() if x.state in ACTIVE))
            raise CandidateError(f"no candidate {name!r} (candidates: {known or 'none'})", 404)
        return e

    def configure(self, name: str, fraction=None, **gate) -> dict:
        """Set a candidate's canary fraction (0: shadow only) and gate settings."""
        with self.lock:
            e = self.get(name)
            if fraction is not None:
                others = sum(x.fraction for n, x in self.entries.items()
                             if n != name and x.state == "canary")
                if others + fraction > 1.0:
                    raise CandidateError(f"fraction {fraction}: with the other canaries' "
                                         f"{others:g} the shares would pass 1", 400)
                if fraction != e.fraction:
                    e.fraction = float(fraction)
                    e.state = "canary" if fraction > 0 else "shadow"
                    self._dirty = True
                    self._record("canary", e.info(message=f"fraction {fraction:g}"))
            for k, v in gate.items():
                if v is not None:
                    setattr(e.gate, k, type(getattr(e.gate, k))(v))
            return self.row(e)

    def promote(self, name: str, why: str = "api") -> dict:
        """Move its file into the live folder: the live manager adopts it there (its
        usual checks and probe), replacing the live version of the name if any."""
        with self.lock:
            e = self.get(name)
            src = e.hot.source_path
            previous = self.live.active().get(name)
            # over the live version's own file, if any: one file per name in the folder
            dest = previous.source_path if previous is not None else \
                os.path.join(self.live.experts_dir, os.path.basename(src))
            os.replace(src, dest)
            e.state = "promoted"
            self._dirty = True
            e.fraction = 0.0
            self.promoted[name] = {"file": dest, "shadow": src,
                                   "previous_version": previous.version if previous else None}
            self._record("promote", e.info(reason=why, path=dest, message=self._why(e, why)))
            return self.row(e)

    def drop(self, name: str, why: str = "api") -> dict:
        """Move its file to shadow/dropped/ (kept, never adopted from there)."""
        with self.lock:
            e = self.get(name)
            src = e.hot.source_path
            kept = os.path.join(self.folder, "dropped")
            os.makedirs(kept, mode=0o700, exist_ok=True)
            dest = os.path.join(kept, os.path.basename(src))
            os.replace(src, dest)
            e.state = "dropped"
            self._dirty = True
            e.fraction = 0.0
            self._record("drop", e.info(reason=why, path=dest, message=self._why(e, why)))
            return self.row(e)

    def demote(self, name: str) -> dict:
        """Undo a promotion: the previous live version back (the live manager's
        rollback), or for a name new to the live set its file back into shadow/."""
        with self.lock:
            p = self.promoted.get(name)
            if p is None:
                raise CandidateError(f"{name!r} was not promoted by this server: nothing "
                                     f"to demote (GET /v1/experts lists candidates)", 404)
            if p["previous_version"] is not None:
                self.live.rollback(name)
                what = f"previous version {p['previous_version']} back"
            else:
                if not os.path.exists(p["file"]):
                    raise CandidateError(f"{p['file']}: the promoted file is gone", 409)
                os.replace(p["file"], p["shadow"])
                what = "its file back in shadow/"
            del self.promoted[name]
            self._record("demote", {"name": name, "path": p["file"], "message": what})
            return {"name": name, "status": "demoted", "detail": what}

    @staticmethod
    def _why(e: Candidate, why: str) -> str | None:
        if why != "gate":
            return None
        fb = e.gate.feedback()
        c, v = fb["candidate"], fb["live"]
        return (f"gate: {fb['positives']} labelled positives; candidate recall "
                f"{c['recall']:.3f} precision {c['precision']:.3f}, live recall "
                f"{v['recall']:.3f} precision {v['precision']:.3f}")

    def feedback(self, labels: list[tuple[str, int, bool]]) -> dict:
        """Labelled items (request id, item index, positive) for every candidate's gate;
        then each gate with `auto` whose rule has a verdict promotes or drops its
        candidate (an event each, reason "gate")."""
        with self.lock:
            entries = [e for e in self.entries.values() if e.state in ACTIVE]
        known = 0
        for rid, item, y in labels:
            hit = [e.gate.label((rid, item), y) for e in entries]
            known += any(hit)
        decided = {}
        for e in entries:
            verdict = e.gate.verdict() if e.gate.auto else None
            if verdict is not None:
                try:
                    (self.promote if verdict == "promote" else self.drop)(e.name, "gate")
                    decided[e.name] = verdict
                except (CandidateError, OSError) as exc:
                    log.error("gate of candidate %s: %s failed: %s", e.name, verdict, exc)
        return {"received": len(labels), "matched": known, "decisions": decided}

    # ------------------------------------------------------------------ reading
    def active(self) -> list[Candidate]:
        with self.lock:
            return [e for e in self.entries.values() if e.state in ACTIVE]

    def row(self, e: Candidate) -> dict:
        es = e.es
        return {**e.info(), "state": e.state, "fraction": e.fraction,
                "expert_set": None if es is None else
                {"generation": es.generation, "id": es.id, "candidate": e.name},
                "gate": e.gate.report()}

    def rows(self) -> list[dict]:
        with self.lock:
            entries = list(self.entries.values())
        return [self.row(e) for e in sorted(entries, key=lambda e: e.name)]

    def close(self) -> None:
        """Stop the candidates' manager and release its experts (the engine is done)."""
        model = self.engine.model
        if model is not None:
            model.moe_tap, model.kept_sets = None, ()
        with self.lock:
            self.entries.clear()
        self._refs.clear()
        self.manager.close()
