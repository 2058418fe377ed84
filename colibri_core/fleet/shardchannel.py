"""The expert shard's socket (issue 40): the per-MoE-layer data path between the driver
and a shard actor, without Ray's per-call cost (about 1.3 ms a plain actor call here,
docs/SCALE.md "Measured here"). Ray still places, restarts and pings the actor; the
actor opens this socket and tells its address through a Ray call (shardactor.py).

    ChannelServer   the actor's end: a Unix socket (abstract on Linux) and a TCP port on
                    the node's address; a thread per connection reads a layer's request,
                    computes it (ExpertShard.compute) and writes the result back
    Channel         the driver's end to one shard: the Unix socket when the shard is on
                    this host, else TCP (TCP_NODELAY); send() then recv() per layer

Wire format (little endian, no pickle): a request is REQ (magic, seq, layer, rows,
hidden) then experts int64[rows], weights float32[rows], xn float32[rows, hidden] (in
that order: each array starts aligned); a response is RESP (magic, seq, status, nbytes)
then nbytes: the unsummed outputs float32[rows, hidden] (status 0) or a UTF-8 error
message (status 1: the shard refused the request, e.g. an expert not placed there).

One request in flight per connection: send() first reads any answer the driver never
collected (a step that failed at another shard's result), so a stale answer is never
taken for the next layer's and a shard never blocks writing one while the driver writes.
"""
from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import threading
import time

import numpy as np

MAGIC = 0x3153_4B43                         # "CKS1"
REQ = struct.Struct("<IIiII")               # magic, seq, layer, rows, hidden
RESP = struct.Struct("<IIIQ")               # magic, seq, status, nbytes
TRANSPORTS = ("auto", "tcp")                # auto: the Unix socket on the same host


class ChannelClosed(Exception):
    """The socket closed, reset, timed out or fell out of step: the shard is down."""


