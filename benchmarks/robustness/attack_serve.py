"""`colibri serve` under attack: the cases of issue 38, each with its status, time, the
longest /health wait while it ran, and the server's RSS after it.

    python -m benchmarks.robustness.attack_serve                     # every case, a table on stdout
    python -m benchmarks.robustness.attack_serve --json out.json -k score

The server is the built-in model on 127.0.0.1 and a free port, with uploads on (a key
and an allowlist). A thread asks /health every 20 ms throughout (the target: within
200 ms on a quiet machine). Every case is bounded in count and time.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.server_helpers import LiveServer

KEY = "attack-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPLOAD = b"\x7fELF not really an expert" * 40


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class HealthProbe:
    """/health every 20 ms on a connection of its own; the longest wait per window."""

    def __init__(self, url: str):
        self.url = url
        self.worst = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    c.get(self.url + "/health")
                except httpx.HTTPError:
                    pass
                self.worst = max(self.worst, time.perf_counter() - t0)
                time.sleep(0.02)

    def window(self) -> float:
        w, self.worst = self.worst, 0.0
        return w


def post(url, path, body=None, raw=None, timeout=120, headers=None):
    h = {"content-type": "application/json", **AUTH, **(headers or {})}
    data = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(url + path, content=data, headers=h, timeout=timeout)
    return r.status_code, len(r.content), r


def raw_socket(url: str):
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes `s` (None: still open after `seconds`)."""
    t0 = time.monotonic()
    s.settimeout(0.5)
    while time.monotonic() - t0 < seconds:
        try:
            got = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
        if not got:
            return time.monotonic() - t0
    return None


# ----------------------------------------------------------------------------- cases

