"""The engine's side of expert changes: ChangeApplier (Engine.expert_changes) turns queued
changes -- callables on an ExpertSet, and what the hot-plug manager's drain() returns --
into new expert-set snapshots between two steps; with it, the pieces it uses: an expert set
prepared ahead by the hot-plug worker (PreparedSet), one change applied to a snapshot,
releasing experts once no snapshot uses them, and the ``info`` the colibri_expert_loaded /
_unloaded hooks receive.

It never imports hot-plug: the manager is the engine's (`engine.hotplug`, made by the
composition root), seen here through drain(), release_later(), drop_later() and
flush_releases() (docs/HOTPLUG.md, "API for the engine").
"""
from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections import deque

log = logging.getLogger("colibri")


def expert_info(info: dict, es) -> dict:
    """The ``info`` of colibri_expert_loaded / colibri_expert_unloaded: the hot-plug
    manager's event plus the keys hookspecs.py documents (``expert`` and ``layer`` next
    to the manager's ``slot`` and ``layers``; the generation and id of `es`, the expert
    set with or without it)."""
    layers = [int(L) for L in info.get("layers", ())]
    return {**info, "layers": layers, "expert": info.get("slot"),
            "layer": layers[0] if layers else None, "expert_set_generation": es.generation,
            "expert_set_id": es.id}


def release_all(manager, experts) -> None:
    """Unload experts no snapshot uses any more: queued for the hot-plug worker (this runs
    between two tokens, or wherever the last snapshot holding them died)."""
    for e in experts:
        try:
            manager.release_later(e)
        except Exception as exc:   # never raise from a finalizer
            log.warning("releasing expert %s failed: %s", getattr(e, "name", e), exc)


NO_PLAN = object()       # no prepared tables: the pipeline builds them when it needs them


class PreparedSet:
    """An expert set built ahead (hot-plug worker): `changes` applied to `base` give `es`,
    whose pipeline tables are `plan` (pipeline.Pipeline.prepare; None: none built)."""

    __slots__ = ("base", "changes", "es", "plan", "gone", "never_used", "armed")

    def __init__(self, base, changes, es, plan):
        self.base, self.changes, self.es = base, list(changes), es
        self.plan = NO_PLAN if plan is None else plan
        # What ChangeApplier.apply works out when this entry is the whole change:
        was = {id(h) for h in base.hot_experts()}
        live = {id(h) for h in es.hot_experts()}
        self.gone = [h for h in base.hot_experts() if id(h) not in live]
        seen = {id(h): h for _, e, p in self.changes for h in (e, p) if h is not None}
        self.never_used = [h for i, h in seen.items() if i not in live and i not in was]
        self.armed = [False]     # set when adopted: only then are `gone` released


def release_with(refs: dict, snapshot, manager, experts: list, armed: list) -> None:
    """Release `experts` once `snapshot` is gone, if `armed[0]` is then set (a weakref
    callback, kept in `refs`: lighter than weakref.finalize between two tokens)."""
    def gone(ref, manager=manager, experts=experts, armed=armed, refs=refs):
        refs.pop(id(ref), None)
        if armed[0]:
            release_all(manager, experts)
    ref = weakref.ref(snapshot, gone)
    refs[id(ref)] = (ref, experts)


def release_remaining(refs: dict, manager) -> None:
    """At close (the hot-plug manager closed): release now the experts still waiting for a
    snapshot to die (one a caller keeps, a pinned Generation), and drop the callbacks,
    whose closures kept them alive after close()."""
    waiting = list(refs.values())
    refs.clear()
    for _ref, experts in waiting:
        release_all(manager, experts)


def with_change(es, kind: str, expert, previous):
    """The expert set after one hot-plug change (add | replace | remove)."""
    if previous is not None and set(previous.layers) - set(expert.layers):
        es = es.with_expert(previous, remove=True)
    return es.with_expert(expert, remove=kind == "remove")


def same_changes(expected: list, got: list) -> bool:
    """Whether drain()'s ExpertChanges `got` are the (kind, expert, previous) `expected`."""
    return len(expected) == len(got) and all(
        ch.kind == kind and ch.expert is expert and ch.previous is previous
        for (kind, expert, previous), ch in zip(expected, got))