def host_id() -> str:
    """This machine (a Unix socket reaches only the same host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


# --------------------------------------------------------------------- the actor's end

class ChannelServer:
    """Listens for the driver; compute(layer, xn, experts, weights) -> float32[rows, H]."""

    def __init__(self, compute, ip: str):
        self._compute = compute
        if sys.platform.startswith("linux"):   # abstract: nothing left behind on a kill
            unix = f"\0colibri-shard-{os.getpid()}-{secrets.token_hex(6)}"
        else:
            import tempfile
            unix = os.path.join(tempfile.mkdtemp(prefix="colibri-shard-"), "s")
        self._listen = [_listener(socket.AF_UNIX, unix),
                        _listener(socket.AF_INET6 if ":" in ip else socket.AF_INET, (ip, 0))]
        self.address = {"host": host_id(), "unix": unix,
                        "tcp": [ip, self._listen[1].getsockname()[1]]}
        for s in self._listen:
            threading.Thread(target=self._accept, args=(s,), daemon=True,
                             name="colibri-shard-accept").start()

    def _accept(self, lsock) -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:                     # closed
                return
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="colibri-shard-conn").start()

    def _serve(self, conn) -> None:
        head, buf = bytearray(REQ.size), bytearray()
        with conn:
            try:
                while _read(conn, memoryview(head)):
                    magic, seq, layer, rows, hidden = REQ.unpack(head)
                    if magic != MAGIC:
                        return
                    need = rows * (12 + 4 * hidden)
                    if len(buf) < need:
                        buf = bytearray(need)
                    if need and not _read(conn, memoryview(buf)[:need]):
                        return
                    experts = np.frombuffer(buf, np.int64, rows)
                    weights = np.frombuffer(buf, np.float32, rows, 8 * rows)
                    xn = np.frombuffer(buf, np.float32, rows * hidden, 12 * rows)
                    try:
                        body = self._compute(layer, xn.reshape(rows, hidden), experts, weights)
                        body, status = memoryview(np.ascontiguousarray(body, np.float32)).cast("B"), 0
                    except Exception as e:  # noqa: BLE001 - the driver raises it
                        body, status = memoryview(str(e).encode()), 1
                    _send(conn, [RESP.pack(MAGIC, seq, status, body.nbytes), body])
            except OSError:                     # the driver went away
                return

    def close(self) -> None:
        for s in self._listen:
            try:
                s.shutdown(socket.SHUT_RDWR)    # wakes its accept (close alone does not)
            except OSError:
                pass
            s.close()


def _listener(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind(address)
    s.listen(8)
    return s


def _read(conn, view) -> bool:
    """Fills view (blocking); False on EOF."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _send(sock, parts: list) -> None:
    """Every byte of parts (one sendmsg when the socket takes them all)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = sock.sendmsg(views)
        while n:
            if n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            else:
                views[0], n = views[0][n:], 0
        views = [v for v in views if v.nbytes]


# -------------------------------------------------------------------- the driver's end

class Channel:
    """The driver's connection to one shard's ChannelServer (`address`). send() and
    recv() raise ChannelClosed when the shard cannot answer (EOF, reset, timeout)."""

    def __init__(self, address: dict, transport: str = "auto", timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.sock, self.kind = _connect(address, transport, timeout_s)
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self._head = bytearray(RESP.size)
        self._out = np.empty(0, np.float32)     # the results' buffer, grown as needed
        self._seq = 0
        self._pending: list[int] = []           # sent, not read

    def send(self, layer: int, xn, experts, weights):
        """Sends a layer's pairs; returns the handle recv() takes."""
        while self._pending:                    # an answer no one collected
            self._next(time.monotonic() + self.timeout_s)
        rows, hidden = xn.shape
        self._seq = (self._seq + 1) & 0xFFFF_FFFF
        parts = [REQ.pack(MAGIC, self._seq, layer, rows, hidden),
                 np.ascontiguousarray(experts, np.int64), np.ascontiguousarray(weights, np.float32),
                 np.ascontiguousarray(xn, np.float32)]
        try:
            self.sock.settimeout(self.timeout_s)
            _send(self.sock, parts)
        except socket.timeout:
            raise ChannelClosed(f"its socket took no request within {self.timeout_s:g} s") from None
        except OSError as e:
            raise ChannelClosed(f"its socket failed ({type(e).__name__})") from None
        self._pending.append(self._seq)
        return self._seq, rows, hidden

    def recv(self, handle, deadline_s: float, timeout_s: float):
        """(float32[rows, hidden] in this channel's buffer: valid until the next recv,
        whether it came later than deadline_s). RuntimeError if the shard refused."""
        seq, rows, hidden = handle
        t0 = time.monotonic()
        slow = not self._poll.poll(deadline_s * 1e3)    # nothing back by the deadline
        got, status, body = self._next(t0 + timeout_s)
        if got != seq:
            raise ChannelClosed(f"its answer is out of step (seq {got}, expected {seq})")
        if status:
            raise RuntimeError(bytes(body).decode(errors="replace"))
        if body.nbytes != rows * hidden * 4:
            raise ChannelClosed(f"its answer has {body.nbytes} bytes, expected "
                                f"{rows * hidden * 4}")
        return self._out[:rows * hidden].reshape(rows, hidden), slow

    def _next(self, end: float):
        """Reads the next answer: (seq, status, its body in the buffer)."""
        self._read(memoryview(self._head), end)
        magic, seq, status, nbytes = RESP.unpack(self._head)
        if magic != MAGIC or not self._pending or seq != self._pending[0]:
            raise ChannelClosed(f"its answer is out of step (seq {seq}, magic {magic:#x})")
        self._pending.pop(0)
        if self._out.nbytes < nbytes:
            self._out = np.empty((nbytes + 3) // 4, np.float32)
        body = memoryview(self._out).cast("B")[:nbytes]
        self._read(body, end)
        return seq, status, body

    def _read(self, view, end: float) -> None:
        got = 0
        while got < view.nbytes:
            left = end - time.monotonic()
            if left <= 0:
                raise ChannelClosed(f"no answer within {self.timeout_s:g} s")
            try:
                self.sock.settimeout(left)
                n = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise ChannelClosed(f"no answer within {self.timeout_s:g} s") from None
            except OSError as e:
                raise ChannelClosed(f"its socket failed ({type(e).__name__})") from None
            if n == 0:
                raise ChannelClosed("its socket closed")
            got += n

    def close(self) -> None:
        self.sock.close()


def _connect(address: dict, transport: str, timeout_s: float):
    """(socket, "unix" | "tcp"): the Unix socket when on the shard's host, else TCP."""
    if transport not in TRANSPORTS:
        raise ValueError(f"expert shard transport {transport!r}: expected one of {TRANSPORTS}")
    if transport == "auto" and address["host"] == host_id():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            s.connect(address["unix"])
            return s, "unix"
        except OSError:                         # another network namespace: TCP
            s.close()
    ip, port = address["tcp"]
    try:
        s = socket.create_connection((ip, port), timeout=timeout_s)
    except OSError as e:
        raise ChannelClosed(f"cannot connect to {ip}:{port} ({type(e).__name__})") from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s, "tcp"
