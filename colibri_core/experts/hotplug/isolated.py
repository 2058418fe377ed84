"""Isolated mode: an expert's ffn_forward runs in a helper process, over shared memory.

Parent (`IsolatedRunner`, in the engine) and helper (`python -m colibri_core.experts.hotplug.isolated`)
share one anonymous memory file (memfd) holding two float32 buffers, x [capacity, hidden]
and y [capacity, hidden], sealed against resizing (a helper cannot shrink it under the
engine's mapping), and talk over two pipes:

    parent -> helper   int32 n_tokens   (1..capacity: run ffn_forward on x[:n] into y[:n];
                                          0: exit)
    helper -> parent   int32 rc         (ffn_forward's return value; first message: READY)

Calls larger than `capacity` tokens are split into chunks (rows are independent by the
contract). The helper's stdout is redirected to its stderr so that an expert printing to
stdout cannot corrupt the protocol. A helper that dies (EOF or a broken pipe) or does not
answer within `call_timeout_s` is killed and the runner is marked dead: every later
forward() raises ExpertCrashed; the manager removes the expert at the next drain().
"""
from __future__ import annotations

import os
import select
import struct
import sys
from typing import NoReturn

from .errors import ExpertCrashed

_INT = struct.Struct("<i")
READY = 0x52454459  # "READY"


# ----------------------------------------------------------------------------- helper side

def helper_main(argv: list[str]) -> int:
    import mmap

    from cffi import FFI

    from . import sandbox

    path, hidden, capacity, shm_fd, req_fd, resp_fd = argv[0], *map(int, argv[1:6])
    os.dup2(2, 1)                                      # stdout belongs to no one
    ffi = FFI()
    ffi.cdef("int ffn_forward(const float *x, float *y, int n_tokens, int hidden);")
    mm = mmap.mmap(shm_fd, 2 * capacity * hidden * 4)
    base = ffi.cast("float *", ffi.from_buffer(mm))
    # The sandbox (sandbox.py), before the expert's first instruction -- its constructors
    # run inside dlopen: only the pipes and stderr stay open, then the filter.
    sandboxed = sandbox.supported()
    sandbox.close_other_fds({1, 2, req_fd, resp_fd})
    if sandboxed:
        sandbox.install_before_load()
    lib = ffi.dlopen(path, ffi.RTLD_NOW)
    fn = lib.ffn_forward
    if sandboxed:
        sandbox.install_after_load()
    x, y = base, base + capacity * hidden
    os.write(resp_fd, _INT.pack(READY))
    while True:
        msg = _read_exact(req_fd, 4)
        if msg is None:
            return 0
        n = _INT.unpack(msg)[0]
        if n <= 0 or n > capacity:
            return 0
        os.write(resp_fd, _INT.pack(fn(x, y, n, hidden)))


