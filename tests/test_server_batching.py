"""`colibri serve` on the engine's scheduler (live server on 127.0.0.1, port 0): concurrent
streams share the steps and each gets exactly its solo tokens; a client that goes away
gives back its place and its KV positions; a full queue is a 429 with Retry-After.
Deadlines only, no latencies."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server_helpers import LiveServer, stream_completion, wait_until

PROMPTS = ["The assert statement", "The import system", "A class definition",
           "Exceptions are", "The with statement", "Lists and tuples", "Integer literals",
           "The global namespace"]
LONG = {"max_tokens": 250, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def experts_dir(tmp_path):
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    return d


def _status(url):
    return httpx.get(url + "/status.json", timeout=10).json()


async def _text(url, prompt, n):
    return "".join((await stream_completion(url, prompt, n))[0])


def test_32_streams_batch_and_each_gets_its_solo_tokens(experts_dir):
    from colibri_core.engine import Engine
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    N = 24
    with Engine.from_config("builtin") as ref:
        solo = {p: ref.generate(p, max_new_tokens=N, temperature=0.0).run().text
                for p in set(prompts)}
    srv = LiveServer(experts_dir=experts_dir)
    try:
        running: list = []
        stop = threading.Event()

        def watch():                 # the scheduler's running count while the load runs
            while not stop.is_set():
                running.append(_status(srv.url)["running"])
                time.sleep(0.05)

        async def load():
            return await asyncio.gather(*(_text(srv.url, p, N) for p in prompts))
        w = threading.Thread(target=watch)
        w.start()
        try:
            got = asyncio.run(asyncio.wait_for(load(), 120))
        finally:
            stop.set()
            w.join()
        assert got == [solo[p] for p in prompts]
        assert max(running) > 1, "the streams shared the engine's steps"
        # n > 1: the choices run together and equal the solo text (greedy)
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "n": 4}, timeout=60).json()
        assert [c["text"] for c in r["choices"]] == [solo[PROMPTS[0]]] * 4
        assert r["usage"]["completion_tokens"] == 4 * N
    finally:
        srv.stop()


def test_disconnect_frees_place_and_kv_and_full_queue_is_429(experts_dir, tmp_path):
    # A KV pool for one sequence of the full context and a queue of one: a request of 8
    # such choices runs one and has the next waiting; another request is refused.
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: builtin\nengine:\n  threads: 2\n  kv_pool_tokens: 2100\n")
    srv = LiveServer("--config", str(cfg), "--queue-size", "1", experts_dir=experts_dir)
    try:
        u = srv.url
        full = _status(u)["kv_pool"]["capacity_tokens"]
        assert full == 2100
        first, leave = threading.Event(), threading.Event()

        def stream():                 # reads on (leaving the loop closes the connection)
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", u + "/v1/completions", json={
                        **LONG, "prompt": PROMPTS[0], "max_tokens": 2040, "n": 8,
                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            first.set()
                        if leave.is_set():
                            break
        t = threading.Thread(target=stream)
        t.start()
        try:
            assert first.wait(30), "the stream started"
            wait_until(lambda: _status(u)["queue_depth"] == 1, "a second choice waits")
            refused = httpx.post(u + "/v1/completions",
                                 json={**LONG, "prompt": PROMPTS[2]}, timeout=60)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            err = refused.json()["error"]
            assert (err["type"], err["code"]) == ("rate_limit_error", "engine_busy")
        finally:
            leave.set()               # the client goes away: its sequences leave the engine
            t.join(60)
        wait_until(lambda: (lambda s: s["running"] == 0 and s["queue_depth"] == 0 and
                        s["kv_pool"]["free_tokens"] == full)(_status(u)),
               "the KV pool is back to full")
        ok = httpx.post(u + "/v1/completions", json={**LONG, "prompt": PROMPTS[1]}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 250
    finally:
        srv.stop()