def cases(url: str, server: LiveServer, expdir: Path):
    nested = b"[" * 100_000
    for route in ("/v1/completions", "/v1/score", "/v1/chat/completions"):
        yield f"nested JSON [x100000 {route}", lambda r=route: post(url, r, raw=nested)[:2]
    for what, body in (("candidates: 5", {"prompt": "a", "candidates": 5}),
                       ("candidates: true", {"prompt": "a", "candidates": True}),
                       ("items[0].candidates: 5", {"items": [{"prompt": "a", "candidates": 5}]}),
                       ("items: [7]", {"items": [7]})):
        yield f"score {what}", lambda b=body: post(url, "/v1/score", b)[:2]

    def uploads():
        def one(_):
            return httpx.put(url + "/v1/experts/same", content=UPLOAD, headers=AUTH,
                             timeout=60).status_code
        with ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(one, range(8)))
        return ",".join(map(str, sorted(codes))), 0
    yield "8 concurrent PUT /v1/experts/same", uploads

    def disconnect_mid_body():
        n0 = len(server.lines)
        s = raw_socket(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\nauthorization: Bearer " + KEY.encode() +
                  b"\r\ncontent-length: 100000\r\n\r\n{\"prompt\": \"")
        time.sleep(0.3)
        s.close()
        time.sleep(1.0)
        log = "\n".join(server.lines[n0:])
        return ("traceback" if "Traceback" in log else "no traceback") + \
            (", 500 logged" if " 500 " in log else ""), 0
    yield "client disconnects mid-body", disconnect_mid_body

    big = "word " * (8 * 1024 * 1024 // 5)
    yield "score 8 MB prompt", lambda: post(url, "/v1/score", {"prompt": big,
                                                                "candidates": [" x"]})[:2]
    msg = "hello " * (3_900_000 // 6)
    yield "chat 3.9 MB message", lambda: post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": msg}], "max_tokens": 1})[:2]

    base = {"prompt": "The", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    t = {}

    def plain():
        t0 = time.perf_counter()
        out = post(url, "/v1/completions", base)[:2]
        t["plain"] = time.perf_counter() - t0
        return out
    yield "2000 tokens, no stop strings", plain

    def stops():
        t0 = time.perf_counter()
        code, size = post(url, "/v1/completions", {**base, "stop": [
            c * 8000 for c in "qzxj"]})[:2]
        ratio = (time.perf_counter() - t0) / max(t.get("plain", 1e-9), 1e-9)
        return f"{code} ({ratio:.1f}x)", size
    yield "2000 tokens, 4 stop strings of 8000 chars", stops

    def stops_at_cap():
        t0 = time.perf_counter()
        code, size = post(url, "/v1/completions", {**base, "stop": [
            c * 1024 for c in "qzxj"]})[:2]
        ratio = (time.perf_counter() - t0) / max(t.get("plain", 1e-9), 1e-9)
        return f"{code} ({ratio:.1f}x)", size
    yield "2000 tokens, 4 stop strings of 1024 chars", stops_at_cap

    def slow_headers():
        s = raw_socket(url)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        after = closed_within(s, 15)
        s.close()
        return ("never closed (15 s)" if after is None else f"closed after {after:.1f} s"), 0
    yield "slow headers (never finished)", slow_headers

    def slow_body():
        s = raw_socket(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\nauthorization: Bearer " + KEY.encode() +
                  b"\r\ncontent-length: 1000\r\n\r\n{")
        after = closed_within(s, 40)
        s.close()
        return ("never closed (40 s)" if after is None else f"closed after {after:.1f} s"), 0
    yield "slow body (stalls after 1 byte)", slow_body

    prompt = "the cat " * 3900                    # about 31 KB
    yield "echo+logprobs 31 KB prompt", lambda: post(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20})[:2]
    yield "echo+logprobs x64 prompts n=16", lambda: post(url, "/v1/completions", {
        "prompt": [prompt] * 64, "n": 16, "max_tokens": 0, "echo": True, "logprobs": 20},
        timeout=300)[:2]

    def cmdline():
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
        return ("key in argv" if KEY.encode() in argv else "not in argv"), 0
    yield "API key in the command line", cmdline


def run(args) -> list:
    expdir = Path(tempfile.mkdtemp(prefix="attack-experts-"))
    allow = expdir.parent / (expdir.name + ".allow")
    allow.write_text(hashlib.sha256(UPLOAD).hexdigest() + "\n")
    key_args = ["--api-key", KEY] if args.key_in_argv else []
    env = {} if args.key_in_argv else {"COLIBRI_API_KEY": KEY}
    server = LiveServer("--allow-expert-upload", "--expert-allowlist", str(allow), *key_args,
                        "--shutdown-timeout", str(args.grace), experts_dir=expdir, env=env)
    rows = []
    try:
        url = server.url
        probe = HealthProbe(url)
        time.sleep(1.0)
        idle = rss_mib(server.proc.pid)
        probe.window()
        print(f"idle RSS {idle:.0f} MiB", file=sys.stderr)
        for name, fn in cases(url, server, expdir):
            if args.k and args.k not in name:
                continue
            t0 = time.perf_counter()
            try:
                status, size = fn()
            except Exception as e:  # noqa: BLE001 - a case that fails is a result
                status, size = f"client error {type(e).__name__}: {e}"[:80], 0
            dt = time.perf_counter() - t0
            time.sleep(0.3)
            row = {"case": name, "status": str(status), "bytes": size, "time_s": round(dt, 2),
                   "health_max_ms": round(probe.window() * 1000, 1),
                   "rss_mib": round(rss_mib(server.proc.pid), 1)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        time.sleep(3.0)                           # the idle trim's chance
        rows.append({"case": "RSS after the load (idle 3 s)", "status": "", "bytes": 0,
                     "time_s": 0, "health_max_ms": round(probe.window() * 1000, 1),
                     "rss_mib": round(rss_mib(server.proc.pid), 1),
                     "idle_rss_mib": round(idle, 1)})
        if not args.k or "SIGTERM" in args.k:
            rows.append(sigterm_case(server, args.grace))
        probe.stop.set()
    finally:
        server.stop()
        tb = [ln for ln in server.lines if "Traceback" in ln]
        print(f"tracebacks in the server log: {len(tb)}", file=sys.stderr)
        if args.log:
            Path(args.log).write_text(server.log() + "\n")
    return rows


def sigterm_case(server: LiveServer, grace: float) -> dict:
    """A stream still running when the grace period ends: error event, then [DONE]?"""
    url, got = server.url, []

    def read():
        with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=60, json={
                "prompt": "The", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                "stream": True, "n": 16}) as r:
            try:
                for line in r.iter_lines():
                    if line:
                        got.append(line)
            except httpx.HTTPError as e:
                got.append(f"client: {type(e).__name__}")
    t = threading.Thread(target=read)
    t.start()
    time.sleep(2.0)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    rc = server.proc.wait(60)
    err = any('"error"' in x for x in got[-3:])
    done = bool(got) and got[-1] == "data: [DONE]"
    return {"case": f"SIGTERM, stream past the {grace:g} s grace", "status":
            f"exit {rc}, error event {'yes' if err else 'no'}, [DONE] {'yes' if done else 'no'}",
            "bytes": 0, "time_s": round(time.perf_counter() - t0, 2), "health_max_ms": 0,
            "rss_mib": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", help="only the cases whose name contains this")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--log", help="write the server's log here")
    ap.add_argument("--grace", type=float, default=3.0,
                    help="the server's --shutdown-timeout (the SIGTERM case outlives it)")
    ap.add_argument("--key-in-argv", action="store_true",
                    help="pass the key as --api-key (the old way) instead of the environment")
    args = ap.parse_args()
    rows = run(args)
    print("| case | status | answer bytes | time s | /health max ms | RSS MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['status']} | {r['bytes']} | {r['time_s']} | "
              f"{r['health_max_ms']} | {r['rss_mib']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
