"""The intake's checks of one file (intake.py's worker runs them): check, stage, probe,
load, queue.

A settled (or arrived) file is checked in order -- its folder, the file itself (opened
O_NOFOLLOW | O_NONBLOCK, a complete ELF), staged as `<sha256>.so` (or a bundle), the
allowlist, the metadata against the host and the model, what the book knows of its name
(disabled, rolled back) -- then probed in the pool (a sha256 this name adopted before is
not probed again), loaded (a LoadedExpert in its slot) and queued in the worker's next
batch; any refusal goes to the book's one rule (book.py). One file per expert name is
probed at a time: the changes of one name come out in the order their files were
checked. Mixed into Intake: the state is the intake's.
"""
from __future__ import annotations

import logging
import os

from .bundle import is_bundle_name, read_staged, stage_bundle
from .elf import ElfFile
from .errors import ExpertIncomplete, ExpertRejected, ExpertSecurityError
from .probe import interpret
from .staging import FileChanged, check_file, check_folder, open_source, stage_file
from .watcher import isolation_from_name

log = logging.getLogger("colibri.hotplug")
UNBOUND_LOG = ("%s: expert %s %s records no base model (metadata ABI 1, or a bundle without"
               " base_model): adopted unbound, unchecked against this model; rebuild it for"
               " this model (`colibri expert build --config NAME`) or mark it portable")


class _Probing:
    """A file whose probe runs: what its check found, for when the verdict comes back."""

    __slots__ = ("path", "sig", "info", "sha", "staged")

    def __init__(self, path, sig, info, sha, staged):
        self.path, self.sig, self.info, self.sha, self.staged = path, sig, info, sha, staged


