"""inotify(7) on one folder, read directly (libc through ctypes), with the raw event masks.

The masks say how a file arrived, which is what lets the worker skip the settle wait:
IN_MOVED_TO (renamed into the folder, from inside or outside it) and IN_CLOSE_WRITE (closed
after writing) mean "complete as far as its writer knows"; IN_CREATE, IN_MODIFY, IN_ATTRIB
mean "changing"; IN_MOVED_FROM and IN_DELETE mean "gone". (watchdog's default emitter
reports a move from outside the folder as a created event, and holds back every event for
0.5 s behind an unpaired IN_MOVED_FROM; this module has neither.) IN_Q_OVERFLOW (events
were lost) asks for a rescan of the folder.

One thread per watcher blocks in poll() on the inotify descriptor and a wake-up pipe; it
calls `on_event(name, mask)` for each event that names an entry of the folder.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from typing import Callable

log = logging.getLogger("colibri.hotplug")

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCH_MASK = (IN_CREATE | IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM
              | IN_MOVED_TO | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
              | IN_DONT_FOLLOW)
ARRIVED = IN_MOVED_TO | IN_CLOSE_WRITE        # the masks that skip the settle wait
_EVENT = struct.Struct("iIII")                # wd, mask, cookie, len (then the name)

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_add_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def _errno_error(what: str, path: str) -> OSError:
    e = ctypes.get_errno()
    hint = {errno.EMFILE: " (fs.inotify.max_user_instances reached)",
            errno.ENOSPC: " (fs.inotify.max_user_watches reached)"}.get(e, "")
    return OSError(e, f"{what}: {os.strerror(e)}{hint}", path)


def parse_events(data: bytes) -> list[tuple[int, int, str]]:
    """(mask, cookie, name) of each `struct inotify_event` in `data` (name '' for the
    watched folder itself)."""
    out, off = [], 0
    while off + _EVENT.size <= len(data):
        _, mask, cookie, length = _EVENT.unpack_from(data, off)
        off += _EVENT.size
        raw = data[off:off + length]
        off += length
        out.append((mask, cookie, os.fsdecode(raw.split(b"\0", 1)[0])))
    return out


class InotifyWatcher:
    """Watches one folder (not recursively) from its own thread."""

    def __init__(self, folder: str, on_event: Callable[[str, int], None],
                 on_overflow: Callable[[], None] | None = None):
        self.folder = folder
        self._on_event = on_event
        self._on_overflow = on_overflow
        lib = _lib()
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise _errno_error("inotify_init1", folder)
        if lib.inotify_add_watch(fd, os.fsencode(folder), WATCH_MASK) < 0:
            err = _errno_error("inotify_add_watch", folder)
            os.close(fd)
            raise err
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="colibri-hotplug-inotify",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for fd in (self._fd, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd = self._wake_r = self._wake_w = -1

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping:
            try:
                ready = {fd for fd, _ in poller.poll()}
            except InterruptedError:
                continue
            if self._wake_r in ready or self._stopping:
                return
            try:
                data = os.read(self._fd, 256 * 1024)
            except BlockingIOError:
                continue
            except OSError as e:
                log.error("%s: reading inotify events failed (%s): hot-plug watch ended",
                          self.folder, e)
                return
            for mask, _cookie, name in parse_events(data):
                try:
                    self._dispatch(mask, name)
                except Exception:  # noqa: BLE001 - the watch must survive a listener
                    log.exception("hot-plug event handler failed")

    def _dispatch(self, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            log.warning("%s: inotify queue overflowed (events lost): rescanning the folder",
                        self.folder)
            if self._on_overflow is not None:
                self._on_overflow()
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT):
            log.error("%s: the watched folder was deleted, moved or unmounted: no more"
                      " hot-plug events from it", self.folder)
            return
        if not name or mask & IN_IGNORED:
            return
        self._on_event(name, mask)             # (folders too: bundles are folders)
