"""The watch on the experts folder. It only queues paths (with how they arrived); it never
loads.

On Linux the folder is watched with inotify read directly (inotify.py), so each event comes
with its raw mask: a file that arrived by rename (IN_MOVED_TO) or was closed after writing
(IN_CLOSE_WRITE) is queued as `arrived`, which lets the worker check it at once; created,
modified and attrib events (and a name moved away or deleted) are queued plainly and the
worker waits for the file to settle. Elsewhere, or when inotify is unavailable (instance or
watch limits reached), or with `polling=True`, a watchdog observer is used (native, or
polling every POLL_S seconds) and nothing is `arrived`: every file settles.

The worker looks at the file itself (lstat) to decide what happened, so the event kind only
decides whether a file waits to settle, and a burst of events for one file is one check.

Names considered: `*.so` files that are not hidden and not temporary, and bundle folders
`*.expert` (bundle.py; the files inside one are looked at by the manager's worker: a
bundle renamed in arrives complete, like a file). Ignored: dotfiles (`.x.so`, `.x.so.tmp`:
the conventional "write here, then rename" names), `*.tmp`, `*~`, `*.part`, `*.swp`, and
anything not ending in `.so` (the folder also holds C sources and a Makefile).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from .bundle import BUNDLE_SUFFIX, is_bundle_name

log = logging.getLogger("colibri.hotplug")

IGNORED_SUFFIXES = (".tmp", "~", ".part", ".swp", ".swx", ".crdownload")
WATCHED_EVENTS = {"created", "modified", "closed", "moved", "deleted", "attrib"}


def is_expert_name(name: str) -> bool:
    """True for a file name the hot-plug folder acts on (a `.so`, or a bundle folder)."""
    return ((name.endswith(".so") and not name.startswith(".")
             and not name.endswith(IGNORED_SUFFIXES)) or is_bundle_name(name))


def isolation_from_name(name: str, default: str) -> str:
    """Per-file override: `x.isolated.so` -> isolated, `x.inprocess.so` -> in-process (the
    same for bundles: `x.isolated.expert`, `x.inprocess.expert`)."""
    if name.endswith((".isolated.so", ".isolated" + BUNDLE_SUFFIX)):
        return "isolated"
    if name.endswith((".inprocess.so", ".inprocess" + BUNDLE_SUFFIX)):
        return "inprocess"
    return default


POLL_S = 0.5        # the polling observer's interval

OnPath = Callable[[str, bool], None]     # (path, arrived complete: renamed in / closed)


class FolderWatcher:
    """Watches one folder, non-recursively: inotify on Linux, else a watchdog observer.

    `on_path(path, arrived)` is called from the watch's thread; `on_overflow()` when
    events were lost (inotify queue overflow). `kind` says which watch runs: "inotify",
    "polling" or "native" (watchdog's observer for the platform).
    """

    def __init__(self, folder: str, on_path: OnPath, *,
                 on_overflow: Callable[[], None] | None = None, polling: bool = False):
        self.folder = folder
        self._on_path = on_path
        self._impl = None
        self.kind = ""
        if not polling and sys.platform.startswith("linux"):
            from .inotify import ARRIVED, IN_ISDIR, InotifyWatcher

            def on_event(name: str, mask: int) -> None:
                if is_expert_name(name) and (not mask & IN_ISDIR or is_bundle_name(name)):
                    on_path(os.path.join(folder, name), bool(mask & ARRIVED))
            try:
                self._impl = InotifyWatcher(folder, on_event, on_overflow)
                self.kind = "inotify"
            except OSError as e:
                log.warning("%s: cannot watch with inotify (%s): polling the folder every"
                            " %g s instead", folder, e, POLL_S)
                polling = True
        if self._impl is None:
            self._impl = _watchdog_observer(folder, on_path, polling)
            self.kind = "polling" if polling else "native"

    def start(self) -> None:
        self._impl.start()

    def stop(self) -> None:
        self._impl.stop()
        if hasattr(self._impl, "join"):
            self._impl.join(timeout=5.0)


def _watchdog_observer(folder: str, on_path: OnPath, polling: bool):
    """A watchdog observer (no event says a file is complete: every file settles)."""
    from watchdog.events import FileSystemEvent, FileSystemEventHandler

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            if event.event_type not in WATCHED_EVENTS:
                return
            paths = [event.src_path]
            if event.event_type == "moved":
                paths.append(event.dest_path)
            for p in paths:
                if not p:
                    continue
                p = os.fsdecode(p)
                name = os.path.basename(p)
                if is_expert_name(name) and (not event.is_directory or is_bundle_name(name)):
                    on_path(p, False)

    if polling:
        from watchdog.observers.polling import PollingObserver
        observer = PollingObserver(timeout=POLL_S)
    else:
        from watchdog.observers import Observer
        observer = Observer()
    observer.daemon = True
    observer.schedule(Handler(), folder, recursive=False)
    return observer
