"""The manager's engine side: drain(), preview(), release.

What it holds, under the manager's one lock:

    ops       the checked changes handed over by the worker (intake.py) or rollback(),
              in order: ("upsert", LoadedExpert, rollback) | ("delete", path)
    releases  experts release_later() queued: unloaded by the worker's housekeeping
    dropped   objects drop_later() keeps until then (snapshots, decode plans)

drain() runs on the engine's thread between two tokens: everything a change needs was
made on the worker (libraries loaded, helpers started, HotExpert objects made), so it only
moves experts into the book's active set (book.py), counts versions and emits events.
"""
from __future__ import annotations

import logging
from collections import deque

from .errors import RollbackError
from .expert import ExpertChange, HotExpert, LoadedExpert
from .stagedmap import faults, release_each

log = logging.getLogger("colibri.hotplug")


class Adoption:
    def __init__(self, m) -> None:
        self.m = m
        self.lock = m._lock
        self.book = m.book
        self.ops: deque = deque()
        self.releases: list[HotExpert] = []
        self.dropped: list = []

    def queue(self, op: tuple) -> None:
        with self.lock:
            self.ops.append(op)

    def take_ops(self) -> list:
        """Everything queued, taken out (the manager stops)."""
        with self.lock:
            ops = list(self.ops)
            self.ops.clear()
        return ops

    def staged_queued(self) -> set[str]:
        with self.lock:
            return {op[1].staged for op in self.ops if op[0] == "upsert"}

    # ------------------------------------------------------------------ drain
    def drain(self) -> list[ExpertChange]:
        """HotplugManager.drain(): apply queued changes, return them in order."""
        active = self.book.active
        if not (self.ops or faults() or any(e._runner is not None for e in active.values())):
            return []
        changes: list[ExpertChange] = []
        with self.lock:            # the whole drain: preview() never sees half of one
            ops = list(self.ops)
            self.ops.clear()
            for op in ops:
                if op[0] == "upsert":
                    changes += self._apply_upsert(op[1], op[2])
                else:
                    gone = [e for e in active.values() if e.source_path == op[1]]
                    changes += [self._remove(e, "deleted") for e in gone]
            for e in list(active.values()):    # a dead helper, a truncated staged copy
                if not e.alive:
                    changes.append(self._remove(e, "crashed"))
            if changes:
                self.book.dirty = True
                self.m.intake.housekeep_soon(wake=False)
        return changes

    def preview(self, ops: list) -> list[tuple] | None:
        """HotplugManager.preview(): the changes drain() would return for `ops` queued
        after what is queued now; None when it cannot say. No side effect."""
        with self.lock:
            queued = list(self.ops)
            active = dict(self.book.active)
        out: list[tuple] = []
        for i, op in enumerate(queued + list(ops)):
            mine = i >= len(queued)
            if op[0] == "upsert":
                loaded, rollback = op[1], op[2]
                if rollback:
                    return None
                cur = active.get(loaded.name)
                if cur is not None and cur.sha256 == loaded.sha256:
                    continue
                expert = loaded.expert
                if expert is None:
                    return None
                steps = [("add" if cur is None else "replace", expert, cur)]
                active[loaded.name] = expert
                for n, e in list(active.items()):
                    if n != loaded.name and e.source_path == expert.source_path:
                        steps.append(("remove", e, None))
                        del active[n]
            else:
                steps = [("remove", e, None) for e in active.values()
                         if e.source_path == op[1]]
                for _, e, _ in steps:
                    del active[e.name]
            if mine:
                out += steps
        return out

    def _apply_upsert(self, loaded: LoadedExpert, rollback: bool) -> list[ExpertChange]:
        name = loaded.name
        book = self.book
        with self.lock:
            cur = book.active.get(name)
            rec = book.records[name]
        if cur is not None and cur.sha256 == loaded.sha256:
            loaded.discard()
            return []
        if rollback and (cur is None or not rec.history
                         or rec.history[-1].sha256 != loaded.sha256):
            loaded.discard()
            book.reject(loaded.staged, RollbackError(f"{loaded.staged}: rollback of {name}"
                                                     " superseded by a newer change",
                                                     path=loaded.staged),
                        loaded.sha256, record=False, name=name)
            return []
        expert = loaded.materialize(rec.slot)
        version = book.record_adopted(expert, loaded, cur, rollback)
        kind = "replace" if cur is not None else "add"
        if cur is not None:
            cur.status = "replaced"
        book.emit("loaded", {"kind": kind, "name": name, "version": expert.version,
                             "slot": expert.slot, "sha256": expert.sha256,
                             "layers": list(expert.layers), "path": expert.source_path,
                             "staged": expert.staged_path, "isolation": expert.isolation,
                             "previous_version": cur.version if cur else None,
                             "rollback": rollback, "set_version": version,
                             "binding": expert.binding})
        changes = [ExpertChange(kind, expert, cur, version, "rollback" if rollback else "")]
        with self.lock:                      # the file now provides another name
            stale = [e for n, e in book.active.items()
                     if n != name and e.source_path == expert.source_path]
        return changes + [self._remove(e, "renamed") for e in stale]

    def _remove(self, expert: HotExpert, reason: str) -> ExpertChange:
        """Take `expert` out of the active set: reason "deleted" | "renamed" | "crashed"."""
        message = ""
        if reason == "crashed":
            message = expert.dead_reason
            log.error("expert %s %s (slot %d) disabled: %s", expert.name, expert.version,
                      expert.slot, message)
        version = self.book.record_removed(expert, reason == "crashed")
        expert.status = "crashed" if reason == "crashed" else "removed"
        self.book.emit("unloaded", {"name": expert.name, "version": expert.version,
                                    "slot": expert.slot, "layers": list(expert.layers),
                                    "sha256": expert.sha256,
                                    "path": expert.source_path, "reason": reason,
                                    "binding": expert.binding,
                                    "message": message, "set_version": version})
        return ExpertChange("remove", expert, None, version, reason)

    # ------------------------------------------------------------------ release
    def _check_inactive(self, expert: HotExpert) -> None:
        if self.book.active.get(expert.name) is expert:
            raise ValueError(f"expert {expert.name} {expert.version} (slot {expert.slot})"
                             " is still active: release only replaced or removed experts")

    def release(self, expert: HotExpert) -> None:
        with self.lock:
            self._check_inactive(expert)
        expert._release()

    def release_later(self, expert: HotExpert) -> None:
        with self.lock:
            self._check_inactive(expert)
            if self.m.intake.running():
                self.releases.append(expert)
                self.m.intake.housekeep_soon(wake=False)
                return
        expert._release()

    def drop_later(self, obj) -> None:
        with self.lock:
            if self.m.intake.running():
                self.dropped.append(obj)
                self.m.intake.housekeep_soon(wake=False)

    def flush_releases(self) -> None:
        with self.lock:
            dropped, self.dropped = self.dropped, []
        del dropped
        release_each(self.take_releases())

    def take_releases(self) -> list[HotExpert]:
        with self.lock:
            pending, self.releases = self.releases, []
        return pending

    def take_housekeeping(self) -> tuple[list, list]:
        """(releases, dropped) for the worker's housekeeping, taken out."""
        with self.lock:
            releases, self.releases = self.releases, []
            dropped, self.dropped = self.dropped, []
        return releases, dropped
