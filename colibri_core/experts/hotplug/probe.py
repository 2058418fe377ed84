"""The probe of an expert .so: load it and call ffn_forward on test inputs, in a process of
its own (never the engine's, never a fork of the engine).

Two ways to run it, with the same checks and the same verdicts:
- the warm helper (`python -m colibri_core.experts.hotplug.probe --serve`, spawned once by
  probepool.ProbePool): a clean interpreter that has imported only the standard library
  and cffi (its FFI declared once), and forks one short-lived child per probe, each in its
  own process group (killed as a group on timeout, and killed by the kernel if the helper
  dies: PR_SET_PDEATHSIG). The child inherits the warm interpreter, so a probe costs a fork
  and the calls (milliseconds), not an interpreter start-up (~0.1-0.2 s);
- a fresh interpreter per file (`python -m colibri_core.experts.hotplug.probe PATH HIDDEN`,
  run_probe()): what the pool falls back to when its helper cannot be started.

The child loads the .so with RTLD_NOW and calls ffn_forward on random and edge-case inputs.
It writes one verdict line `COLIBRI-PROBE {json}` and exits 0 when the expert passed, 3
when it failed a check. A crash (signal), a hang (the timeout) or a missing verdict is a
failure the parent names itself (`interpret`).

The checks themselves (probecheck.py): return value 0, every output written and finite,
nothing written past y nor into x, rows independent, deterministic.

Only the standard library and cffi are imported (numpy and watchdog never are).
"""
from __future__ import annotations

import json
import sys

from ...nesting import json_loads
from .probecheck import FFN_CDEF, ProbeFailure, probe

VERDICT_PREFIX = "COLIBRI-PROBE "
READY_PREFIX = "COLIBRI-PROBE-HELPER "
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 3, 2
OUTPUT_TAIL = 4096          # bytes of a probe's stdout/stderr kept for the message


def interpret(path: str, result: dict, timeout_s: float) -> dict:
    """The verdict of one probe run, or raise ExpertProbeError naming what went wrong.

    `result`: {"rc": exit status (negative: killed by that signal), "timed_out": bool,
    "verdict": what the child wrote on its verdict channel, "output": the tail of its
    other output}. Both ways of running the probe end here, so their refusals are the same.
    """
    import signal

    from .errors import ExpertProbeError

    if result.get("timed_out"):
        raise ExpertProbeError(f"{path}: probe hung: no verdict within {timeout_s:g} s"
                               " (probe killed)", reason="probe-timeout", path=path)
    rc = result.get("rc")
    if not isinstance(rc, int):
        raise ExpertProbeError(f"{path}: probe ended without an exit status",
                               reason="probe-failed", path=path)
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        raise ExpertProbeError(f"{path}: probe crashed with {sig} while calling ffn_forward"
                               " (or loading the .so)", reason="probe-crash", path=path)
    verdict = None
    for line in str(result.get("verdict") or "").splitlines():
        if line.startswith(VERDICT_PREFIX):
            try:
                verdict = json_loads(line[len(VERDICT_PREFIX):])
            except ValueError:
                verdict = None
    if not isinstance(verdict, dict) or (verdict.get("ok") is True) != (rc == EXIT_OK):
        tail = " | ".join(str(result.get("output") or "").strip().splitlines()[-2:])
        raise ExpertProbeError(f"{path}: probe exited with status {rc} without a verdict"
                               f"{': ' + tail if tail else ''}", reason="probe-failed",
                               path=path)
    if not verdict["ok"]:
        raise ExpertProbeError(f"{path}: probe refused it: {verdict.get('reason')}",
                               reason="probe-failed", path=path)
    return verdict


def probe_env() -> dict:
    """The environment of a probe process: this checkout first on PYTHONPATH, one kernel
    thread unless set (OMP_NUM_THREADS, the kernels' thread count)."""
    import os

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_fresh(path: str, hidden: int, timeout_s: float = 5.0, *, cwd: str | None = None,
              seed: int = 0) -> dict:
    """Probe `path` in a fresh interpreter (spawned, in its own session, its process group
    killed on timeout); return the raw result for interpret()."""
    import os
    import signal
    import subprocess

    cmd = [sys.executable, "-m", "colibri_core.experts.hotplug.probe", path, str(hidden), str(seed)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=probe_env(),
                            cwd=cwd or os.path.dirname(os.path.abspath(path)))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return {"rc": None, "timed_out": True, "verdict": "", "output": ""}
    return {"rc": proc.returncode, "timed_out": False,
            "verdict": out.decode("utf-8", "replace"),
            "output": err.decode("utf-8", "replace")[-OUTPUT_TAIL:]}


