"""The manager's book: names, slots, versions, the state file, refusals, rollback.

No thread of its own: the worker (intake.py) and the engine's thread (adoption.py) read
and write it under the manager's one lock (`HotplugManager._lock`, an RLock). What it
holds:

    records    name -> NameRecord (slot, current version, history, rolled back, disabled)
    next_slot  the slot the next new name gets (or the slots file's)
    active     name -> the HotExpert drain() made active (written by adoption.py only)
    version    the manager's change count: +1 per change drain() returns
    refused    path -> its refusal, until the file passes or goes (list(), refused())
    restore    after a restart: path -> [(name, version)] active when the engine stopped,
               until that path's first verdict (a refused file keeps that version)
    lock_fd    the state folder's lock while the manager runs

One rule for refusals (docs/HOTPLUG.md, "When a file is refused"): a refused file that
replaces an active expert's file leaves that expert active, and after a restart its last
good version is adopted again from staging (`refuse_file`); every refusal is one log line
`REFUSED_LOG` naming the file and the rule, and a "rejected" event.
"""
from __future__ import annotations

import logging
import os

from ...nesting import json_loads
from .bundle import read_staged, remove_staged, staging_entry
from .errors import (REFUSED_LOG, ExpertRejected, ExpertSecurityError, HotplugError,
                     RollbackError)
from .expert import HotExpert, LoadedExpert
from .listing import manager_rows, resolve_name
from .state import NameRecord, VersionRecord, load_state, lock_state_dir, save_state

log = logging.getLogger("colibri.hotplug")


