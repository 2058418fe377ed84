"""The watchdog observer on the experts folder. It only queues paths; it never loads.

Events handled: created, modified, attrib (chmod, touch), closed-after-write, moved (both
the source name, which is now gone, and the destination name, which is acted on), deleted.
The worker thread looks at the file itself (lstat) to decide what happened, so the event
kind does not matter and a burst of events for one file is one check.

Names considered: `*.so` files that are not hidden and not temporary, and bundle folders
`*.expert` (bundle.py; the files inside one are looked at by the manager's worker). Ignored: dotfiles
(`.x.so`, `.x.so.tmp`: the conventional "write here, then rename" names), `*.tmp`, `*~`,
`*.part`, `*.swp`, and anything not ending in `.so` (the folder also holds C sources and a
Makefile).
"""
from __future__ import annotations

import os
from typing import Callable

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from .bundle import BUNDLE_SUFFIX, is_bundle_name

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


class _Handler(FileSystemEventHandler):
    def __init__(self, on_path: Callable[[str], None]):
        self._on_path = on_path

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in WATCHED_EVENTS:
            return
        paths = [event.src_path]
        if event.event_type == "moved":
            paths.append(event.dest_path)
        for p in paths:
            p = os.fsdecode(p)
            name = os.path.basename(p)
            if is_expert_name(name) and (not event.is_directory or is_bundle_name(name)):
                self._on_path(p)


class FolderWatcher:
    """Runs a watchdog Observer (inotify on Linux) on one folder, non-recursively."""

    def __init__(self, folder: str, on_path: Callable[[str], None]):
        self.folder = folder
        self._observer = Observer()
        self._observer.daemon = True
        self._observer.schedule(_Handler(on_path), folder, recursive=False)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        self._observer.join(timeout=5.0)