def run_probe(path: str, hidden: int, timeout_s: float = 5.0, *, cwd: str | None = None,
              seed: int = 0) -> dict:
    """Probe `path` in a fresh interpreter; return the verdict or raise ExpertProbeError.

    The manager uses the warm helper instead (probepool.py), and this when the helper
    cannot be started; both give the same verdicts. Never called on the engine thread.
    """
    return interpret(path, run_fresh(path, hidden, timeout_s, cwd=cwd, seed=seed), timeout_s)


# ----------------------------------------------------------------------------- the helper

def _prctl():
    """libc prctl (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return fn


PR_SET_PDEATHSIG = 1


class _Child:
    """One probe child of the helper: its pid, deadline, pipes and what came out of them."""

    __slots__ = ("id", "pid", "deadline", "vfd", "ofd", "verdict", "output", "status",
                 "timed_out")

    def __init__(self, rid, pid: int, deadline: float, vfd: int, ofd: int):
        self.id, self.pid, self.deadline, self.vfd, self.ofd = rid, pid, deadline, vfd, ofd
        self.verdict, self.output = bytearray(), bytearray()
        self.status: int | None = None      # os.waitpid status once it exited
        self.timed_out = False


class _Helper:
    """The warm probe helper (`python -m colibri_core.experts.hotplug.probe --serve`).

    Requests on stdin, answers on stdout, one JSON object a line:

        request  {"id": n, "path": STAGED, "hidden": H, "seed": 0, "timeout": s, "cwd": DIR}
        answers  {"id": n, "started": PID}      its child was forked
                 {"id": n, "pid": PID, "rc": status (negative: the signal), "timed_out":
                  bool, "verdict": "...", "output": "tail of its stdout+stderr"}
                 {"id": n, "error": "..."}      the child could not be started

    End of stdin (the engine closed it, or died): every child's group is killed, then exit.
    The helper is single-threaded, so forking is safe; each child starts a process group
    of its own, asks for SIGKILL when the helper dies, keeps only its two pipes (verdict on
    fd 3; stdout and stderr into the other one) and runs probe() with the helper's FFI.
    """

    def __init__(self):
        import os
        import select
        import signal

        from cffi import FFI

        self.os, self.signal, self.POLLIN = os, signal, select.POLLIN
        self.ffi = FFI()
        self.ffi.cdef(FFN_CDEF)                     # parsed once, inherited by every child
        self.prctl = _prctl()
        self.pid = os.getpid()
        self.rfd, self.wfd = 0, 1
        os.set_blocking(self.rfd, False)
        self.wake_r, wake_w = os.pipe()             # SIGCHLD -> poll() returns
        for fd in (self.wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the terminal's Ctrl-C is not for us
        self.children: dict[int, _Child] = {}
        self.by_fd: dict[int, tuple[_Child, str]] = {}
        self.poller = select.poll()
        self.poller.register(self.rfd, select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        self.inbuf = bytearray()

    # -- output
    def send(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[self.os.write(self.wfd, data):]

    # -- children
    def start(self, req: dict) -> None:
        os, signal = self.os, self.signal
        rid = req.get("id")
        path, hidden = str(req["path"]), int(req["hidden"])
        seed, timeout, cwd = int(req.get("seed", 0)), float(req["timeout"]), str(req["cwd"])
        vr, vw = os.pipe()
        orr, ow = os.pipe()
        pid = os.fork()
        if pid == 0:
            self._child(path, hidden, seed, cwd, vw, ow)     # never returns
        try:
            os.setpgid(pid, pid)                    # no window without a group of its own
        except OSError:
            pass
        os.close(vw)
        os.close(ow)
        import time
        child = _Child(rid, pid, time.monotonic() + timeout, vr, orr)
        self.children[pid] = child
        for fd, which in ((vr, "v"), (orr, "o")):
            os.set_blocking(fd, False)
            self.by_fd[fd] = (child, which)
            self.poller.register(fd, self.POLLIN)
        self.send({"id": rid, "started": pid})

    def _child(self, path: str, hidden: int, seed: int, cwd: str, vw: int, ow: int):
        os, signal = self.os, self.signal
        code = EXIT_USAGE
        try:
            os.setpgid(0, 0)
            if self.prctl is not None:
                self.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != self.pid:            # the helper died already
                os._exit(EXIT_USAGE)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(ow, 1)
            os.dup2(ow, 2)
            os.dup2(vw, 3)
            os.closerange(4, _max_fd())
            os.chdir(cwd)
            try:
                verdict = probe(path, hidden, seed, self.ffi)
                code = EXIT_OK
            except ProbeFailure as e:
                verdict, code = {"ok": False, "reason": str(e)}, EXIT_FAILED
            data = (VERDICT_PREFIX + json.dumps(verdict) + "\n").encode()
            while data:
                data = data[os.write(3, data):]
        except BaseException:                       # noqa: BLE001 - report, then exit
            try:
                import traceback
                traceback.print_exc()
                sys.stderr.flush()
            except BaseException:                   # noqa: BLE001
                pass
            code = EXIT_USAGE
        os._exit(code)

    def _read(self, fd: int, child: _Child, which: str) -> bool:
        """Take what a child's pipe holds now; False at its end."""
        buf = child.verdict if which == "v" else child.output
        while True:
            try:
                chunk = self.os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            buf += chunk
            if which == "o" and len(buf) > 2 * OUTPUT_TAIL:
                del buf[:-OUTPUT_TAIL]              # keep the tail of the output
            elif which == "v" and len(buf) > 65536:
                del buf[65536:]                     # a verdict is one short line

    def _close(self, fd: int) -> None:
        if self.by_fd.pop(fd, None) is not None:
            self.poller.unregister(fd)
        try:
            self.os.close(fd)
        except OSError:
            pass

    def _kill(self, child: _Child) -> None:
        for kill in (self.os.killpg, self.os.kill):
            try:
                kill(child.pid, self.signal.SIGKILL)
            except OSError:
                pass

    def finish(self, child: _Child) -> None:
        os = self.os
        self._kill(child)                           # whatever it left behind in its group
        for fd, which in ((child.vfd, "v"), (child.ofd, "o")):
            if fd in self.by_fd:
                self._read(fd, child, which)
                self._close(fd)
        del self.children[child.pid]
        st = child.status
        rc = None if st is None else (-os.WTERMSIG(st) if os.WIFSIGNALED(st)
                                      else os.WEXITSTATUS(st))
        self.send({"id": child.id, "pid": child.pid, "rc": rc, "timed_out": child.timed_out,
                   "verdict": child.verdict.decode("utf-8", "replace"),
                   "output": child.output[-OUTPUT_TAIL:].decode("utf-8", "replace")})

    # -- the loop
    def run(self) -> int:
        os = self.os
        import time
        try:
            self.send_ready()
            while True:
                now = time.monotonic()
                waits = [c.deadline - now for c in self.children.values() if c.status is None]
                timeout = None if not waits else max(0.0, min(waits)) * 1000.0 + 1.0
                try:
                    events = self.poller.poll(timeout)
                except InterruptedError:
                    events = []
                eof = False
                for fd, _ in events:
                    if fd == self.rfd:
                        eof = not self._requests() or eof
                    elif fd == self.wake_r:
                        try:
                            while os.read(self.wake_r, 512):
                                pass
                        except BlockingIOError:
                            pass
                    elif fd in self.by_fd:
                        child, which = self.by_fd[fd]
                        if not self._read(fd, child, which):
                            self._close(fd)
                self._reap()
                now = time.monotonic()
                for child in list(self.children.values()):
                    if child.status is None and now >= child.deadline:
                        child.timed_out = True
                        self._kill(child)
                    if child.status is not None:
                        self.finish(child)
                if eof:
                    return 0
        except BrokenPipeError:                     # the engine is gone
            return 0
        finally:
            for child in list(self.children.values()):
                self._kill(child)

    def send_ready(self) -> None:
        self.os.write(self.wfd, (READY_PREFIX + json.dumps({"pid": self.pid}) + "\n").encode())

    def _requests(self) -> bool:
        """Start what stdin asks for; False at its end."""
        try:
            chunk = self.os.read(self.rfd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.inbuf += chunk
        while b"\n" in self.inbuf:
            line, _, rest = bytes(self.inbuf).partition(b"\n")
            self.inbuf[:] = rest
            req = None
            try:
                req = json_loads(line)
                self.start(req)
            except Exception as e:                  # noqa: BLE001 - answer it, go on
                rid = req.get("id") if isinstance(req, dict) else None
                self.send({"id": rid, "error": repr(e)})
        return True

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = self.os.waitpid(-1, self.os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:
                self.children[pid].status = status


def _max_fd() -> int:
    import os
    try:
        n = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        n = 4096
    return n if n > 0 else 4096


def serve() -> int:
    """Run the warm probe helper (see _Helper) until stdin ends."""
    return _Helper().run()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    if len(argv) not in (2, 3):
        print("usage: python -m colibri_core.experts.hotplug.probe PATH HIDDEN [SEED] | --serve",
              file=sys.stderr)
        return EXIT_USAGE
    path, hidden = argv[0], int(argv[1])
    seed = int(argv[2]) if len(argv) == 3 else 0
    try:
        verdict = probe(path, hidden, seed)
        code = EXIT_OK
    except ProbeFailure as e:
        verdict, code = {"ok": False, "reason": str(e)}, EXIT_FAILED
    sys.stdout.write(VERDICT_PREFIX + json.dumps(verdict) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