class Book:
    """What the manager knows by name; `m` is the manager (its settings and its lock)."""

    def __init__(self, m) -> None:
        self.m = m
        self.lock = m._lock
        self.records: dict[str, NameRecord] = {}
        self.next_slot = m.first_slot
        self.active: dict[str, HotExpert] = {}
        self.version = 0
        self.dirty = False
        self.refused: dict[str, dict] = {}
        self.restore: dict[str, list[tuple[str, VersionRecord]]] = {}
        self.lock_fd: int | None = None

    # ------------------------------------------------------------------ the state file
    def open(self) -> None:
        """Lock the state folder, load the state file, delete unreferenced staged copies."""
        self.lock_fd = lock_state_dir(self.m.state_dir)
        try:
            next_slot, self.records = load_state(self.m.state_dir)
            used = [r.slot for r in self.records.values()]
            self.next_slot = max([next_slot or self.m.first_slot, self.m.first_slot,
                                  *(s + 1 for s in used)])
            self.restore = {}
            for name, rec in self.records.items():
                if rec.current is not None and \
                        os.path.dirname(rec.current.source) == self.m.experts_dir:
                    self.restore.setdefault(rec.current.source, []).append(
                        (name, rec.current))
            self.clean_staging()
        except BaseException:
            self.close_file()
            raise

    def close_file(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def save(self) -> None:
        with self.lock:
            records = {k: NameRecord(v.slot, v.current, list(v.history), list(v.rolled_back),
                                     list(v.disabled), v.last)
                       for k, v in self.records.items()}
            next_slot = self.next_slot
        try:
            save_state(self.m.state_dir, next_slot, records)
        except OSError as e:
            log.error("cannot save hot-plug state in %s: %s", self.m.state_dir, e)

    def take_dirty(self) -> bool:
        """Whether the state changed since the last call (the worker then saves it)."""
        with self.lock:
            dirty, self.dirty = self.dirty, False
        return dirty

    # ------------------------------------------------------------------ names and slots
    def slot_for(self, name: str) -> tuple[int, bool]:
        """(`name`'s slot, whether it is new: given now, the state to be saved)."""
        with self.lock:
            new = name not in self.records
            if new:
                slot = self._assigned_slot(name)
                self.records[name] = NameRecord(slot=slot)
                self.next_slot = max(self.next_slot, slot + 1)
                self.dirty = True
            return self.records[name].slot, new

    def forget_name(self, name: str, only_unused: bool = True) -> bool:
        """Forget `name` and its slot: with only_unused, only when no version of it was
        ever adopted here (a candidate's name that never went live; candidates.py, when
        the candidate is dropped or withdrawn). The slot is the next new name's when it
        was the last given. True when forgotten (the state to be saved)."""
        with self.lock:
            rec = self.records.get(name)
            if rec is None or name in self.active or (only_unused and (
                    rec.current or rec.history or rec.last or rec.rolled_back or rec.disabled)):
                return False
            del self.records[name]
            self.next_slot = max([self.m.first_slot,
                                  *(r.slot + 1 for r in self.records.values())])
            self.dirty = True
            return True

    def _assigned_slot(self, name: str) -> int:
        """The slot a name new to this manager gets: the slots file's, else the next."""
        slots_file, next_slot = self.m.slots_file, self.next_slot
        if self.m.assign_slot is not None:      # a candidates' manager: the live one's slots
            return self.m.assign_slot(name)
        if slots_file is None:
            return next_slot
        try:
            with open(slots_file, encoding="utf-8") as f:
                slot = json_loads(f.read()).get(name)
        except (OSError, ValueError, AttributeError) as e:
            log.error("slots file %s unreadable (%s): expert %s gets the next free slot %d",
                      slots_file, e, name, next_slot)
            return next_slot
        taken = {r.slot for r in self.records.values()}
        if not isinstance(slot, int) or slot < self.m.first_slot or slot in taken:
            if slot is not None:
                log.error("slots file %s: slot %r for %s is not a free slot >= %d: it gets "
                          "the next free slot %d", slots_file, slot, name,
                          self.m.first_slot, next_slot)
            return next_slot
        return slot

    def prior(self, path: str, name: str, sha: str):
        """What the book knows of `name` for a checked file of it with `sha`: (the shas of
        its adopted versions, the version kept when `sha` was rolled back from, or None).
        Raises the `disabled` refusal for a version whose helper crashed."""
        with self.lock:
            rec = self.records.get(name)
            known = rec.known_shas() if rec else set()
            if rec is not None and sha in rec.disabled:
                raise ExpertRejected(f"{path}: expert {name} with sha256 {sha[:12]}… was"
                                     " disabled after its helper crashed: expected a new"
                                     " file version", reason="disabled", path=path)
            pinned = rec.current if (rec is not None and sha in rec.rolled_back
                                     and rec.current is not None) else None
            return known, pinned, rec is not None and sha in rec.rolled_back

    def record_adopted(self, expert: HotExpert, loaded: LoadedExpert,
                       cur: HotExpert | None, rollback: bool) -> int:
        """drain() made `expert` active in place of `cur`: the book's side; the version."""
        name = expert.name
        with self.lock:
            rec = self.records[name]
            self.active[name] = expert
            self.version += 1
            if rollback:
                rec.history.pop()
                rec.rolled_back.append(cur.sha256)
                # its file (until it changes or goes) is listed beside the version put back
                self.refused[cur.source_path] = {
                    "path": cur.source_path, "reason": "rolled-back", "sha256": cur.sha256,
                    "message": f"{cur.source_path}: {name} {cur.version} (sha256"
                               f" {cur.sha256[:12]}…) was rolled back: not adopted again;"
                               f" {expert.version} stays active"}
            elif rec.current is not None and rec.current.sha256 != loaded.sha256:
                rec.push_history(rec.current)
            rec.current = rec.last = loaded.record         # made on the worker
            return self.version

    def record_removed(self, expert: HotExpert, crashed: bool) -> int:
        """drain() took `expert` out of the active set: the book's side; the version."""
        with self.lock:
            del self.active[expert.name]
            rec = self.records[expert.name]
            rec.current = None
            if crashed and expert.sha256 not in rec.disabled:
                rec.disabled.append(expert.sha256)
            self.version += 1
            return self.version

    # ------------------------------------------------------------------ refusals
    def reject(self, path: str, err: HotplugError, sha: str | None = None, *,
               record: bool = True, **extra) -> None:
        """One log line naming the file and the rule, a "rejected" event, and (`record`)
        the refusal kept for list()/refused() until the file passes or goes."""
        log.warning(REFUSED_LOG, path, err.reason, err)
        info = {"path": path, "reason": err.reason, "message": str(err), "sha256": sha,
                **extra}
        if record:
            with self.lock:
                self.refused[path] = {k: info[k] for k in ("path", "reason", "message",
                                                           "sha256")}
        self.emit("rejected", info)

    def emit(self, kind: str, info: dict) -> None:
        on_event = self.m.on_event
        if on_event is None:
            return
        try:
            on_event(kind, info)
        except Exception:  # noqa: BLE001 - a broken listener must not stop hot-plugging
            log.exception("hot-plug on_event(%r) listener failed", kind)

    def refuse(self, path: str, e: BaseException, sha: str | None,
               staged: str | None) -> list[LoadedExpert]:
        """Refuse `path` after its checks failed with `e` (refuse_file); its staged copy is
        deleted unless still used. -> the kept versions to queue."""
        if isinstance(e, HotplugError):
            entry = staging_entry(staged) if staged else None
            if entry and str(e).startswith(entry):   # name the file the operator dropped
                inner, sep, rest = str(e)[len(entry):].partition(":")
                e = type(e)(f"{path}{inner} (staged copy sha256 {sha[:12]}…){sep}{rest}",
                            reason=e.reason, path=path)
        elif isinstance(e, OSError):
            e = ExpertRejected(f"{path}: I/O error: {e}", reason="io", path=path)
        else:                             # a bug must refuse one file, not stop the worker
            log.error("hot-plug check of %s failed", path, exc_info=e)
            e = ExpertRejected(f"{path}: internal error while checking it: {e!r}",
                               reason="internal", path=path)
        kept = self.refuse_file(path, e, sha)
        self.m.forget_staged(staged)
        return kept

    def refuse_file(self, path: str, err: HotplugError,
                    sha: str | None = None) -> list[LoadedExpert]:
        """Refuse `path`. The last good version of the expert it replaced stays active: in a
        running manager nothing changes; after a restart it is adopted from staging (the
        returned LoadedExperts, in their slots, for the caller to queue)."""
        self.reject(path, err, sha)
        kept = []
        for name, vrec in self.restored(path, None, keep=True):
            try:
                info = self.recheck_staged(vrec)
                if info.meta.name != name:
                    raise ExpertRejected(f"{vrec.staged}: staged copy of {name} now names"
                                         f" {info.meta.name}", reason="state",
                                         path=vrec.staged)
                loaded = self.m.load_expert(info, vrec.sha256, vrec.staged, path,
                                            vrec.isolation)
            except (HotplugError, OSError) as e:
                if not isinstance(e, HotplugError):
                    e = ExpertRejected(f"{vrec.staged}: cannot read the staged copy of"
                                       f" {name} {vrec.version}: {e}", reason="io",
                                       path=vrec.staged)
                self.reject(vrec.staged, e, vrec.sha256, record=False, name=name)
                with self.lock:
                    rec = self.records.get(name)
                    if rec is not None and rec.current == vrec:
                        rec.current = None
                        self.dirty = True
                continue
            log.info("%s is refused: %s %s stays active (its staged copy, sha256 %s…)",
                     path, name, vrec.version, vrec.sha256[:12])
            with self.lock:
                loaded.materialize(self.records[name].slot)
            kept.append(loaded)
        return kept

    def passed(self, path: str, name: str, held: dict | None = None) -> None:
        """`path` passed the checks (it provides `name`): its refusal, if any, is over
        (`held`: but its bytes were rolled back from; shown beside the version kept)."""
        with self.lock:
            self.refused.pop(path, None)
            if held is not None:
                self.refused[path] = held
        self.restored(path, name)

    def restored(self, path: str, name: str | None, keep: bool = False
                 ) -> list[tuple[str, VersionRecord]]:
        """The first verdict on `path` after a restart: return the versions it provided
        when the engine stopped (to keep them, `keep`), or forget those that it no longer
        provides (deleted, or now another name): they are not active any more."""
        with self.lock:
            entries = self.restore.pop(path, [])
            queued = self.m.queued()
            live = [(n, v) for n, v in entries if n not in self.active
                    and self.records.get(n) is not None and self.records[n].current == v
                    and not any(op[0] == "upsert" and op[1].name == n for op in queued)]
            if keep:
                return live
            for n, v in live:
                if n != name:
                    self.records[n].current = None
                    self.dirty = True
        return []

    def forget_path(self, path: str) -> None:
        """`path` is gone: its refusal with it."""
        with self.lock:
            self.refused.pop(path, None)

    def recheck_staged(self, vrec: VersionRecord):
        """The checks a staged copy gets again when it is adopted without its file (rollback,
        a restart that keeps it): allowlist, metadata against the model. Not the probe."""
        allowlist = self.m.allowlist
        if allowlist is not None and vrec.sha256 not in allowlist:
            raise ExpertSecurityError(f"{vrec.staged}: sha256 {vrec.sha256} is not on the"
                                      " allowlist", reason="allowlist", path=vrec.staged)
        return read_staged(vrec.staged, *self.m._model)

    # ------------------------------------------------------------------ staged copies
    def staged_in_use(self) -> set[str]:
        """The staged copies of every recorded version and every active expert."""
        with self.lock:
            refs = {r.staged for rec in self.records.values()
                    for r in ([rec.current] if rec.current else []) + rec.history}
            refs |= {e.staged_path for e in self.active.values()}
        return refs

    def clean_staging(self) -> None:
        refs = {staging_entry(p) for p in self.m.staged_in_use()}
        staging_dir = self.m.staging_dir
        for n in os.listdir(staging_dir):
            p = os.path.join(staging_dir, n)
            if p not in refs:
                remove_staged(p)

    # ------------------------------------------------------------------ rollback, reading
    def rollback(self, name: str) -> LoadedExpert:
        """The previous version of active expert `name`, loaded in its slot, for drain()
        to adopt (HotplugManager.rollback)."""
        name = resolve_name(self, name)
        with self.lock:
            cur = self.active.get(name)
            rec = self.records.get(name)
            if cur is None or rec is None:
                raise RollbackError(f"expert {name!r} is not active: nothing to roll back")
            if not rec.history:
                raise RollbackError(f"expert {name!r} has no previous version to roll back to")
            target = rec.history[-1]
        try:
            info = self.recheck_staged(target)
        except HotplugError as e:
            log.warning(REFUSED_LOG, target.staged, e.reason, e)
            raise
        loaded = self.m.load_expert(info, target.sha256, target.staged, cur.source_path,
                                    cur.isolation)
        loaded.materialize(rec.slot)
        return loaded

    def rows(self) -> list[dict]:
        return manager_rows(self)

    def refused_rows(self) -> list[dict]:
        with self.lock:
            return [dict(r) for _, r in sorted(self.refused.items())]

    def active_copy(self) -> dict[str, HotExpert]:
        with self.lock:
            return dict(self.active)
