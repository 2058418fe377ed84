"""HotplugManager: the watched experts folder -> checked, probed experts -> drain().

Threads, one job each:

    watch (watcher.py)   queues paths, and whether each arrived complete   never touches a file
    worker               settle -> check -> stage -> (probe) -> load -> prepare   milliseconds
    probe pool reader    hands probe results back to the worker (probepool.py)
    engine (caller)      drain(): swaps prepared changes in, between 2 tokens   microseconds

Per file: a file that arrived by rename or was closed after writing is checked at once when
it is a complete ELF; any other (and one that is not complete yet) waits until its
size/mtime/ctime/inode are unchanged for `settle_s`. The checks: refuse it when it is a
symlink, group/world-writable, foreign-owned, not a regular file (opened O_NOFOLLOW |
O_NONBLOCK and fstat'ed first: a FIFO never blocks) or not a complete ELF; copy it to the
private staging folder as `<sha256>.so` (hashing while copying); refuse a hash not on the
allowlist; read and check the metadata of the staged copy against the host and the model;
probe it in a separate process (skipped for a hash this name already adopted): up to
`probe_slots` probes run at once in children of a warm helper, and the worker goes on with
other files meanwhile; map its data, load it (dlopen RTLD_NOW, in-process) or start its
helper (isolated), make its HotExpert. The checked files are then handed to drain() in
batches: before a batch is handed over, `prepare(changes)` (the engine's) is called on the
worker with the changes drain() will return for it, so that the new expert set can be built
off the engine thread. drain() turns the queue into ExpertChange objects in order.

Order: one path is checked at a time (events for a path whose probe runs wait for it), and
one file per expert name is probed at a time, so the changes of one name come out in the
order their files were checked; files of other names do not wait for each other.

An expert's identity is its metadata `name`: a file whose name is already active replaces
it (same slot); deleting the file an active expert came from removes it. A bundle folder
`NAME.expert/` (bundle.py) is checked, staged and adopted like a file.

One rule for refusals (docs/HOTPLUG.md, "When a file is refused"): a refused file that
replaces an active expert's file leaves that expert active, and after a restart its last
good version is adopted again from staging; list() shows the refusal beside it; a folder
refused for its permissions is looked at again until it passes, then rescanned; every
refusal is one log line `REFUSED_LOG` naming the file and the rule.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from typing import Callable, Iterable

from .bundle import (bundle_sig, is_bundle_name, read_staged, remove_staged, stage_bundle,
                     staging_entry)
from ...nesting import json_loads
from .elf import ElfFile
from .errors import (REFUSED_LOG, ExpertIncomplete, ExpertRejected, ExpertSecurityError,
                     HotplugError, RollbackError)
from .expert import INPROCESS, ISOLATION_MODES, ExpertChange, HotExpert, PreparedExpert
from .probe import interpret
from .probepool import ProbePool
from .staging import (FileChanged, FileSig, check_file, check_folder, ensure_private_dir,
                      open_source, stage_file)
from .listing import manager_rows, resolve_name
from .stagedmap import faults, release_each
from .state import NameRecord, VersionRecord, load_state, lock_state_dir, save_state
from .watcher import FolderWatcher, is_expert_name, isolation_from_name

log = logging.getLogger("colibri.hotplug")
RECHECK_S = 0.5    # how often the idle worker looks at a refused folder, and at bundles
UNBOUND_LOG = ("%s: expert %s %s records no base model (metadata ABI 1, or a bundle without"
               " base_model): adopted unbound, unchecked against this model; rebuild it for"
               " this model (`colibri expert build --config NAME`) or mark it portable")

EventCallback = Callable[[str, dict], None]
PrepareCallback = Callable[[list], None]
HOUSEKEEPING_DELAY_S = 0.02   # state save and unloads wait this long after a change
IDLE_WAKE_S = 0.1             # an idle worker looks for such work this often
PUBLISH_PAUSE_S = 0.002       # between preparing a batch and handing it to drain()


class _Probing:
    """A file whose probe runs: what its check found, for when the verdict comes back."""

    __slots__ = ("path", "sig", "info", "sha", "staged")

    def __init__(self, path, sig, info, sha, staged):
        self.path, self.sig, self.info, self.sha, self.staged = path, sig, info, sha, staged



class HotplugManager:
    """Watches `experts_dir` and hands adopted experts to the engine through drain().

    Arguments:
        experts_dir: the watched folder (`experts_so/` by default in the engine).
        hidden_size: the model's hidden size; experts must match it.
        moe_layers: global indices of the model's MoE layers; targets must be among them.
        first_slot: the model's num_experts; hot experts get slots first_slot, first_slot+1...
        state_dir: private folder for the state file and the staging copies (made 0700).
        allowlist: sha256 hex digests allowed to load (None: no allowlist).
        isolation_default: "inprocess" or "isolated" for the folder; a file named
            `*.isolated.so` / `*.inprocess.so` overrides it.
        probe_timeout_s: limit of the out-of-process probe, and of one isolated call.
        settle_s: how long a file must stay unchanged before it is checked (files that
            arrived by rename or were closed after writing do not wait).
        on_event: callback(kind, info) with kind "loaded" | "rejected" | "unloaded".
        watch: False to skip the watch (then call rescan() yourself).
        isolated_capacity: rows of an isolated expert's shared buffers.
        probe_slots: probes run at once (in children of one warm helper process).
        prepare: callback(changes), called on the worker thread before checked files are
            handed to drain(), with the [(kind, expert, previous), ...] drain() will return
            for them (unless another change comes first): the engine builds the next expert
            set and its decode plan there. It must not call back into drain().
        polling: watch the folder by polling (every file then waits to settle) instead
            of inotify, e.g. on a network filesystem.
        slots_file: JSON {name: slot}, read when a name first gets a slot: a name listed
            there gets that slot (a fleet's registry assigns them, so that every replica
            numbers its experts alike), any other the next free one.
        model_fingerprint: the model's (fingerprint.py): an expert built for another model
            is refused (`base-model`) unless portable; None: not checked.
    """

    def __init__(self, experts_dir: str | os.PathLike, hidden_size: int,
                 moe_layers: Iterable[int], first_slot: int, state_dir: str | os.PathLike,
                 allowlist: Iterable[str] | None = None, isolation_default: str = INPROCESS,
                 probe_timeout_s: float = 5.0, settle_s: float = 0.2,
                 on_event: EventCallback | None = None, *, watch: bool = True,
                 isolated_capacity: int = 64, probe_slots: int = 2,
                 prepare: PrepareCallback | None = None, polling: bool = False,
                 slots_file: str | os.PathLike | None = None,
                 model_fingerprint: str | None = None):
        if isolation_default not in ISOLATION_MODES:
            raise ValueError(f"isolation_default {isolation_default!r}, expected one of"
                             f" {ISOLATION_MODES}")
        if int(probe_slots) < 1:
            raise ValueError(f"probe_slots {probe_slots!r}, expected at least 1")
        self.experts_dir = os.path.abspath(os.fspath(experts_dir))
        self.hidden_size = int(hidden_size)
        self.moe_layers = frozenset(int(v) for v in moe_layers)
        self.model_fingerprint = model_fingerprint
        self._model = (self.hidden_size, self.moe_layers, model_fingerprint)  # read_staged
        self.first_slot = int(first_slot)
        self.state_dir = os.path.abspath(os.fspath(state_dir))
        self.staging_dir = os.path.join(self.state_dir, "staging")
        self.allowlist = None if allowlist is None else frozenset(s.lower() for s in allowlist)
        self.isolation_default = isolation_default
        self.probe_timeout_s = float(probe_timeout_s)
        self.settle_s = float(settle_s)
        self.on_event = on_event
        self.watch = watch
        self.isolated_capacity = isolated_capacity
        self.probe_slots = int(probe_slots)
        self.prepare = prepare
        self.polling = polling
        self.slots_file = None if slots_file is None else os.fspath(slots_file)

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._requests: dict[str, bool] = {}   # path -> arrived complete; queued, in order
        self._settling: dict[str, tuple[FileSig, float]] = {}
        self._arrived: set[str] = set()        # settling paths to check at once if complete
        self._seen: dict[str, FileSig] = {}           # last checked signature per path
        self._busy = False
        self._probing: dict[str, _Probing] = {}       # path -> its probe (running or queued)
        self._parked: dict[str, bool] = {}     # events for a path whose probe runs
        self._name_probing: dict[str, str] = {}       # expert name -> path being probed
        self._name_waiting: dict[str, list[str]] = {}  # paths waiting for that probe
        self._probed: deque = deque()          # (_Probing, raw, error) from the pool
        self._batch: list = []                 # checked ops not yet handed to drain()
        self._releases: list[HotExpert] = []   # release_later(): unloaded by the worker
        self._dropped: list = []               # drop_later(): freed by the worker
        self._housekeep_at: float | None = None
        self._probes: ProbePool | None = None
        self._ops: deque = deque()     # ("upsert", PreparedExpert, rollback) | ("delete", path)
        self._active: dict[str, HotExpert] = {}       # name -> expert (mutated by drain)
        self._records: dict[str, NameRecord] = {}
        self._next_slot = self.first_slot
        self._version = 0
        self._dirty = False
        self._stopping = False
        self._worker: threading.Thread | None = None
        self._watcher: FolderWatcher | None = None
        self._lock_fd: int | None = None
        self._refused: dict[str, dict] = {}   # path -> its refusal, until it passes or goes
        self._folder_refused = False          # a file was refused for the folder's sake
        self._bundles: set[str] = set()       # bundle folders checked: their files are polled
        # after a restart: path -> [(name, version record)] active when the engine stopped;
        # consumed by the path's first verdict (a refused file keeps that version)
        self._restore: dict[str, list[tuple[str, VersionRecord]]] = {}

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Load the state, check the folder, start the probe helper, the worker and the
        watch, scan the folder.

        Raises ExpertSecurityError when the folder itself is refused (symlink, writable by
        group/others, foreign owner), HotplugStateError for an unusable state folder.
        """
        if self._lock_fd is not None:
            raise RuntimeError(f"hot-plug manager for {self.experts_dir} is already started")
        ensure_private_dir(self.state_dir)
        ensure_private_dir(self.staging_dir)
        try:
            check_folder(self.experts_dir)
        except ExpertSecurityError as e:
            self._reject(self.experts_dir, e)
            raise
        self._lock_fd = lock_state_dir(self.state_dir)
        try:
            self._load()
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise
        self._stopping = False
        self._probes = ProbePool(self.probe_slots, cwd=self.staging_dir)
        self._probes.start()
        self._worker = threading.Thread(target=self._work, name="colibri-hotplug-worker",
                                        daemon=True)
        self._worker.start()
        if self.watch:
            self._watcher = FolderWatcher(
                self.experts_dir, lambda path, arrived: self._request(path, arrived=arrived),
                on_overflow=self.rescan, polling=self.polling)
            self._watcher.start()
        self.rescan()

    def _load(self) -> None:
        next_slot, self._records = load_state(self.state_dir)
        used = [r.slot for r in self._records.values()]
        self._next_slot = max([next_slot or self.first_slot, self.first_slot,
                               *(s + 1 for s in used)])
        self._restore = {}
        for name, rec in self._records.items():
            if rec.current is not None and \
                    os.path.dirname(rec.current.source) == self.experts_dir:
                self._restore.setdefault(rec.current.source, []).append((name, rec.current))
        self._clean_staging()

    def stop(self) -> None:
        """Stop the watcher and the worker and save the state. Active experts stay usable."""
        if self._lock_fd is None:
            return
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=30.0)
            self._worker = None
        if self._probes is not None:
            self._probes.close()          # kills the helper and any probe still running
            self._probes = None
        with self._lock:
            pending = [op[1] for op in list(self._ops) + self._batch if op[0] == "upsert"]
            self._ops.clear()
            self._batch.clear()
            probing = list(self._probing.values())
            self._probing.clear()
            self._probed.clear()
            self._parked.clear()
            self._name_probing.clear()
            self._name_waiting.clear()
        for prep in pending:
            prep.discard()
        for p in probing:
            self._forget_staged(p.staged)
        self.flush_releases()
        self._save_state()
        os.close(self._lock_fd)
        self._lock_fd = None

    def close(self) -> None:
        """stop(), then release every active expert (the engine must be done with them)."""
        self.stop()
        with self._lock:
            experts = list(self._active.values())
            self._active.clear()
        for e in experts:
            e._release()

    def rescan(self) -> None:
        """Queue every expert file of the folder and every vanished source (e.g. at start)."""
        try:
            names = os.listdir(self.experts_dir)
        except OSError as e:
            log.error("cannot list %s: %s", self.experts_dir, e)
            return
        for n in sorted(names):
            if is_expert_name(n):
                self._request(os.path.join(self.experts_dir, n), force=True)
        with self._lock:
            sources = [e.source_path for e in self._active.values()] + list(self._restore)
        for src in sources:
            if not os.path.lexists(src):
                self._request(src, force=True)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued path was checked and probed, and what passed was handed
        to drain() (e.g. the initial scan). True if idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._requests or self._settling or self._busy or self._probing
                   or self._probed or self._batch):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    # ------------------------------------------------------------------ engine side
    @property
    def version(self) -> int:
        """Expert-set version: +1 per applied change (stamp tokens with it)."""
        return self._version

    def drain(self) -> list[ExpertChange]:
        """Apply queued changes; return them in order. Call on the engine thread between tokens.

        Everything the changes need was made on the worker (libraries loaded, helpers
        started, HotExpert objects made): this only moves them into the active set, counts
        versions and emits events. Isolated experts whose helper died are removed here
        (kind "remove", reason "crashed"). The state file is saved by the worker a moment
        later.
        """
        if not (self._ops or faults() or any(e._runner is not None for e in self._active.values())):
            return []
        changes: list[ExpertChange] = []
        with self._lock:            # the whole drain: preview() never sees half of one
            ops = list(self._ops)
            self._ops.clear()
            for op in ops:
                if op[0] == "upsert":
                    changes += self._apply_upsert(op[1], op[2])
                else:
                    gone = [e for e in self._active.values() if e.source_path == op[1]]
                    changes += [self._remove(e, "deleted") for e in gone]
            for e in list(self._active.values()):    # a dead helper, a truncated staged copy
                if not e.alive:
                    changes.append(self._remove(e, "crashed"))
            if changes:
                self._dirty = True
                self._housekeep_soon(wake=False)
        return changes

    def preview(self, ops: list) -> list[tuple] | None:
        """The changes drain() would return for `ops` queued after what is queued now:
        [(kind, expert, previous), ...] with the same objects; None when it cannot say
        (a rollback among them). No side effect."""
        with self._lock:
            queued = list(self._ops)
            active = dict(self._active)
        out: list[tuple] = []
        for i, op in enumerate(queued + list(ops)):
            mine = i >= len(queued)
            if op[0] == "upsert":
                prep, rollback = op[1], op[2]
                if rollback:
                    return None
                cur = active.get(prep.name)
                if cur is not None and cur.sha256 == prep.sha256:
                    continue
                expert = prep.expert
                if expert is None:
                    return None
                steps = [("add" if cur is None else "replace", expert, cur)]
                active[prep.name] = expert
                for n, e in list(active.items()):
                    if n != prep.name and e.source_path == expert.source_path:
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

    def release(self, expert: HotExpert) -> None:
        """The engine no longer uses `expert` (a replaced or removed one): unload it."""
        with self._lock:
            if self._active.get(expert.name) is expert:
                raise ValueError(f"expert {expert.name} {expert.version} (slot {expert.slot})"
                                 " is still active: release only replaced or removed experts")
        expert._release()

    def release_later(self, expert: HotExpert) -> None:
        """release(), with the unloading (dlclose, helper stop) done by the worker a moment
        later, off the caller's thread (the engine's token path); at once when the worker
        does not run. flush_releases() does the pending ones now."""
        with self._cond:
            if self._active.get(expert.name) is expert:
                raise ValueError(f"expert {expert.name} {expert.version} (slot {expert.slot})"
                                 " is still active: release only replaced or removed experts")
            if self._worker is not None and not self._stopping:
                self._releases.append(expert)
                self._housekeep_soon(wake=False)
                return
        expert._release()

    def drop_later(self, obj) -> None:
        """Keep `obj` until the worker's next housekeeping, so that freeing it (and what
        dies with it: an expert-set snapshot and its decode plan, their finalizers) happens
        on the worker, not between two tokens. Dropped at once when the worker does not
        run."""
        with self._cond:
            if self._worker is not None and not self._stopping:
                self._dropped.append(obj)
                self._housekeep_soon(wake=False)

    def flush_releases(self) -> None:
        """Now, on the caller's thread: free what drop_later() holds, then unload what
        release_later() queued (including what that freeing released)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        del dropped
        release_each(self._take_releases())

    def _take_releases(self) -> list[HotExpert]:
        with self._lock:
            pending, self._releases = self._releases, []
        return pending

    def rollback(self, name: str) -> None:
        """Queue a replace of active expert `name` by its previous version (next drain()).

        Raises RollbackError when `name` is not active or has no previous version, or an
        ExpertRejected subclass when the previous staged file no longer passes the checks.
        The version rolled back from is not adopted again from the folder (a new file is).
        `name` may also be the file (in the watched folder) the expert came from.
        """
        name = resolve_name(self, name)
        with self._lock:
            cur = self._active.get(name)
            rec = self._records.get(name)
            if cur is None or rec is None:
                raise RollbackError(f"expert {name!r} is not active: nothing to roll back")
            if not rec.history:
                raise RollbackError(f"expert {name!r} has no previous version to roll back to")
            target = rec.history[-1]
        try:
            info = self._recheck_staged(target)
        except HotplugError as e:
            log.warning(REFUSED_LOG, target.staged, e.reason, e)
            raise
        prep = self._prepare(info, target.sha256, target.staged, cur.source_path,
                             cur.isolation)
        prep.materialize(rec.slot)
        with self._lock:
            self._ops.append(("upsert", prep, True))

    def list(self) -> list[dict]:
        """Rows for `colibri experts list`: active experts, then known inactive names
        (listing.py)."""
        return manager_rows(self)

    def refused(self) -> list[dict]:
        """The files refused now (path, reason, message, sha256), by path: each stays listed
        until the file passes the checks or is deleted (a newer file rolled back from is
        listed too, reason `rolled-back`)."""
        with self._lock:
            return [dict(r) for _, r in sorted(self._refused.items())]

    def active(self) -> dict[str, HotExpert]:
        """name -> active HotExpert (a snapshot)."""
        with self._lock:
            return dict(self._active)

    # ------------------------------------------------------------------ apply (engine thread)
    def _apply_upsert(self, prep: PreparedExpert, rollback: bool) -> list[ExpertChange]:
        name = prep.name
        with self._lock:
            cur = self._active.get(name)
            rec = self._records[name]
        if cur is not None and cur.sha256 == prep.sha256:
            prep.discard()
            return []
        if rollback and (cur is None or not rec.history
                         or rec.history[-1].sha256 != prep.sha256):
            prep.discard()
            self._reject(prep.staged, RollbackError(f"{prep.staged}: rollback of {name}"
                                                    " superseded by a newer change",
                                                    path=prep.staged),
                         prep.sha256, record=False, name=name)
            return []
        expert = prep.materialize(rec.slot)
        vrec = prep.record                    # made on the worker
        with self._lock:
            self._active[name] = expert
            self._version += 1
            if rollback:
                rec.history.pop()
                rec.rolled_back.append(cur.sha256)
                # its file (until it changes or goes) is listed beside the version put back
                self._refused[cur.source_path] = {
                    "path": cur.source_path, "reason": "rolled-back", "sha256": cur.sha256,
                    "message": f"{cur.source_path}: {name} {cur.version} (sha256"
                               f" {cur.sha256[:12]}…) was rolled back: not adopted again;"
                               f" {expert.version} stays active"}
            elif rec.current is not None and rec.current.sha256 != prep.sha256:
                rec.push_history(rec.current)
            rec.current = rec.last = vrec
            version = self._version
        kind = "replace" if cur is not None else "add"
        if cur is not None:
            cur.status = "replaced"
        self._emit("loaded", {"kind": kind, "name": name, "version": expert.version,
                              "slot": expert.slot, "sha256": expert.sha256,
                              "layers": list(expert.layers), "path": expert.source_path,
                              "staged": expert.staged_path, "isolation": expert.isolation,
                              "previous_version": cur.version if cur else None,
                              "rollback": rollback, "set_version": version,
                              "binding": expert.binding})
        changes = [ExpertChange(kind, expert, cur, version, "rollback" if rollback else "")]
        with self._lock:                      # the file now provides another name
            stale = [e for n, e in self._active.items()
                     if n != name and e.source_path == expert.source_path]
        return changes + [self._remove(e, "renamed") for e in stale]

    def _remove(self, expert: HotExpert, reason: str) -> ExpertChange:
        """Take `expert` out of the active set: reason "deleted" | "renamed" | "crashed"."""
        message = ""
        if reason == "crashed":
            message = expert.dead_reason
            log.error("expert %s %s (slot %d) disabled: %s", expert.name, expert.version,
                      expert.slot, message)
        with self._lock:
            del self._active[expert.name]
            rec = self._records[expert.name]
            rec.current = None
            if reason == "crashed" and expert.sha256 not in rec.disabled:
                rec.disabled.append(expert.sha256)
            self._version += 1
            version = self._version
        expert.status = "crashed" if reason == "crashed" else "removed"
        self._emit("unloaded", {"name": expert.name, "version": expert.version,
                                "slot": expert.slot, "layers": list(expert.layers),
                                "sha256": expert.sha256,
                                "path": expert.source_path, "reason": reason,
                                "binding": expert.binding,
                                "message": message, "set_version": version})
        return ExpertChange("remove", expert, None, version, reason)

    # ------------------------------------------------------------------ worker
    def _request(self, path: str, force: bool = False, arrived: bool = False) -> None:
        """Called by the watch's thread (and rescan): queue a path, nothing else.
        `arrived`: it was renamed in or closed after writing (checked at once if complete)."""
        with self._cond:
            if force:
                self._seen.pop(path, None)
            self._requests[path] = self._requests.get(path, False) or arrived
            self._cond.notify_all()

    def _housekeep_soon(self, wake: bool = True) -> None:
        """State save / unloads due: done by the worker HOUSEKEEPING_DELAY_S from now, not
        during the token that adopted the change (several changes make one save). From the
        engine's token path (`wake` False) the worker is not woken: it looks every
        IDLE_WAKE_S."""
        if self._housekeep_at is None:
            self._housekeep_at = time.monotonic() + HOUSEKEEPING_DELAY_S
            if wake:
                self._cond.notify_all()

    def _work(self) -> None:
        tick = max(0.005, min(self.settle_s / 4, 0.05))
        batch: list = []
        next_recheck = 0.0
        while True:
            with self._cond:
                if batch:      # hand the prepared batch over, then block at once: the
                    self._ops.extend(batch)       # token that adopts it runs clear of us
                    batch = []
                    self._cond.notify_all()
                self._busy = False
                if (self._settling and not self._requests and not self._stopping
                        and not self._probed):
                    self._cond.wait(tick)
                while not (self._stopping or self._requests or self._settling
                           or self._probed or self._housekeeping_due()):
                    now = time.monotonic()
                    if (self._folder_refused or self._bundles) and now >= next_recheck:
                        next_recheck = now + RECHECK_S
                        if self._recheck():
                            continue                  # it queued paths
                    wait = IDLE_WAKE_S
                    if self._housekeep_at is not None:
                        wait = max(0.0, min(wait, self._housekeep_at - now))
                    self._cond.wait(wait)
                if self._stopping:
                    return
                self._busy = True
                if self._requests:
                    now = time.monotonic()
                    for path, arrived in self._requests.items():
                        if path in self._probing:     # its probe runs: wait for the verdict
                            self._parked[path] = self._parked.get(path, False) or arrived
                            continue
                        self._settling[path] = (None, now)
                        if arrived:
                            self._arrived.add(path)
                    self._requests.clear()
                probed = list(self._probed)
                self._probed.clear()
                housekeeping = self._housekeeping_due()
                if housekeeping:
                    self._housekeep_at = None
                    dirty, self._dirty = self._dirty, False
                    releases, self._releases = self._releases, []
                    dropped, self._dropped = self._dropped, []
            if housekeeping:
                del dropped                   # snapshots, plans: freed here, finalizers run
                releases += self._take_releases()
                release_each(releases)        # emptied: this frame keeps no expert alive
                if dirty:
                    self._save_state()
            try:
                for item in probed:
                    self._verdict(*item)
                self._settle_round()
            except Exception:  # noqa: BLE001 - the worker must survive anything
                log.exception("hot-plug worker error")
            batch = self._prepare_batch()     # handed over at the top of the loop

    def _housekeeping_due(self) -> bool:
        return self._housekeep_at is not None and time.monotonic() >= self._housekeep_at

    def _settle_round(self) -> None:
        now = time.monotonic()
        for path, (sig, since) in list(self._settling.items()):
            if self._stopping:
                return
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._drop_settling(path)
                self._arrived.discard(path)
                self._seen.pop(path, None)
                with self._lock:
                    self._batch.append(("delete", path))
                    self._refused.pop(path, None)
                    self._bundles.discard(path)
                self._restored(path, None)
                continue
            except OSError as e:
                self._drop_settling(path)
                self._arrived.discard(path)
                self._refuse_file(path, ExpertRejected(f"{path}: cannot stat: {e.strerror}",
                                                       reason="io", path=path))
                continue
            new = self._signature(path, st)
            arrived = path in self._arrived
            if arrived:                       # renamed in / closed after writing: now
                self._arrived.discard(path)
            elif new != sig:
                with self._lock:
                    if path in self._settling:
                        self._settling[path] = (new, now)
                continue
            elif now - since < self.settle_s:
                continue
            with self._lock:                  # one step, so wait_idle() never sees a gap
                self._settling.pop(path, None)
                self._busy = True
            if self._seen.get(path) == new:
                continue                      # nothing changed since its last verdict
            self._seen[path] = new
            if not self._check(path, st, new, arrived=arrived):
                self._seen.pop(path, None)    # not complete yet: let it settle
                with self._lock:
                    self._settling[path] = (new, now)

    @staticmethod
    def _signature(path: str, st: os.stat_result):
        """FileSig of a file; for a bundle folder, its own and its files' (bundle.py)."""
        if stat.S_ISDIR(st.st_mode) and is_bundle_name(os.path.basename(path)):
            return bundle_sig(path, st)
        return FileSig.of(st)

    def _recheck(self) -> bool:
        """The idle worker's look, every RECHECK_S, under the lock; True if it queued paths.

        A folder refused for its permissions: once it passes again, every file of it is
        checked again (nobody has to touch them). A bundle folder: the watcher reports the
        folder, not the files inside it, so a bundle whose files changed since its verdict
        (written in place, completed) is checked again."""
        queued = False
        if self._folder_refused:
            try:
                check_folder(self.experts_dir)
            except ExpertSecurityError:
                pass
            else:
                self._folder_refused = False
                log.info("%s: the folder passes its checks again: checking its files again",
                         self.experts_dir)
                self.rescan()
                queued = True
        for path in sorted(self._bundles):
            try:
                sig = self._signature(path, os.lstat(path))
            except OSError:
                sig = None                    # gone: the check sees it
            if sig is None or sig != self._seen.get(path, sig):
                self._bundles.discard(path)   # back once checked again
                self._request(path)
                queued = True
        return queued

    def _drop_settling(self, path: str) -> None:
        with self._lock:
            self._settling.pop(path, None)

    def _check(self, path: str, st: os.stat_result, sig, arrived: bool = False) -> bool:
        """A settled (or arrived) file -> a probe started, or a PreparedExpert queued, or a
        "rejected" event. False only for an `arrived` file that is not complete yet (it
        then settles like any other)."""
        sha = staged = None
        fd = None
        try:
            try:
                check_folder(self.experts_dir)
            except ExpertSecurityError as e:
                self._folder_refused = True   # looked at again until it passes (_work)
                raise ExpertSecurityError(f"{path}: refused while its folder is: {e}; checked"
                                          " again once the folder is safe", reason=e.reason,
                                          path=path) from None
            try:
                if is_bundle_name(os.path.basename(path)):
                    with self._lock:
                        self._bundles.add(path)
                    sha, staged = stage_bundle(path, self.staging_dir, expect=sig)
                else:
                    check_file(path, st)
                    fd = open_source(path, expect=sig)   # O_NOFOLLOW | O_NONBLOCK, fstat
                    with ElfFile(path, fd=fd):
                        pass                  # complete ELF? (a half-written one is not)
                    sha, staged = stage_file(path, self.staging_dir, expect=sig, fd=fd)
            except ExpertIncomplete:
                if arrived:
                    return False
                raise
            if self.allowlist is not None and sha not in self.allowlist:
                raise ExpertSecurityError(f"{path}: sha256 {sha} is not on the allowlist",
                                          reason="allowlist", path=path)
            info = read_staged(staged, *self._model)
            name = info.meta.name
            with self._lock:
                rec = self._records.get(name)
                known = rec.known_shas() if rec else set()
                if rec is not None and sha in rec.disabled:
                    raise ExpertRejected(f"{path}: expert {name} with sha256 {sha[:12]}… was"
                                         " disabled after its helper crashed: expected a new"
                                         " file version", reason="disabled", path=path)
                pinned = rec.current if (rec is not None and sha in rec.rolled_back
                                         and rec.current is not None) else None
            held = None                       # a newer file rolled back from, listed
            if pinned is not None:            # rolled back from: keep the pinned version
                msg = (f"{path}: {name} {info.meta.version} (sha256 {sha[:12]}…) was rolled"
                       f" back: not adopted again; {pinned.version} stays active")
                log.info(msg)
                held = {"path": path, "reason": "rolled-back", "message": msg, "sha256": sha}
                sha, staged = pinned.sha256, pinned.staged
                info = read_staged(staged, *self._model)
            elif sha in (rec.rolled_back if rec else ()):
                raise ExpertRejected(f"{path}: expert {name} {sha[:12]}… was rolled back:"
                                     " expected a new file version", reason="rolled-back",
                                     path=path)
            with self._lock:
                other = self._name_probing.get(name)
                if other is not None and other != path:   # after that file's verdict
                    self._name_waiting.setdefault(name, []).append(path)
                    self._seen.pop(path, None)
                    return True
            if self._latest_sha(name) == sha:
                self._passed(path, name, held)
                return True                   # same bytes as what is (or will be) active
            if sha not in known:
                self._start_probe(_Probing(path, sig, info, sha, staged))
                return True
            self._adopt(path, info, sha, staged)
            self._passed(path, name, held)
        except FileChanged:
            self._seen.pop(path, None)
            self._request(path)
        except FileNotFoundError:
            self._seen.pop(path, None)
            self._request(path)
        except Exception as e:  # noqa: BLE001 - refusals (and bugs) refuse one file
            self._refuse(path, e, sha, staged)
        finally:
            if fd is not None:
                os.close(fd)
        return True

    def _start_probe(self, p: _Probing) -> None:
        """Hand the staged copy to the probe pool; _verdict() goes on when it answers."""
        with self._lock:
            self._probing[p.path] = p
            self._name_probing[p.info.meta.name] = p.path

        def done(raw, err, p=p):              # on the pool's reader thread: queue it
            with self._cond:
                self._probed.append((p, raw, err))
                self._cond.notify_all()
        try:
            self._probes.submit(p.staged, self.hidden_size, self.probe_timeout_s, done,
                                cwd=self.staging_dir)
        except Exception as e:  # noqa: BLE001 - e.g. the pool is closing
            done(None, e)

    def _verdict(self, p: _Probing, raw: dict | None, err: BaseException | None) -> None:
        """The probe of `p` answered (worker thread): adopt the file or refuse it; then let
        the paths that waited for it go on."""
        name = p.info.meta.name
        with self._lock:                    # (the worker's own state: nothing moves meanwhile)
            self._probing.pop(p.path, None)
            if self._name_probing.get(name) == p.path:
                del self._name_probing[name]
            waiting = self._name_waiting.pop(name, [])
            parked = self._parked.pop(p.path, None)
            self._busy = True
        try:
            if err is not None:
                raise err
            interpret(p.staged, raw, self.probe_timeout_s)
            self._adopt(p.path, p.info, p.sha, p.staged)
            self._passed(p.path, name)
        except Exception as e:  # noqa: BLE001
            self._refuse(p.path, e, p.sha, p.staged)
        finally:
            for path in waiting:
                self._request(path, force=True, arrived=True)
            if parked is not None:
                self._request(p.path, arrived=parked)

    def _adopt(self, path: str, info, sha: str, staged: str) -> None:
        """A file that passed every check: load it and queue it for the next batch."""
        name = info.meta.name
        if info.meta.binding == "unbound":   # built before experts recorded their model
            log.warning(UNBOUND_LOG, path, name, info.meta.version)
        isolation = isolation_from_name(os.path.basename(path), self.isolation_default)
        prep = self._prepare(info, sha, staged, path, isolation)
        with self._cond:
            if name not in self._records:
                slot = self._assigned_slot(name)
                self._records[name] = NameRecord(slot=slot)
                self._next_slot = max(self._next_slot, slot + 1)
                self._dirty = True
                self._housekeep_soon()
            slot = self._records[name].slot
        prep.materialize(slot)
        with self._cond:
            self._batch.append(("upsert", prep, False))

    def _assigned_slot(self, name: str) -> int:
        """The slot a name new to this manager gets: the slots file's, else the next."""
        if self.slots_file is None:
            return self._next_slot
        try:
            with open(self.slots_file, encoding="utf-8") as f:
                slot = json_loads(f.read()).get(name)
        except (OSError, ValueError, AttributeError) as e:
            log.error("slots file %s unreadable (%s): expert %s gets the next free slot %d",
                      self.slots_file, e, name, self._next_slot)
            return self._next_slot
        taken = {r.slot for r in self._records.values()}
        if not isinstance(slot, int) or slot < self.first_slot or slot in taken:
            if slot is not None:
                log.error("slots file %s: slot %r for %s is not a free slot >= %d: it gets "
                          "the next free slot %d", self.slots_file, slot, name,
                          self.first_slot, self._next_slot)
            return self._next_slot
        return slot

    def _refuse(self, path: str, e: BaseException, sha: str | None,
                staged: str | None) -> None:
        """Refuse `path` (the one rule: _refuse_file); its staged copy is deleted unless
        still used."""
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
        self._refuse_file(path, e, sha)
        self._forget_staged(staged)

    # ------------------------------------------------------------------ one rule for refusals
    def _passed(self, path: str, name: str, held: dict | None = None) -> None:
        """`path` passed the checks (it provides `name`): its refusal, if any, is over
        (`held`: but its bytes were rolled back from; shown beside the version kept)."""
        with self._lock:
            self._refused.pop(path, None)
            if held is not None:
                self._refused[path] = held
        self._restored(path, name)

    def _refuse_file(self, path: str, err: HotplugError, sha: str | None = None) -> None:
        """Refuse `path`. The last good version of the expert it replaced stays active: in a
        running manager nothing changes; after a restart it is adopted from staging."""
        self._reject(path, err, sha)
        for name, vrec in self._restored(path, None, keep=True):
            try:
                info = self._recheck_staged(vrec)
                if info.meta.name != name:
                    raise ExpertRejected(f"{vrec.staged}: staged copy of {name} now names"
                                         f" {info.meta.name}", reason="state",
                                         path=vrec.staged)
                prep = self._prepare(info, vrec.sha256, vrec.staged, path, vrec.isolation)
            except (HotplugError, OSError) as e:
                if not isinstance(e, HotplugError):
                    e = ExpertRejected(f"{vrec.staged}: cannot read the staged copy of"
                                       f" {name} {vrec.version}: {e}", reason="io",
                                       path=vrec.staged)
                self._reject(vrec.staged, e, vrec.sha256, record=False, name=name)
                with self._lock:
                    rec = self._records.get(name)
                    if rec is not None and rec.current == vrec:
                        rec.current = None
                        self._dirty = True
                continue
            log.info("%s is refused: %s %s stays active (its staged copy, sha256 %s…)",
                     path, name, vrec.version, vrec.sha256[:12])
            with self._lock:
                prep.materialize(self._records[name].slot)
                self._batch.append(("upsert", prep, False))

    def _restored(self, path: str, name: str | None, keep: bool = False
                  ) -> list[tuple[str, VersionRecord]]:
        """The first verdict on `path` after a restart: return the versions it provided
        when the engine stopped (to keep them, `keep`), or forget those that it no longer
        provides (deleted, or now another name): they are not active any more."""
        with self._lock:
            entries = self._restore.pop(path, [])
            live = [(n, v) for n, v in entries if n not in self._active
                    and self._records.get(n) is not None and self._records[n].current == v
                    and not any(op[0] == "upsert" and op[1].name == n
                                for op in list(self._ops) + self._batch)]
            if keep:
                return live
            for n, v in live:
                if n != name:
                    self._records[n].current = None
                    self._dirty = True
        return []

    def _recheck_staged(self, vrec: VersionRecord):
        """The checks a staged copy gets again when it is adopted without its file (rollback,
        a restart that keeps it): allowlist, metadata against the model. Not the probe."""
        if self.allowlist is not None and vrec.sha256 not in self.allowlist:
            raise ExpertSecurityError(f"{vrec.staged}: sha256 {vrec.sha256} is not on the"
                                      " allowlist", reason="allowlist", path=vrec.staged)
        return read_staged(vrec.staged, *self._model)

    def _prepare_batch(self) -> list:
        """The checked batch, once `prepare` saw what it will change (the worker hands it
        to drain() right after)."""
        with self._lock:
            batch = self._batch
            if not batch:
                return []
            self._batch = []
        if self.prepare is not None:
            try:
                changes = self.preview(batch)
                if changes:
                    self.prepare(changes)
                    # Building it took the GIL from the engine's thread for a while; let
                    # that thread run clear of us before the token that adopts it.
                    time.sleep(PUBLISH_PAUSE_S)
            except Exception:  # noqa: BLE001 - the engine then builds it on its thread
                log.exception("preparing an expert-set change failed")
        return batch

    def _prepare(self, info, sha: str, staged: str, source: str,
                 isolation: str) -> PreparedExpert:
        return PreparedExpert(info, sha, staged, source, isolation,
                              call_timeout_s=self.probe_timeout_s,
                              capacity=self.isolated_capacity)

    def _latest_sha(self, name: str) -> str | None:
        """sha256 `name` will have once the queued ops are applied (None when unsure)."""
        with self._lock:
            for op in reversed(list(self._ops) + self._batch):
                if op[0] == "delete":
                    return None
                if op[1].name == name:
                    return op[1].sha256
            cur = self._active.get(name)
            return cur.sha256 if cur is not None else None

    # ------------------------------------------------------------------ helpers
    def _reject(self, path: str, err: HotplugError, sha: str | None = None, *,
                record: bool = True, **extra) -> None:
        """One log line naming the file and the rule, a "rejected" event, and (`record`)
        the refusal kept for list()/refused() until the file passes or goes."""
        log.warning(REFUSED_LOG, path, err.reason, err)
        info = {"path": path, "reason": err.reason, "message": str(err), "sha256": sha,
                **extra}
        if record:
            with self._lock:
                self._refused[path] = {k: info[k] for k in ("path", "reason", "message",
                                                            "sha256")}
        self._emit("rejected", info)

    def _emit(self, kind: str, info: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, info)
        except Exception:  # noqa: BLE001 - a broken listener must not stop hot-plugging
            log.exception("hot-plug on_event(%r) listener failed", kind)

    def _referenced_staged(self) -> set[str]:
        with self._lock:
            refs = {r.staged for rec in self._records.values()
                    for r in ([rec.current] if rec.current else []) + rec.history}
            refs |= {e.staged_path for e in self._active.values()}
            refs |= {op[1].staged for op in list(self._ops) + self._batch
                     if op[0] == "upsert"}
            refs |= {p.staged for p in self._probing.values()}
        return refs

    def _forget_staged(self, staged: str | None) -> None:
        if staged and staging_entry(staged) not in self._referenced_entries():
            remove_staged(staging_entry(staged))

    def _referenced_entries(self) -> set[str]:
        return {staging_entry(p) for p in self._referenced_staged()}

    def _clean_staging(self) -> None:
        refs = self._referenced_entries()
        for n in os.listdir(self.staging_dir):
            p = os.path.join(self.staging_dir, n)
            if p not in refs:
                remove_staged(p)

    def _save_state(self) -> None:
        with self._lock:
            records = {k: NameRecord(v.slot, v.current, list(v.history), list(v.rolled_back),
                                     list(v.disabled), v.last)
                       for k, v in self._records.items()}
            next_slot = self._next_slot
        try:
            save_state(self.state_dir, next_slot, records)
        except OSError as e:
            log.error("cannot save hot-plug state in %s: %s", self.state_dir, e)
