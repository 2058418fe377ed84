"""Serving behaviour of `colibri serve`: API key, strict parameters, the upload switch,
a disconnect giving back its place, SIGTERM, the request timeout. Each test that
needs other options starts its own server (subprocess, port 0)."""
from __future__ import annotations

import hashlib
import threading
import time

import httpx
import pytest

from server_helpers import LiveServer, metric

KEY = "sekret-test-key"
LONG = {"prompt": "The assert statement", "max_tokens": 250, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture
def experts_dir(tmp_path):
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    return d


def test_api_key_strict_params_and_upload(experts_dir, tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    so = compile_test_expert(tmp_path / "up.so", hidden=128, layer=1,
                             name="uploaded", version="3.1")
    data = so.read_bytes()
    allow = tmp_path / "allow.txt"
    allow.write_text(hashlib.sha256(data).hexdigest() + "\n")
    srv = LiveServer("--strict-params", "--allow-expert-upload", "--expert-allowlist",
                     str(allow), "--no-routing-stats", experts_dir=experts_dir,
                     env={"COLIBRI_API_KEY": KEY})
    try:
        u = srv.url
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(u + "/v1/models").status_code == 401
        assert httpx.get(u + "/v1/models", headers={"Authorization": "Bearer nope"}
                         ).json()["error"]["type"] == "authentication_error"
        assert httpx.get(u + "/v1/models", headers=auth).status_code == 200
        for open_route in ("/health", "/ready", "/metrics"):
            assert httpx.get(u + open_route).status_code == 200
        r = httpx.post(u + "/v1/completions", headers=auth,
                       json={"prompt": "x", "max_tokens": 1, "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        r = httpx.post(u + "/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 200
        assert httpx.get(u + "/status.json").json()["routing_stats"] is False
        assert "colibri_routed_tokens_total{" not in httpx.get(u + "/metrics").text
        assert httpx.put(u + "/v1/experts/uploaded", content=data).status_code == 401
        wrong = httpx.put(u + "/v1/experts/uploaded", content=data + b"\0", headers=auth)
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "allowlist"
        bad_name = httpx.put(u + "/v1/experts/..%2Fx", content=data, headers=auth)
        assert bad_name.status_code in (400, 404)
        ok = httpx.put(u + "/v1/experts/uploaded", content=data, headers=auth)
        assert ok.status_code == 202, ok.text
        assert (experts_dir / "uploaded.so").read_bytes() == data
        assert not [p for p in experts_dir.iterdir() if p.name.endswith(".upload")]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = httpx.get(u + "/v1/experts", headers=auth).json()["data"]
            if any(e["name"] == "uploaded" and e["status"] == "active" for e in rows):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the uploaded expert was not adopted within 30 s")
    finally:
        srv.stop()


def test_upload_needs_key_and_allowlist(experts_dir):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "colibri_core", "serve", "--port", "0",
                        "--experts-dir", str(experts_dir), "--allow-expert-upload"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in __import__("os").environ.items()
                            if k != "COLIBRI_API_KEY"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("colibri: error: --allow-expert-upload")


def test_disconnect_frees_place_sigterm_exits_0(experts_dir):
    """(The full queue's 429: tests/test_server_batching.py.)"""
    srv = LiveServer("--queue-size", "1", experts_dir=experts_dir)
    try:
        u = srv.url
        # 1) a stream that the client abandons after its first chunk
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", u + "/v1/completions",
                          json={**LONG, "n": 16, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
        full = 16 * 250
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = httpx.get(u + "/metrics").text
            if metric(m, "colibri_requests_running") == 0:
                break
            time.sleep(0.05)
        m = httpx.get(u + "/metrics").text
        assert metric(m, "colibri_requests_running") == 0
        assert metric(m, "colibri_requests_cancelled_total", 'why="disconnect"') == 1
        done = metric(m, "colibri_tokens_total", 'kind="completion"')
        time.sleep(0.5)
        m2 = httpx.get(u + "/metrics").text
        assert metric(m2, "colibri_tokens_total", 'kind="completion"') == done < full
        st = httpx.get(u + "/status.json").json()       # its 16 sequences are retired
        assert st["running"] == st["queue_depth"] == 0
        assert st["kv_pool"]["free_tokens"] == st["kv_pool"]["capacity_tokens"]
        # 2) SIGTERM while a stream runs: it ends, the server exits 0
        got = []

        def stream():
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", u + "/v1/completions",
                              json={**LONG, "max_tokens": 200, "stream": True}) as r:
                    got.extend(line for line in r.iter_lines() if line)
        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.3)
        assert srv.terminate(timeout=30) == 0
        t.join(30)
        assert got and got[-1] == "data: [DONE]"
        assert "colibri: server stopped" in srv.log()
    finally:
        srv.stop()


def test_request_timeout_and_cors(experts_dir):
    srv = LiveServer("--request-timeout", "1", "--cors-origin", "http://ops.example",
                     experts_dir=experts_dir)
    try:
        u = srv.url
        # 64 prompts x 16 choices x 250 tokens: far more than one second of work
        big = {**LONG, "prompt": ["The assert statement"] * 64, "n": 16}
        r = httpx.post(u + "/v1/completions", json=big, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", u + "/v1/completions", json={**big, "stream": True}) as s:
                lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert '"request_timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
        # 256 x 200 tokens to score: more than a second too; cancelled at the next step
        score = {"items": [{"prompt": [(i * 7 + j) % 500 + 3 for j in range(199)],
                            "candidates": [[5]]} for i in range(256)]}
        r = httpx.post(u + "/v1/score", json=score, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        ok = httpx.post(u + "/v1/completions", json={"prompt": "The", "max_tokens": 4})
        assert ok.status_code == 200                 # the engine is free again
        pre = httpx.options(u + "/v1/completions", headers={
            "Origin": "http://ops.example", "Access-Control-Request-Method": "POST"})
        assert pre.headers.get("access-control-allow-origin") == "http://ops.example"
        other = httpx.options(u + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.headers.get("access-control-allow-origin") is None
    finally:
        srv.stop()