class ChangeApplier:
    """Engine.expert_changes: the queue of expert changes and their adoption.

    `prepare(changes)` runs on the hot-plug worker (the manager's `prepare` callback),
    `apply()` on the scheduler's thread between two steps, `on_event` wherever the manager
    reports; the engine's `hotplug` (the manager or None) and `hotplug_error` are read
    from the engine, which owns them.
    """

    def __init__(self, engine, history) -> None:
        self.engine = engine
        self.pending: list = []               # callables applied between two tokens
        self.events: deque = deque()          # hot-plug events, fired as hooks on this thread
        # Expert sets (and their pipeline tables) built ahead by the hot-plug worker, one per
        # batch of changes it handed over, each from the one before.
        self.prepared: deque[PreparedSet] = deque()
        self.prepared_lock = threading.Lock()
        self.snapshot_refs: dict = {}         # weakrefs that release experts with a snapshot
        # Hot-plug changes adopted from a set prepared by the worker / built on this thread.
        self.stats = {"prepared": 0, "built_here": 0}
        self.history = history                # hotplug.events.ExpertEvents (INFO lines)

    def on_event(self, kind: str, info: dict) -> None:
        # Called on the hot-plug worker (rejections, already logged there) or inside drain();
        # hooks fire on the engine's thread at the next token boundary.
        self.events.append((kind, info))      # (each event is a new dict)

    def queue(self, change) -> None:
        self.pending.append(change)

    def apply_and_flush(self) -> None:
        self.apply()
        self.flush_releases()            # not on a token's path: unload the replaced now

    def flush_releases(self) -> None:
        """Unload now the hot-plugged experts no snapshot uses any more (the scheduler's
        thread, when requests retire; after apply_and_flush)."""
        hotplug = self.engine.hotplug
        if hotplug is not None:
            hotplug.flush_releases()

    def close(self, abort: bool = False) -> None:
        """Close the engine's hot-plug manager (its worker joined: nothing is prepared
        after), release what waits for a snapshot to die, drop the prepared sets.
        `abort` (a half-built engine): a failing close is logged, nothing released."""
        eng = self.engine
        if eng.hotplug is not None:
            try:
                eng.hotplug.close()
            except Exception as exc:
                if not abort:
                    raise
                log.warning("closing the hot-plug manager failed: %s", exc)
            if not abort:
                release_remaining(self.snapshot_refs, eng.hotplug)
            eng.hotplug = None
        with self.prepared_lock:
            self.prepared.clear()

    def prepare(self, changes: list) -> None:
        """On the hot-plug worker, before it hands a batch of changes to drain(): build the
        expert set they make and its pipeline tables, so that adopting them between two tokens
        is a swap (`apply`). Built on the set the batch before it makes (or the current
        one); checked against what drain() really returns."""
        eng = self.engine
        with self.prepared_lock:
            if eng._closed or eng.model.expert_set is None:
                return
            base = self.prepared[-1].es if self.prepared else eng.model.expert_set
        es = base
        for kind, expert, previous in changes:
            es = with_change(es, kind, expert, previous)
        plan = eng.model.prepare_tables(es)
        entry = PreparedSet(base, changes, es, plan)
        if entry.gone:       # released once `base` is gone, if this entry is adopted
            release_with(self.snapshot_refs, base, eng.hotplug, entry.gone, entry.armed)
        # The young objects made here would otherwise be collected on the scheduler's
        # thread, in the step that adopts them. Now, here.
        gc.collect(1)
        with self.prepared_lock:
            if not eng._closed:
                self.prepared.append(entry)

    def _drain_or_stop(self) -> list:
        """hotplug.drain(), or, when it fails (a bug), no change now nor later: the engine
        keeps serving the set it has rather than failing or stalling every request."""
        eng = self.engine
        try:
            return eng.hotplug.drain()
        except Exception as exc:                 # noqa: BLE001 - logged with its traceback
            eng.hotplug_error = f"{type(exc).__name__}: {exc}"
            log.exception("hot-plug stopped: applying expert changes failed; the engine keeps "
                          "serving expert-set generation %d; restart it to resume hot-plug",
                          eng.model.expert_set.generation)
            return []

    def _take_prepared(self, es, changes: list):
        """(expert set, its plan or NO_PLAN, how many of `changes` that covers, the entry
        when one covers them all): the prepared sets that chain from `es` and match
        `changes` from the start, object for object. Entries that can no longer match are
        dropped. Under prepared_lock."""
        plan, used, first, last = NO_PLAN, 0, None, None
        entries = self.prepared                  # (the caller holds prepared_lock)
        while entries:
            p = entries[0]
            n = len(p.changes)
            if p.base is not es or not same_changes(p.changes, changes[used:used + n]):
                break
            entries.popleft()
            first = first or p
            es, plan, used, last = p.es, p.plan, used + n, p
        if used < len(changes) or (entries and entries[0].base is not es):
            entries.clear()                      # built on a set that will never be current
        whole = None        # the one entry that is the whole change, made on the current set
        if first is last and first is not None and used == len(changes) \
                and first.base is self.engine.model.expert_set:
            whole = first
        return es, plan, used, whole

    def apply(self) -> None:
        """On the scheduler's thread, between two steps: adopt queued expert changes.

        Each change makes a new immutable ExpertSet snapshot with a new version. Replaced
        and removed experts are released (their library unloaded, by the hot-plug worker)
        once no snapshot that uses them is alive: requests that pinned an older snapshot
        keep theirs working. The new snapshot and its pipeline tables were normally built by
        the hot-plug worker already (`prepare`): adopting them is then a swap.
        """
        eng = self.engine
        model, hotplug = eng.model, eng.hotplug
        es = model.expert_set
        plan, whole = NO_PLAN, None
        seen: dict = {}              # every hot expert of this batch's intermediate snapshots
        if self.pending:
            pending, self.pending = self.pending, []
            for change in pending:
                es = change(es)
                seen.update((id(h), h) for h in es.hot_experts())
        # Under prepared_lock from drain() to the swap, so that the hot-plug worker builds
        # its next set on the one this makes.
        with self.prepared_lock:
            if hotplug is not None and eng.hotplug_error is None:
                changes = self._drain_or_stop()
                if changes:
                    es, plan, used, whole = self._take_prepared(es, changes)
                    for ch in changes[used:]:              # not prepared: built here
                        es = with_change(es, ch.kind, ch.expert, ch.previous)
                        plan = NO_PLAN
                    self.stats["prepared"] += used
                    self.stats["built_here"] += len(changes) - used
                    if whole is None:
                        for ch in changes:
                            seen.update((id(h), h) for h in (ch.expert, ch.previous)
                                        if h is not None)
            old = model.expert_set
            if es is not old:
                model.expert_set = es
        if es is not old:
            if plan is not NO_PLAN:
                replaced = model.adopt_tables(es, plan)
                if replaced is not None and hotplug is not None:
                    hotplug.drop_later(replaced)   # freed on the worker, not here
            if whole is not None:        # worked out on the worker: arm its release
                whole.armed[0] = True
                never_used = whole.never_used
            else:
                live = {id(h) for h in es.hot_experts()}
                was = {id(h) for h in old.hot_experts()}
                gone = [h for h in old.hot_experts() if id(h) not in live]
                if gone and hotplug is not None:
                    release_with(self.snapshot_refs, old, hotplug, gone, [True])
                # Adopted and replaced (or removed) within this one batch: no token, no
                # snapshot anyone can hold ever saw it, so it is unloaded (by the worker).
                never_used = [h for i, h in seen.items() if i not in live and i not in was]
            if never_used and hotplug is not None:
                release_all(hotplug, never_used)
        self._fire_events(es)

    def _fire_events(self, es) -> None:
        """The hot-plug events since the last step, recorded with `es` (now live) and
        fired as the colibri_expert_* hooks, on this thread."""
        hooks = self.engine.hooks
        while self.events:
            kind, info = self.events.popleft()
            self.history.record(kind, info, es.generation, es.id)
            hook = {"loaded": hooks.expert_loaded, "unloaded": hooks.expert_unloaded,
                    "rejected": hooks.expert_rejected}.get(kind)
            if hook is None:
                continue
            if kind == "rejected":
                hook(path=str(info.get("path", "")),
                     reason=str(info.get("message") or info.get("reason", "")))
            else:
                hook(info=expert_info(info, self.engine.model.expert_set))