class Checking:
    """Intake's per-file steps (the attributes are Intake's)."""

    def _queue(self, kept: list) -> None:
        """Kept versions (book.refuse_file) into the next batch."""
        if kept:
            with self.lock:
                self.batch += [("upsert", loaded, False) for loaded in kept]

    # ------------------------------------------------------------------ checking, probing
    def _check(self, path: str, st: os.stat_result, sig, arrived: bool = False) -> bool:
        """A settled (or arrived) file -> a probe started, or a LoadedExpert queued, or a
        "rejected" event. False only for an `arrived` file that is not complete yet (it
        then settles like any other)."""
        m, book = self.m, self.book
        sha = staged = None
        fd = None
        try:
            try:
                check_folder(m.experts_dir)
            except ExpertSecurityError as e:
                self.folder_refused = True    # looked at again until it passes (_work)
                raise ExpertSecurityError(f"{path}: refused while its folder is: {e}; checked"
                                          " again once the folder is safe", reason=e.reason,
                                          path=path) from None
            try:
                if is_bundle_name(os.path.basename(path)):
                    with self.lock:
                        self.bundles.add(path)
                    sha, staged = stage_bundle(path, m.staging_dir, expect=sig)
                else:
                    check_file(path, st)
                    fd = open_source(path, expect=sig)   # O_NOFOLLOW | O_NONBLOCK, fstat
                    with ElfFile(path, fd=fd):
                        pass                  # complete ELF? (a half-written one is not)
                    sha, staged = stage_file(path, m.staging_dir, expect=sig, fd=fd)
            except ExpertIncomplete:
                if arrived:
                    return False
                raise
            if m.allowlist is not None and sha not in m.allowlist:
                raise ExpertSecurityError(f"{path}: sha256 {sha} is not on the allowlist",
                                          reason="allowlist", path=path)
            info = read_staged(staged, *m._model)
            name = info.meta.name
            known, pinned, rolled_back = book.prior(path, name, sha)
            held = None                       # a newer file rolled back from, listed
            if pinned is not None:            # rolled back from: keep the pinned version
                msg = (f"{path}: {name} {info.meta.version} (sha256 {sha[:12]}…) was rolled"
                       f" back: not adopted again; {pinned.version} stays active")
                log.info(msg)
                held = {"path": path, "reason": "rolled-back", "message": msg, "sha256": sha}
                sha, staged = pinned.sha256, pinned.staged
                info = read_staged(staged, *m._model)
            elif rolled_back:
                raise ExpertRejected(f"{path}: expert {name} {sha[:12]}… was rolled back:"
                                     " expected a new file version", reason="rolled-back",
                                     path=path)
            with self.lock:
                other = self.name_probing.get(name)
                if other is not None and other != path:   # after that file's verdict
                    self.name_waiting.setdefault(name, []).append(path)
                    self.seen.pop(path, None)
                    return True
            if self._latest_sha(name) == sha:
                book.passed(path, name, held)
                return True                   # same bytes as what is (or will be) active
            if sha not in known:
                self._start_probe(_Probing(path, sig, info, sha, staged))
                return True
            self._adopt(path, info, sha, staged)
            book.passed(path, name, held)
        except (FileChanged, FileNotFoundError):
            self.seen.pop(path, None)
            self.request(path)
        except Exception as e:  # noqa: BLE001 - refusals (and bugs) refuse one file
            self._queue(book.refuse(path, e, sha, staged))
        finally:
            if fd is not None:
                os.close(fd)
        return True

    def _start_probe(self, p: _Probing) -> None:
        """Hand the staged copy to the probe pool; _verdict() goes on when it answers."""
        with self.lock:
            self.probing[p.path] = p
            self.name_probing[p.info.meta.name] = p.path

        def done(raw, err, p=p):              # on the pool's reader thread: queue it
            with self.cond:
                self.probed.append((p, raw, err))
                self.cond.notify_all()
        try:
            self.probes.submit(p.staged, self.m.hidden_size, self.m.probe_timeout_s, done,
                               cwd=self.m.staging_dir)
        except Exception as e:  # noqa: BLE001 - e.g. the pool is closing
            done(None, e)

    def _verdict(self, p: _Probing, raw: dict | None, err: BaseException | None) -> None:
        """The probe of `p` answered (worker thread): adopt the file or refuse it; then let
        the paths that waited for it go on."""
        name = p.info.meta.name
        with self.lock:                     # (the worker's own state: nothing moves meanwhile)
            self.probing.pop(p.path, None)
            if self.name_probing.get(name) == p.path:
                del self.name_probing[name]
            waiting = self.name_waiting.pop(name, [])
            parked = self.parked.pop(p.path, None)
            self.busy = True
        try:
            if err is not None:
                raise err
            interpret(p.staged, raw, self.m.probe_timeout_s)
            self._adopt(p.path, p.info, p.sha, p.staged)
            self.book.passed(p.path, name)
        except Exception as e:  # noqa: BLE001
            self._queue(self.book.refuse(p.path, e, p.sha, p.staged))
        finally:
            for path in waiting:
                self.request(path, force=True, arrived=True)
            if parked is not None:
                self.request(p.path, arrived=parked)

    def _adopt(self, path: str, info, sha: str, staged: str) -> None:
        """A file that passed every check: load it and queue it for the next batch."""
        name = info.meta.name
        if info.meta.binding == "unbound":   # built before experts recorded their model
            log.warning(UNBOUND_LOG, path, name, info.meta.version)
        isolation = isolation_from_name(os.path.basename(path), self.m.isolation_default)
        loaded = self.m.load_expert(info, sha, staged, path, isolation)
        slot, new = self.book.slot_for(name)
        if new:
            self.housekeep_soon()
        loaded.materialize(slot)
        with self.lock:
            self.batch.append(("upsert", loaded, False))

    def _latest_sha(self, name: str) -> str | None:
        """sha256 `name` will have once the queued ops are applied (None when unsure)."""
        with self.lock:
            for op in reversed(self.m.queued()):
                if op[0] == "delete":
                    return None
                if op[1].name == name:
                    return op[1].sha256
            cur = self.book.active.get(name)
            return cur.sha256 if cur is not None else None
