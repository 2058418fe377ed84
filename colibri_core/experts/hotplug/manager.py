"""HotplugManager: the watched experts folder -> checked, probed experts -> drain().

Three parts, each with its own state, all under one lock (`_lock`, an RLock, and its
Condition `_cond`):

    book.py      Book: names, slots, versions, the active set, the state file, refusals,
                 rollback's target. No thread: read and written by the two others.
    intake.py    Intake: the watch and the worker thread -- settling, checking, staging,
                 probing, loading (LoadedExpert), preparing batches for drain(); the
                 housekeeping (state save, unloads).
    adoption.py  Adoption: the engine's side -- the queue the worker hands over, drain()
                 and preview() on it, release(), release_later(), drop_later().

Threads, one job each:

    watch (watcher.py)   queues paths, and whether each arrived complete   never touches a file
    worker (intake.py)   settle -> check -> stage -> (probe) -> load -> prepare   milliseconds
    probe pool reader    hands probe results back to the worker (probepool.py)
    engine (caller)      drain(): swaps prepared changes in, between 2 tokens   microseconds

An expert's identity is its metadata `name`: a file whose name is already active replaces
it (same slot); deleting the file an active expert came from removes it. A bundle folder
`NAME.expert/` (bundle.py) is checked, staged and adopted like a file. The rule for
refusals is the book's (book.py; docs/HOTPLUG.md, "When a file is refused").
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterable

from .adoption import Adoption
from .book import Book
from .bundle import remove_staged, staging_entry
from .errors import ExpertSecurityError
from .expert import INPROCESS, ISOLATION_MODES, ExpertChange, HotExpert, LoadedExpert
from .intake import Intake
from .staging import check_folder, ensure_private_dir

EventCallback = Callable[[str, dict], None]
PrepareCallback = Callable[[list], None]


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
        assign_slot: callable(name) -> slot, the slot a name new to this manager gets
            (the candidates' manager of a `shadow/` folder takes the live manager's, so
            that a candidate sits in the slot it keeps once promoted).
    """

    def __init__(self, experts_dir: str | os.PathLike, hidden_size: int,
                 moe_layers: Iterable[int], first_slot: int, state_dir: str | os.PathLike,
                 allowlist: Iterable[str] | None = None, isolation_default: str = INPROCESS,
                 probe_timeout_s: float = 5.0, settle_s: float = 0.2,
                 on_event: EventCallback | None = None, *, watch: bool = True,
                 isolated_capacity: int = 64, probe_slots: int = 2,
                 prepare: PrepareCallback | None = None, polling: bool = False,
                 slots_file: str | os.PathLike | None = None,
                 model_fingerprint: str | None = None,
                 assign_slot: Callable[[str], int] | None = None):
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
        self.assign_slot = assign_slot

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self.book = Book(self)
        self.adoption = Adoption(self)
        self.intake = Intake(self)

    @classmethod
    def for_engine(cls, config, model_cfg, model_fingerprint: str, on_event: EventCallback,
                   prepare: PrepareCallback) -> "HotplugManager":
        """The engine's manager (not started): EngineConfig's `experts_dir` and `hotplug`
        settings, the model's shape; the state folder defaults to the watched folder's
        `.colibri-state/`."""
        hp = config.hotplug
        experts_dir = os.fspath(config.experts_dir)
        state_dir = hp.state_dir or os.path.join(experts_dir, ".colibri-state")
        return cls.for_folder(experts_dir, state_dir, config, model_cfg, model_fingerprint,
                              on_event, prepare)

    @classmethod
    def for_folder(cls, experts_dir: str, state_dir: str, config, model_cfg,
                   model_fingerprint: str, on_event: EventCallback | None,
                   prepare: PrepareCallback | None, **extra) -> "HotplugManager":
        """A manager of `experts_dir` with the engine's `hotplug` settings (the engine's
        folder, or its `shadow/` candidates' folder)."""
        hp = config.hotplug
        return cls(experts_dir, model_cfg.hidden_size, model_cfg.moe_layers,
                   first_slot=model_cfg.num_experts, state_dir=state_dir,
                   allowlist=hp.allowlist, isolation_default=hp.isolation,
                   probe_timeout_s=hp.probe_timeout_s, settle_s=hp.settle_s,
                   on_event=on_event, probe_slots=hp.probe_slots, prepare=prepare,
                   slots_file=hp.slots_file, model_fingerprint=model_fingerprint, **extra)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Load the state, check the folder, start the probe helper, the worker and the
        watch, scan the folder.

        Raises ExpertSecurityError when the folder itself is refused (symlink, writable by
        group/others, foreign owner), HotplugStateError for an unusable state folder.
        """
        if self.book.lock_fd is not None:
            raise RuntimeError(f"hot-plug manager for {self.experts_dir} is already started")
        ensure_private_dir(self.state_dir)
        ensure_private_dir(self.staging_dir)
        try:
            check_folder(self.experts_dir)
        except ExpertSecurityError as e:
            self.book.reject(self.experts_dir, e)
            raise
        self.book.open()
        self.intake.start()
        self.rescan()

    def stop(self) -> None:
        """Stop the watcher and the worker and save the state. Active experts stay usable."""
        if self.book.lock_fd is None:
            return
        batch, probing = self.intake.stop()
        pending = [op[1] for op in self.adoption.take_ops() + batch if op[0] == "upsert"]
        for loaded in pending:
            loaded.discard()
        for p in probing:
            self.forget_staged(p.staged)
        self.flush_releases()
        self.book.save()
        self.book.close_file()

    def close(self) -> None:
        """stop(), then release every active expert (the engine must be done with them)."""
        self.stop()
        with self._lock:
            experts = list(self.book.active.values())
            self.book.active.clear()
        for e in experts:
            e._release()

    def rescan(self) -> None:
        """Queue every expert file of the folder and every vanished source (e.g. at start)."""
        self.intake.rescan()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued path was checked and probed, and what passed was handed
        to drain() (e.g. the initial scan). True if idle."""
        return self.intake.wait_idle(timeout)

    # ------------------------------------------------------------------ engine side
    @property
    def version(self) -> int:
        """Expert-set version: +1 per applied change (stamp tokens with it)."""
        return self.book.version

    def drain(self) -> list[ExpertChange]:
        """Apply queued changes; return them in order. Call on the engine thread between tokens.

        Everything the changes need was made on the worker (libraries loaded, helpers
        started, HotExpert objects made): this only moves them into the active set, counts
        versions and emits events. Isolated experts whose helper died are removed here
        (kind "remove", reason "crashed"). The state file is saved by the worker a moment
        later.
        """
        return self.adoption.drain()

    def preview(self, ops: list) -> list[tuple] | None:
        """The changes drain() would return for `ops` queued after what is queued now:
        [(kind, expert, previous), ...] with the same objects; None when it cannot say
        (a rollback among them). No side effect."""
        return self.adoption.preview(ops)

    def release(self, expert: HotExpert) -> None:
        """The engine no longer uses `expert` (a replaced or removed one): unload it."""
        self.adoption.release(expert)

    def release_later(self, expert: HotExpert) -> None:
        """release(), with the unloading (dlclose, helper stop) done by the worker a moment
        later, off the caller's thread (the engine's token path); at once when the worker
        does not run. flush_releases() does the pending ones now."""
        self.adoption.release_later(expert)

    def drop_later(self, obj) -> None:
        """Keep `obj` until the worker's next housekeeping, so that freeing it (and what
        dies with it: an expert-set snapshot and its decode plan, their finalizers) happens
        on the worker, not between two tokens. Dropped at once when the worker does not
        run."""
        self.adoption.drop_later(obj)

    def flush_releases(self) -> None:
        """Now, on the caller's thread: free what drop_later() holds, then unload what
        release_later() queued (including what that freeing released)."""
        self.adoption.flush_releases()

    def rollback(self, name: str) -> None:
        """Queue a replace of active expert `name` by its previous version (next drain()).

        Raises RollbackError when `name` is not active or has no previous version, or an
        ExpertRejected subclass when the previous staged file no longer passes the checks.
        The version rolled back from is not adopted again from the folder (a new file is).
        `name` may also be the file (in the watched folder) the expert came from.
        """
        self.adoption.queue(("upsert", self.book.rollback(name), True))

    def list(self) -> list[dict]:
        """Rows for `colibri experts list`: active experts, then known inactive names
        (listing.py)."""
        return self.book.rows()

    def refused(self) -> list[dict]:
        """The files refused now (path, reason, message, sha256), by path: each stays listed
        until the file passes the checks or is deleted (a newer file rolled back from is
        listed too, reason `rolled-back`)."""
        return self.book.refused_rows()

    def active(self) -> dict[str, HotExpert]:
        """name -> active HotExpert (a snapshot)."""
        return self.book.active_copy()

    # ------------------------------------------------------------------ shared by the parts
    def load_expert(self, info, sha: str, staged: str, source: str,
                    isolation: str) -> LoadedExpert:
        """Map and load a checked staged copy (dlopen, or its isolated helper)."""
        return LoadedExpert(info, sha, staged, source, isolation,
                            call_timeout_s=self.probe_timeout_s,
                            capacity=self.isolated_capacity)

    def queued(self) -> list:
        """The changes on their way to drain(), in order: handed over, then the batch."""
        with self._lock:
            return list(self.adoption.ops) + self.intake.batch

    def staged_in_use(self) -> set[str]:
        """Every staged copy something refers to: recorded, active, queued, probed."""
        with self._lock:
            return (self.book.staged_in_use() | self.adoption.staged_queued()
                    | self.intake.staged_in_flight())

    def forget_staged(self, staged: str | None) -> None:
        """Delete `staged` unless something still refers to it."""
        if staged and staging_entry(staged) not in {staging_entry(p)
                                                     for p in self.staged_in_use()}:
            remove_staged(staging_entry(staged))

    # what tests look at
    @property
    def _probes(self):
        return self.intake.probes

    @property
    def _watcher(self):
        return self.intake.watcher

    @property
    def _ops(self):
        return self.adoption.ops

    def _save_state(self) -> None:
        self.book.save()
