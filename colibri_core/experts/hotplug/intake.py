"""The manager's intake: watching, settling, checking, probing, on the worker thread.

Threads:

    watch (watcher.py)   queues paths, and whether each arrived complete   never touches a file
    worker               settle -> check -> stage -> (probe) -> load -> prepare   milliseconds
    probe pool reader    hands probe results back to the worker (probepool.py)

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
helper (isolated): a LoadedExpert (expert.py). The checked files are then handed to
drain() (adoption.py) in batches: before a batch is handed over, `prepare(changes)` (the
engine's) is called on the worker with the changes drain() will return for it, so that the
new expert set can be built off the engine thread.

Order: one path is checked at a time (events for a path whose probe runs wait for it), and
one file per expert name is probed at a time, so the changes of one name come out in the
order their files were checked; files of other names do not wait for each other.

Its state is the worker's; what wait_idle() and the other parts read of it (`batch`,
`probing`, `busy`, ...) is written under the manager's one lock. The worker also does the
housekeeping: the state save (book.py) and the unloads release_later() queued
(adoption.py), HOUSEKEEPING_DELAY_S after a change.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque

from .book import Book
from .bundle import bundle_sig, is_bundle_name
from .checking import Checking, _Probing
from .errors import ExpertRejected, ExpertSecurityError
from .probepool import ProbePool
from .stagedmap import release_each
from .staging import FileSig, check_folder
from .watcher import FolderWatcher, is_expert_name

log = logging.getLogger("colibri.hotplug")
RECHECK_S = 0.5    # how often the idle worker looks at a refused folder, and at bundles
HOUSEKEEPING_DELAY_S = 0.02   # state save and unloads wait this long after a change
IDLE_WAKE_S = 0.1             # an idle worker looks for such work this often
PUBLISH_PAUSE_S = 0.002       # between preparing a batch and handing it to drain()


class Intake(Checking):
    def __init__(self, m) -> None:
        self.m = m
        self.lock, self.cond = m._lock, m._cond
        self.book: Book = m.book
        self.requests: dict[str, bool] = {}    # path -> arrived complete; queued, in order
        self.settling: dict[str, tuple[FileSig, float]] = {}
        self.arrived: set[str] = set()         # settling paths to check at once if complete
        self.seen: dict[str, FileSig] = {}            # last checked signature per path
        self.busy = False
        self.probing: dict[str, _Probing] = {}        # path -> its probe (running or queued)
        self.parked: dict[str, bool] = {}      # events for a path whose probe runs
        self.name_probing: dict[str, str] = {}        # expert name -> path being probed
        self.name_waiting: dict[str, list[str]] = {}  # paths waiting for that probe
        self.probed: deque = deque()           # (_Probing, raw, error) from the pool
        self.batch: list = []                  # checked ops not yet handed to drain()
        self.housekeep_at: float | None = None
        self.folder_refused = False            # a file was refused for the folder's sake
        self.bundles: set[str] = set()         # bundle folders checked: their files polled
        self.stopping = False
        self.worker: threading.Thread | None = None
        self.watcher: FolderWatcher | None = None
        self.probes: ProbePool | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        m = self.m
        self.stopping = False
        self.probes = ProbePool(m.probe_slots, cwd=m.staging_dir)
        self.probes.start()
        self.worker = threading.Thread(target=self._work, name="colibri-hotplug-worker",
                                       daemon=True)
        self.worker.start()
        if m.watch:
            self.watcher = FolderWatcher(
                m.experts_dir, lambda path, arrived: self.request(path, arrived=arrived),
                on_overflow=self.rescan, polling=m.polling)
            self.watcher.start()

    def stop(self) -> tuple[list, list[_Probing]]:
        """Stop the watch, the worker and the probes; -> (the batch not handed over, the
        files whose probe ran), taken out."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.worker is not None:
            self.worker.join(timeout=30.0)
            self.worker = None
        if self.probes is not None:
            self.probes.close()          # kills the helper and any probe still running
            self.probes = None
        with self.lock:
            batch, self.batch = self.batch, []
            probing = list(self.probing.values())
            self.probing.clear()
            self.probed.clear()
            self.parked.clear()
            self.name_probing.clear()
            self.name_waiting.clear()
        return batch, probing

    def running(self) -> bool:
        return self.worker is not None and not self.stopping

    def rescan(self) -> None:
        m = self.m
        try:
            names = os.listdir(m.experts_dir)
        except OSError as e:
            log.error("cannot list %s: %s", m.experts_dir, e)
            return
        for n in sorted(names):
            if is_expert_name(n):
                self.request(os.path.join(m.experts_dir, n), force=True)
        with self.lock:
            sources = ([e.source_path for e in self.book.active.values()]
                       + list(self.book.restore))
        for src in sources:
            if not os.path.lexists(src):
                self.request(src, force=True)

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while (self.requests or self.settling or self.busy or self.probing
                   or self.probed or self.batch):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def request(self, path: str, force: bool = False, arrived: bool = False) -> None:
        """Called by the watch's thread (and rescan): queue a path, nothing else.
        `arrived`: it was renamed in or closed after writing (checked at once if complete)."""
        with self.cond:
            if force:
                self.seen.pop(path, None)
            self.requests[path] = self.requests.get(path, False) or arrived
            self.cond.notify_all()

    def housekeep_soon(self, wake: bool = True) -> None:
        """State save / unloads due: done by the worker HOUSEKEEPING_DELAY_S from now, not
        during the token that adopted the change (several changes make one save). From the
        engine's token path (`wake` False) the worker is not woken: it looks every
        IDLE_WAKE_S."""
        with self.lock:
            if self.housekeep_at is None:
                self.housekeep_at = time.monotonic() + HOUSEKEEPING_DELAY_S
                if wake:
                    self.cond.notify_all()

    def staged_in_flight(self) -> set[str]:
        with self.lock:
            return ({op[1].staged for op in self.batch if op[0] == "upsert"}
                    | {p.staged for p in self.probing.values()})

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        tick = max(0.005, min(self.m.settle_s / 4, 0.05))
        batch: list = []
        next_recheck = 0.0
        adoption = self.m.adoption
        while True:
            with self.cond:
                if batch:      # hand the prepared batch over, then block at once: the
                    adoption.ops.extend(batch)    # token that adopts it runs clear of us
                    batch = []
                    self.cond.notify_all()
                self.busy = False
                if (self.settling and not self.requests and not self.stopping
                        and not self.probed):
                    self.cond.wait(tick)
                while not (self.stopping or self.requests or self.settling
                           or self.probed or self._housekeeping_due()):
                    now = time.monotonic()
                    if (self.folder_refused or self.bundles) and now >= next_recheck:
                        next_recheck = now + RECHECK_S
                        if self._recheck():
                            continue                  # it queued paths
                    wait = IDLE_WAKE_S
                    if self.housekeep_at is not None:
                        wait = max(0.0, min(wait, self.housekeep_at - now))
                    self.cond.wait(wait)
                if self.stopping:
                    return
                self.busy = True
                if self.requests:
                    now = time.monotonic()
                    for path, arrived in self.requests.items():
                        if path in self.probing:      # its probe runs: wait for the verdict
                            self.parked[path] = self.parked.get(path, False) or arrived
                            continue
                        self.settling[path] = (None, now)
                        if arrived:
                            self.arrived.add(path)
                    self.requests.clear()
                probed = list(self.probed)
                self.probed.clear()
                housekeeping = self._housekeeping_due()
                if housekeeping:
                    self.housekeep_at = None
                    dirty = self.book.take_dirty()
                    releases, dropped = adoption.take_housekeeping()
            if housekeeping:
                del dropped                   # snapshots, plans: freed here, finalizers run
                releases += adoption.take_releases()
                release_each(releases)        # emptied: this frame keeps no expert alive
                if dirty:
                    self.book.save()
            try:
                for item in probed:
                    self._verdict(*item)
                self._settle_round()
            except Exception:  # noqa: BLE001 - the worker must survive anything
                log.exception("hot-plug worker error")
            batch = self._prepare_batch()     # handed over at the top of the loop

    def _housekeeping_due(self) -> bool:
        return self.housekeep_at is not None and time.monotonic() >= self.housekeep_at

    def _settle_round(self) -> None:
        now = time.monotonic()
        for path, (sig, since) in list(self.settling.items()):
            if self.stopping:
                return
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._drop_settling(path)
                self.arrived.discard(path)
                self.seen.pop(path, None)
                with self.lock:
                    self.batch.append(("delete", path))
                    self.book.forget_path(path)
                    self.bundles.discard(path)
                self.book.restored(path, None)
                continue
            except OSError as e:
                self._drop_settling(path)
                self.arrived.discard(path)
                self._queue(self.book.refuse_file(path, ExpertRejected(
                    f"{path}: cannot stat: {e.strerror}", reason="io", path=path)))
                continue
            new = self._signature(path, st)
            arrived = path in self.arrived
            if arrived:                       # renamed in / closed after writing: now
                self.arrived.discard(path)
            elif new != sig:
                with self.lock:
                    if path in self.settling:
                        self.settling[path] = (new, now)
                continue
            elif now - since < self.m.settle_s:
                continue
            with self.lock:                   # one step, so wait_idle() never sees a gap
                self.settling.pop(path, None)
                self.busy = True
            if self.seen.get(path) == new:
                continue                      # nothing changed since its last verdict
            self.seen[path] = new
            if not self._check(path, st, new, arrived=arrived):
                self.seen.pop(path, None)     # not complete yet: let it settle
                with self.lock:
                    self.settling[path] = (new, now)

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
        if self.folder_refused:
            try:
                check_folder(self.m.experts_dir)
            except ExpertSecurityError:
                pass
            else:
                self.folder_refused = False
                log.info("%s: the folder passes its checks again: checking its files again",
                         self.m.experts_dir)
                self.rescan()
                queued = True
        for path in sorted(self.bundles):
            try:
                sig = self._signature(path, os.lstat(path))
            except OSError:
                sig = None                    # gone: the check sees it
            if sig is None or sig != self.seen.get(path, sig):
                self.bundles.discard(path)    # back once checked again
                self.request(path)
                queued = True
        return queued

    def _drop_settling(self, path: str) -> None:
        with self.lock:
            self.settling.pop(path, None)

    def _prepare_batch(self) -> list:
        """The checked batch, once `prepare` saw what it will change (the worker hands it
        to drain() right after)."""
        with self.lock:
            batch = self.batch
            if not batch:
                return []
            self.batch = []
        prepare = self.m.prepare
        if prepare is not None:
            try:
                changes = self.m.adoption.preview(batch)
                if changes:
                    prepare(changes)
                    # Building it took the GIL from the engine's thread for a while; let
                    # that thread run clear of us before the token that adopts it.
                    time.sleep(PUBLISH_PAUSE_S)
            except Exception:  # noqa: BLE001 - the engine then builds it on its thread
                log.exception("preparing an expert-set change failed")
        return batch