def _read_exact(fd: int, size: int) -> bytes | None:
    buf = b""
    while len(buf) < size:
        chunk = os.read(fd, size - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# ----------------------------------------------------------------------------- engine side

class IsolatedRunner:
    """The engine's handle on one helper process. forward() is serialized by the caller."""

    def __init__(self, path: str, hidden: int, *, capacity: int = 64,
                 call_timeout_s: float = 5.0, start_timeout_s: float = 10.0):
        import mmap
        import subprocess

        import numpy as np

        self.path, self.hidden, self.capacity = path, hidden, capacity
        self.call_timeout_s = call_timeout_s
        self.dead_reason: str | None = None
        nbytes = 2 * capacity * hidden * 4
        shm_fd = _sealed_memfd(nbytes)
        self._mm = mmap.mmap(shm_fd, nbytes)
        self._x = np.frombuffer(self._mm, np.float32, capacity * hidden, 0).reshape(
            capacity, hidden)
        self._y = np.frombuffer(self._mm, np.float32, capacity * hidden,
                                capacity * hidden * 4).reshape(capacity, hidden)
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "colibri_core.experts.hotplug.isolated", path, str(hidden),
                 str(capacity), str(shm_fd), str(req_r), str(resp_w)],
                pass_fds=(shm_fd, req_r, resp_w), stdin=subprocess.DEVNULL,
                start_new_session=True, env=env, cwd=os.path.dirname(os.path.abspath(path)))
        finally:
            for fd in (shm_fd, req_r, resp_w):
                os.close(fd)
        self.pid = self.proc.pid
        try:
            rc = self._read_int(start_timeout_s)
        except ExpertCrashed as e:
            self.close()
            raise ExpertCrashed(f"{path}: isolated helper failed to start"
                                f" ({self.dead_reason})", path=path) from e
        if rc != READY:
            self.close()
            raise ExpertCrashed(f"{path}: isolated helper failed to start (bad handshake"
                                f" {rc:#x})", path=path)

    # -- calls
    def forward(self, x, out) -> int:
        """Run ffn_forward on x [N, hidden] into out; return its rc; raise ExpertCrashed."""
        if self.dead_reason is not None:
            raise ExpertCrashed(f"{self.path}: isolated helper is dead"
                                f" ({self.dead_reason})", path=self.path)
        n = x.shape[0]
        for start in range(0, n, self.capacity):
            m = min(self.capacity, n - start)
            self._x[:m] = x[start:start + m]
            try:
                os.write(self._req_w, _INT.pack(m))
            except OSError as e:          # BrokenPipeError: the helper is gone
                self._died(f"pipe closed: {e.strerror}")
            rc = self._read_int(self.call_timeout_s)
            if rc != 0:
                return rc
            out[start:start + m] = self._y[:m]
        return 0

    def _read_int(self, timeout_s: float) -> int:
        poller = select.poll()
        poller.register(self._resp_r, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(timeout_s * 1000.0):
            self._died(f"no answer within {timeout_s:g} s, killed")
        msg = _read_exact(self._resp_r, 4)
        if msg is None:
            self._died(self._exit_text())
        return _INT.unpack(msg)[0]

    def _died(self, reason: str) -> NoReturn:
        if self.dead_reason is None:
            self.dead_reason = reason
        self.kill()
        raise ExpertCrashed(f"{self.path}: isolated helper died ({self.dead_reason})",
                            path=self.path)

    def _exit_text(self) -> str:
        try:
            rc = self.proc.wait(timeout=1.0)
        except Exception:  # noqa: BLE001 - still running: the pipe closed on its own
            return "closed its pipe"
        if rc < 0:
            import signal
            if -rc == signal.SIGSYS:
                return ("killed by SIGSYS: the sandbox refused a system call (seccomp; "
                        "docs/HOTPLUG.md, section 5)")
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"

    # -- life cycle
    def alive(self) -> bool:
        if self.dead_reason is None and self.proc.poll() is not None:
            self.dead_reason = self._exit_text()
        return self.dead_reason is None

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=5.0)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """Stop the helper (politely, then by force) and free the shared memory."""
        if self.proc.poll() is None and self.dead_reason is None:
            try:
                os.write(self._req_w, _INT.pack(0))
                self.proc.wait(timeout=1.0)
            except Exception:  # noqa: BLE001
                pass
        if self.dead_reason is None:
            self.dead_reason = "closed"
        self.kill()
        for fd in (self._req_w, self._resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._req_w = self._resp_r = -1
        del self._x, self._y
        try:
            self._mm.close()
        except BufferError:
            pass


def _sealed_memfd(nbytes: int) -> int:
    """The shared buffer's file, `nbytes` long, sealed against any size change before the
    helper sees it: a helper that ftruncates it gets EPERM. Unsealed, a shrink would make
    the engine's next read or write of x/y a SIGBUS that kills the engine (the helper
    runs the expert's code, which the isolation is there to survive)."""
    import fcntl

    if not hasattr(os, "memfd_create"):            # not Linux: cannot be sealed
        fd = _unlinked_tmp()
        os.ftruncate(fd, nbytes)
        return fd
    fd = os.memfd_create("colibri-expert", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlinked_tmp() -> int:
    import tempfile
    fd, name = tempfile.mkstemp(prefix="colibri-expert-", dir="/dev/shm"
                                if os.path.isdir("/dev/shm") else None)
    os.unlink(name)
    return fd


if __name__ == "__main__":
    sys.exit(helper_main(sys.argv[1:]))
