"""ProbePool: the warm probe helper, seen from the engine.

One helper process (`python -m colibri_core.experts.hotplug.probe --serve`, probe.py) is spawned
when the pool starts, as a clean interpreter (a subprocess of sys.executable: never a fork
of the engine, whose kernel thread pool and other threads are not fork-safe); it forks one
short-lived child per probe. The pool runs at most `slots` probes at once and queues the
rest in order, so that while fewer probes hang than there are slots, a good file still gets
a slot at once.

- `submit(path, hidden, timeout_s, done, cwd=...)`: `done(raw, error)` is called once, on
  the pool's reader thread, with the raw result (probe.interpret turns it into a verdict
  or an ExpertProbeError) or with an error;
- the helper enforces each probe's timeout (it kills the child's process group); the pool
  gives the helper that timeout plus GRACE_S to answer, else it counts as hung and is
  killed (its children die with it: PR_SET_PDEATHSIG);
- a helper that dies is restarted; the probes it was running are sent again once, and a
  probe that was running at two deaths is refused (reason `probe-crash`);
- while no helper can be started, each probe runs in a fresh interpreter instead
  (probe.run_fresh: the same checks, the same verdicts).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

from ...nesting import json_loads
from .errors import ExpertProbeError
from .probe import READY_PREFIX, probe_env, run_fresh

log = logging.getLogger("colibri.hotplug")

Done = Callable[[Optional[dict], Optional[BaseException]], None]


class ProbeTicket:
    """One probe asked for: where it runs (child pid, once started) and how often."""

    __slots__ = ("id", "path", "hidden", "timeout_s", "cwd", "seed", "done", "attempts",
                 "sent_at", "child_pid")

    def __init__(self, tid: int, path: str, hidden: int, timeout_s: float, cwd: str,
                 seed: int, done: Done):
        self.id, self.path, self.hidden, self.timeout_s = tid, path, hidden, timeout_s
        self.cwd, self.seed, self.done = cwd, seed, done
        self.attempts = 0
        self.sent_at: float | None = None
        self.child_pid: int | None = None


class ProbePool:
    """At most `slots` probes at once in children of one warm helper process."""

    GRACE_S = 2.0              # beyond a probe's own timeout, before the helper counts as hung
    START_TIMEOUT_S = 10.0     # for the helper's READY line
    FRESH_RETRY_S = 30.0       # after a failed start, fresh interpreters this long

    def __init__(self, slots: int = 2, *, cwd: str | None = None):
        if int(slots) < 1:
            raise ValueError(f"probe slots {slots!r}, expected at least 1")
        self.slots = int(slots)
        self.cwd = cwd
        self.restarts = 0                     # helpers started after the first one
        self._lock = threading.Lock()
        self._spawn_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._queue: deque[ProbeTicket] = deque()
        self._running: dict[int, ProbeTicket] = {}
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._started_once = False
        self._fresh_until = 0.0               # monotonic time until which no helper is tried
        self._closed = False
        self._readers: list[threading.Thread] = []

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Spawn the helper now (so the first probe does not wait for it)."""
        self._ensure_helper()

    @property
    def helper_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def running(self) -> list[dict]:
        """The probes running now: path, child pid (None before its fork), attempts."""
        with self._lock:
            return [{"path": t.path, "child_pid": t.child_pid, "attempts": t.attempts}
                    for t in self._running.values()]

    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue or self._running)

    def close(self) -> None:
        """Stop the helper (its children are killed with it); pending probes are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            proc, self._proc = self._proc, None
            self._queue.clear()
            self._running.clear()
        if proc is not None:
            _stop(proc)
        for th in self._readers:
            if th is not threading.current_thread():
                th.join(timeout=5.0)

    # ------------------------------------------------------------------ probes
    def submit(self, path: str, hidden: int, timeout_s: float, done: Done, *,
               cwd: str | None = None, seed: int = 0) -> ProbeTicket:
        t = ProbeTicket(next(self._ids), path, int(hidden), float(timeout_s),
                        cwd or self.cwd or os.path.dirname(os.path.abspath(path)), int(seed),
                        done)
        with self._lock:
            if self._closed:
                raise RuntimeError("probe pool is closed")
            self._queue.append(t)
        self._pump()
        return t

    def _pump(self) -> None:
        """Start queued probes while slots are free."""
        while True:
            with self._lock:
                if self._closed or not self._queue or len(self._running) >= self.slots:
                    return
                proc = self._proc
                fresh = proc is None and time.monotonic() < self._fresh_until
                if proc is None and not fresh:
                    ticket = None
                else:
                    ticket = self._queue.popleft()
                    self._running[ticket.id] = ticket
                    ticket.sent_at = time.monotonic()
            if ticket is None:
                self._ensure_helper()
                continue
            if fresh:
                threading.Thread(target=self._run_fresh, args=(ticket,), daemon=True,
                                 name="colibri-probe-fresh").start()
                continue
            line = json.dumps({"id": ticket.id, "path": ticket.path, "hidden": ticket.hidden,
                               "seed": ticket.seed, "timeout": ticket.timeout_s,
                               "cwd": ticket.cwd}) + "\n"
            data = line.encode()
            try:
                with self._write_lock:
                    fd = proc.stdin.fileno()
                    while data:
                        data = data[os.write(fd, data):]
            except (OSError, ValueError):
                pass          # the helper is gone: its reader sees the end and sends it again

    def _run_fresh(self, t: ProbeTicket) -> None:
        try:
            raw, err = run_fresh(t.path, t.hidden, t.timeout_s, cwd=t.cwd, seed=t.seed), None
        except Exception as e:  # noqa: BLE001 - e.g. cannot start an interpreter
            raw, err = None, ExpertProbeError(f"{t.path}: cannot start the probe: {e}",
                                              reason="probe-failed", path=t.path)
        self._complete(t.id, raw, err)

    def _complete(self, tid: int, raw: dict | None, err: BaseException | None) -> None:
        with self._lock:
            t = self._running.pop(tid, None)
        if t is None:
            return
        self._pump()
        try:
            t.done(raw, err)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the pool
            log.exception("probe callback for %s failed", t.path)

    # ------------------------------------------------------------------ the helper
    def _ensure_helper(self) -> bool:
        with self._spawn_lock:
            with self._lock:
                if self._closed:
                    return False
                if self._proc is not None:
                    return True
                if time.monotonic() < self._fresh_until:
                    return False
            try:
                proc = self._spawn()
            except Exception as e:  # noqa: BLE001 - fall back to fresh interpreters
                log.warning("probe helper could not be started (%s): probing in a fresh"
                            " interpreter per file for %.0f s", e, self.FRESH_RETRY_S)
                with self._lock:
                    self._fresh_until = time.monotonic() + self.FRESH_RETRY_S
                return False
            with self._lock:
                if self._closed:
                    closed = True
                else:
                    closed = False
                    self._proc = proc
                    if self._started_once:
                        self.restarts += 1
                    self._started_once = True
            if closed:
                _stop(proc)
                return False
            th = threading.Thread(target=self._read, args=(proc,), daemon=True,
                                  name="colibri-probe-reader")
            self._readers = [r for r in self._readers if r.is_alive()] + [th]
            th.start()
            return True

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "colibri_core.experts.hotplug.probe", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            env=probe_env(), cwd=self.cwd or "/", bufsize=0)
        fd = proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                _stop(proc)
                proc.stdout.close()
                raise RuntimeError("no READY line from the helper"
                                   if not ready else "the helper exited at start")
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        if not line.decode("utf-8", "replace").startswith(READY_PREFIX):
            _stop(proc)
            proc.stdout.close()
            raise RuntimeError(f"unexpected first line from the helper: {line[:80]!r}")
        proc._colibri_rest = rest        # answers read along with READY (none expected)
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        """The reader thread of one helper: answers -> tickets; its end -> restart."""
        try:
            self._read_answers(proc)
        finally:
            try:
                proc.stdout.close()
            except OSError:
                pass

    def _read_answers(self, proc: subprocess.Popen) -> None:
        fd = proc.stdout.fileno()
        buf = getattr(proc, "_colibri_rest", b"")
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                self._answer(line)
            with self._lock:
                if self._closed or self._proc is not proc:
                    return
                deadlines = [t.sent_at + t.timeout_s + self.GRACE_S
                             for t in self._running.values() if t.sent_at is not None]
            wait = min(deadlines) - time.monotonic() if deadlines else 1.0
            if wait <= 0:
                log.error("probe helper (pid %d) did not answer in time: killing and"
                          " restarting it", proc.pid)
                _kill(proc)
                wait = 1.0
            if not poller.poll(min(wait, 1.0) * 1000.0):
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
        self._died(proc)

    def _answer(self, line: bytes) -> None:
        try:
            msg = json_loads(line)
            tid = msg["id"]
        except (ValueError, KeyError, TypeError):
            log.error("probe helper said %r", line[:200])
            return
        if "started" in msg:
            with self._lock:
                t = self._running.get(tid)
                if t is not None:
                    t.child_pid = msg["started"]
            return
        if "error" in msg:                  # the helper could not fork: a fresh interpreter
            with self._lock:
                t = self._running.get(tid)
            if t is not None:
                log.warning("probe helper could not start a probe of %s (%s): using a fresh"
                            " interpreter", t.path, msg["error"])
                threading.Thread(target=self._run_fresh, args=(t,), daemon=True,
                                 name="colibri-probe-fresh").start()
            return
        self._complete(tid, {k: msg.get(k) for k in ("rc", "timed_out", "verdict", "output")},
                       None)

    def _died(self, proc: subprocess.Popen) -> None:
        _kill(proc)
        with self._lock:
            if self._proc is not proc:
                return
            self._proc = None
            if self._closed:
                return
            lost = list(self._running.values())
            self._running.clear()
            retry, refuse = [], []
            for t in lost:
                t.attempts += 1
                t.child_pid = None
                (refuse if t.attempts >= 2 else retry).append(t)
            self._queue.extendleft(reversed(retry))
        log.error("probe helper (pid %d) ended (%s) with %d probe(s) running: restarting it",
                  proc.pid, _status(proc), len(lost))
        for t in refuse:
            try:
                t.done(None, ExpertProbeError(
                    f"{t.path}: the probe helper died twice while probing it (does the"
                    " expert kill its parent?)", reason="probe-crash", path=t.path))
            except Exception:  # noqa: BLE001
                log.exception("probe callback for %s failed", t.path)
        self._pump()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """End of stdin: the helper kills its children and exits; by force after 2 s. (Its
    stdout is closed by its reader thread, which sees the end.)"""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass
    _kill(proc)


def _status(proc: subprocess.Popen) -> str:
    rc = proc.returncode
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"
