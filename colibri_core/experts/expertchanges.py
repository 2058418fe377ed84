"""Adopting hot-plug changes into expert-set snapshots: the pieces the engine's
apply_expert_changes() uses -- an expert set prepared ahead by the hot-plug worker, one
change applied to a snapshot, releasing experts once no snapshot uses them, and the
``info`` the colibri_expert_loaded / _unloaded hooks receive."""
from __future__ import annotations

import logging
import weakref

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


class Prepared:
    """An expert set built ahead (hot-plug worker): `changes` applied to `base` give `es`,
    whose pipeline tables are `plan` (pipeline.Pipeline.prepare; None: none built)."""

    __slots__ = ("base", "changes", "es", "plan", "gone", "never_used", "armed")

    def __init__(self, base, changes, es, plan):
        self.base, self.changes, self.es = base, list(changes), es
        self.plan = NO_PLAN if plan is None else plan
        # What _apply_expert_changes works out when this entry is the whole change:
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
