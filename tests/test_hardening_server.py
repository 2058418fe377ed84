"""`colibri serve` under attack (issue 38): no 500, no stall, bounded memory, clean
signals and secrets. One live server (subprocess, 127.0.0.1, port 0) for the module;
tests that need other options start their own. Every case is bounded in count and time;
latency bounds are generous (a noisy 2-core machine): /health within 1 s here, the
200 ms target is measured by benchmarks/robustness/attack_serve.py."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_helpers import LiveServer

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UPLOAD = b"\x7fELF not an expert " * 64
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    experts = d / "experts"
    experts.mkdir(mode=0o755)
    allow = d / "allow.txt"
    allow.write_text(hashlib.sha256(UPLOAD).hexdigest() + "\n")
    keyfile = d / "key"
    keyfile.write_text(KEY + "\n")
    s = LiveServer("--allow-expert-upload", "--expert-allowlist", str(allow),
                   "--api-key-file", str(keyfile), "--client-timeout", "1",
                   experts_dir=experts)
    s.experts = experts
    yield s
    s.stop()


def post(srv, path, body=None, raw=None, timeout=120):
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, timeout=timeout,
                      headers={"content-type": "application/json", **AUTH})


def assert_error(r, status, *words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert "\n" not in err["message"]
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)


class Health:
    """/health every 20 ms on a connection of its own while the block runs."""

    def __init__(self, url):
        self.url, self.worst, self.stop = url, 0.0, threading.Event()

    def __enter__(self):
        def run():
            with httpx.Client(timeout=30) as c:
                while not self.stop.is_set():
                    t0 = time.perf_counter()
                    assert c.get(self.url + "/health").status_code == 200
                    self.worst = max(self.worst, time.perf_counter() - t0)
                    time.sleep(0.02)
        self.t = threading.Thread(target=run, daemon=True)
        self.t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(30)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def no_tracebacks(srv):
    assert not [ln for ln in srv.lines if "Traceback" in ln], srv.log()


# ----------------------------------------------------------------------------- no 500

class TestNo500:
    @pytest.mark.parametrize("route", ["/v1/completions", "/v1/score", "/v1/chat/completions"])
    def test_deeply_nested_json_is_a_400(self, srv, route):
        assert_error(post(srv, route, raw=b"[" * 100_000), 400, "nested too deeply")
        assert_error(post(srv, route, raw=b'{"a":' * 50_000), 400, "nested too deeply")

    @pytest.mark.parametrize("body,param", [
        ({"prompt": "a", "candidates": 5}, "candidates"),
        ({"prompt": "a", "candidates": True}, "candidates"),
        ({"prompt": "a", "candidates": "x"}, "candidates"),
        ({"prompt": "a", "candidates": [None]}, "candidates[0]"),
        ({"prompt": "a", "candidates": [[1, True]]}, "candidates[0]"),
        ({"prompt": 7, "candidates": ["x"]}, "prompt"),
        ({"prompt": [1, 2], "candidates": ["x"]}, "candidates[0]"),
        ({"items": [{"prompt": "a", "candidates": 5}]}, "items[0].candidates"),
        ({"items": [{"prompt": "a", "candidates": False}]}, "items[0].candidates"),
        ({"items": [7]}, "items"),
        ({"items": {"prompt": "a"}}, "items"),
        ({"prompt": "a", "candidates": ["x"], "experts_per_token": "2"}, "experts_per_token"),
    ])
    def test_score_fields_of_the_wrong_type_are_400s(self, srv, body, param):
        assert_error(post(srv, "/v1/score", body), 400, param)

    @pytest.mark.parametrize("route,body,param", [
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "9"}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "n": 1e300}, "n"),
        ("/v1/completions", {"prompt": "a", "temperature": [1]}, "temperature"),
        ("/v1/completions", {"prompt": "a", "stop": [1]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ["x" * 1025]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(1025)}},
         "logit_bias"),
        ("/v1/completions", {"prompt": "a", "stream_options": 3, "stream": True},
         "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ])
    def test_generation_fields_of_the_wrong_type_are_400s(self, srv, route, body, param):
        assert_error(post(srv, route, body), 400, param)

    def test_bodies_that_are_not_json_objects(self, srv):
        for raw in (b"", b"\xff\xfe", b"[1]", b"nul", b'"x"', b"1" * 5000, b"NaN"):
            r = post(srv, "/v1/completions", raw=raw)
            assert r.status_code == 400, (raw[:20], r.text)

    def test_concurrent_uploads_of_one_name_all_succeed(self, srv):
        def put(_):
            return httpx.put(srv.url + "/v1/experts/same", content=UPLOAD, headers=AUTH,
                             timeout=60).status_code
        with ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(put, range(8)))
        assert codes == [202] * 8
        assert (srv.experts / "same.so").read_bytes() == UPLOAD
        assert not list(srv.experts.glob(".*.upload"))

    def test_client_gone_mid_body_is_one_line(self, srv):
        n0 = len(srv.lines)
        s = socket.create_connection(srv.url.removeprefix("http://").split(":"), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                  + KEY.encode() + b"\r\ncontent-length: 100000\r\n\r\n{\"prompt\": \"")
        time.sleep(0.3)
        s.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(" completions 499 " in ln
                                                      for ln in srv.lines[n0:]):
            time.sleep(0.05)
        new = srv.lines[n0:]
        assert [ln for ln in new if " completions 499 " in ln], "\n".join(new)
        assert not [ln for ln in new if "Traceback" in ln or " 500 " in ln], "\n".join(new)

    def test_many_unknown_fields_are_one_log_line(self, caplog):
        from colibri_core.server.params import check_fields
        body = {"prompt": "a", **{f"x{i}": i for i in range(20_000)}}
        with caplog.at_level("INFO", logger="colibri.server"):
            check_fields(body, "completions", False, "req-1")
        lines = [r.getMessage() for r in caplog.records if "unknown field" in r.getMessage()]
        assert len(lines) == 1 and "19992 more" in lines[0], lines[:2]

    def test_fuzzed_bodies_never_500(self, srv):
        """Random JSON values in every field of each route: 2xx or 4xx, never 5xx."""
        rng = random.Random(38)
        values = [None, True, -1, 0, 2**70, 1.5, float("inf"), "", "x" * 300, [], [1, "a"],
                  {}, {"a": [1]}, [[1, 2], [3]], [-5], ["a", "b"]]
        fields = {"/v1/completions": ["prompt", "max_tokens", "n", "stop", "logprobs", "echo",
                                      "logit_bias", "seed", "top_p", "stream_options"],
                  "/v1/chat/completions": ["messages", "max_completion_tokens", "logprobs",
                                           "top_logprobs", "stop", "n"],
                  "/v1/score": ["prompt", "candidates", "items", "experts_per_token"]}
        base = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                         "max_completion_tokens": 2},
                "/v1/score": {"prompt": "hi", "candidates": [" a"]}}
        for _ in range(60):
            route = rng.choice(sorted(fields))
            body = dict(base[route])
            for f in rng.sample(fields[route], rng.randint(1, 3)):
                body[f] = rng.choice(values)
            raw = json.dumps(body, allow_nan=True).encode()
            r = post(srv, route, raw=raw, timeout=60)
            assert r.status_code < 500, (body, r.text)
        no_tracebacks(srv)


# ----------------------------------------------------------------------------- stalls

class TestNoStall:
    def test_huge_score_prompt_is_refused_before_tokenizing(self, srv):
        big = "word " * (8 * 1024 * 1024 // 5)
        with Health(srv.url) as h:
            t0 = time.perf_counter()
            r = post(srv, "/v1/score", {"prompt": big, "candidates": [" x"]})
            took = time.perf_counter() - t0
        assert_error(r, 400, "candidates[0]", "context")
        assert took < 10, took                         # was 16-17 s
        assert h.worst < HEALTH_BOUND_S, h.worst       # was 9.3 s

    def test_score_token_ids_per_request_are_bounded_before_any_work(self, srv):
        items = [{"prompt": [7] * 1000, "candidates": [[5], [6]]} for _ in range(600)]
        assert_error(post(srv, "/v1/score", {"items": items}), 413, "max_call_tokens")

    def test_score_characters_per_request_are_bounded(self, srv):
        prompt = "w " * 30_000                           # under the context's bound alone
        r = post(srv, "/v1/score", {"items": [{"prompt": prompt, "candidates": ["x"] * 300}]})
        assert_error(r, 413, "characters")

    def test_huge_chat_message_does_not_block_health(self, srv):
        msg = "hello " * (3_900_000 // 6)
        with Health(srv.url) as h:
            r = post(srv, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": msg}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert h.worst < HEALTH_BOUND_S, h.worst       # was 2.7-4 s

    def test_stop_strings_match_in_linear_time(self):
        from colibri_core.runtime.stops import StopCutter
        stops = [c * 8000 for c in "qzxj"]      # over the HTTP cap: the matcher itself
        cut, sent = StopCutter(stops), ""
        t0 = time.perf_counter()
        for _ in range(2000):
            out, hit = cut.push("qqzxj")
            assert not hit
            sent += out
        assert time.perf_counter() - t0 < 2.0     # 0.01 s; the quadratic matcher took 9.4 s
        assert sent + cut.finish("") == "qqzxj" * 2000

    def test_stop_cutter_agrees_with_a_plain_search(self):
        from colibri_core.runtime.stops import StopCutter
        rng = random.Random(0)
        for _ in range(3000):
            stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                     for _ in range(rng.randint(1, 4))]
            cut, text, sent = StopCutter(stops), "", ""
            for _ in range(rng.randint(1, 12)):
                piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
                text += piece
                out, hit = cut.push(piece)
                sent += out
                first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                assert hit == (first >= 0), (stops, text)
                if hit:
                    assert sent == text[:first], (stops, text, sent)
                    break
                assert text.startswith(sent)
                assert not any(s in text for s in stops)

    def test_slow_headers_and_bodies_are_cut(self, srv):
        host, port = srv.url.removeprefix("http://").split(":")
        for first in (b"", b"GET /health HTTP/1.1\r\nhost: x\r\n",
                      b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
                      b"authorization: Bearer " + KEY.encode() + b"\r\n\r\n{"):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(first)
            t0, got = time.monotonic(), b""
            try:
                while chunk := s.recv(65536):              # the server closes it
                    got += chunk
            except OSError:
                pass
            s.close()
            assert time.monotonic() - t0 < 8, first        # --client-timeout 1
            if first.startswith(b"POST"):
                assert b" 408 " in got.split(b"\r\n", 1)[0], got[:200]


# ----------------------------------------------------------------------------- memory

class TestBoundedMemory:
    def test_answer_size_is_bounded_with_a_413(self, srv):
        prompt = "the cat " * 3900
        t0 = time.perf_counter()
        r = post(srv, "/v1/completions", {"prompt": [prompt] * 64, "n": 16, "max_tokens": 0,
                                          "echo": True, "logprobs": 20})
        assert_error(r, 413, "262,144")
        assert time.perf_counter() - t0 < 60            # was a timeout past 300 s
        r = post(srv, "/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 2000,
                                          "logprobs": 20})
        assert_error(r, 413, "262,144")

    def test_idle_trim_shrinks_the_step_scratch_and_results_stay(self, eng):
        import numpy as np
        seq = [5 + i % 1000 for i in range(1500)]
        before = eng.next_token_logits(seq, all_positions=True).copy()
        greedy = [t.token_id for t in eng.generate("The cat", max_new_tokens=8,
                                                   temperature=0)]
        sc = eng.model.pipeline.scratch
        assert sc.n_max >= 1500
        assert eng.trim_memory() is True and sc.n_max == 64
        assert eng.trim_memory() is False                 # nothing more to give back
        assert [t.token_id for t in eng.generate("The cat", max_new_tokens=8,
                                                 temperature=0)] == greedy
        assert np.array_equal(eng.next_token_logits(seq, all_positions=True), before)

    def test_rss_comes_back_after_large_requests(self, srv):
        """Within the idle size + 20% + the documented caps (docs/ROBUSTNESS.md: the
        step's scratch, shrunk when idle, and a finished thread's cached stack; 24 MiB
        here, generously: measured 2.7 MiB over idle + 20% after the attack run)."""
        pid = srv.proc.pid
        idle = rss_mib(pid)
        prompt = "the cat " * 3900
        for body in ({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20},
                     {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20,
                      "stream": True},
                     {"prompt": [prompt] * 4, "n": 2, "max_tokens": 0, "echo": True,
                      "logprobs": 5}):
            assert post(srv, "/v1/completions", body).status_code == 200
        post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                         "hello " * 600_000}],
                                           "max_tokens": 1})
        deadline, bound = time.monotonic() + 20, idle * 1.2 + 24
        while time.monotonic() < deadline and rss_mib(pid) > bound:
            time.sleep(0.5)
        assert rss_mib(pid) <= bound, (idle, rss_mib(pid), bound)


# ----------------------------------------------------------------------------- signals, secrets

class TestSignalsAndSecrets:
    def test_key_from_a_file_is_not_in_the_command_line(self, srv):
        argv = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert KEY.encode() not in argv
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200

    def test_bad_key_files_are_one_line(self, tmp_path):
        import subprocess
        import sys
        empty = tmp_path / "empty"
        empty.write_text("\n")
        for args in (["--api-key-file", str(tmp_path / "missing")],
                     ["--api-key-file", str(empty)],
                     ["--api-key-file", str(empty), "--api-key", "k"],
                     ["--client-timeout", "0"]):
            r = subprocess.run([sys.executable, "-m", "colibri_core", "serve", "--port", "0",
                                *args], capture_output=True, text=True, timeout=120)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1, r.stderr
            assert lines[0].startswith("colibri: error: "), lines

    def test_stream_past_the_grace_period_ends_with_error_and_done(self, tmp_path):
        d = tmp_path / "experts"
        d.mkdir()
        s = LiveServer("--shutdown-timeout", "1", experts_dir=d)
        got: list = []

        def read():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={
                    "prompt": "The", "max_tokens": 1900, "temperature": 0, "n": 16,
                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        got.append(line)
        t = threading.Thread(target=read)
        try:
            t.start()
            deadline = time.monotonic() + 30
            while len(got) < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            t.join(60)
            assert s.proc.wait(60) == 0
        finally:
            s.stop()
        assert got[-1] == "data: [DONE]", got[-3:]
        err = json.loads(got[-2][len("data: "):])
        assert err["error"]["code"] == "shutting_down", err
        assert "Traceback" not in s.log()

    def test_children_restore_sigint(self):
        """The Ctrl-C tests start their children with SIGINT at its default, so they pass
        from a shell's background job too (`nohup pytest ... &` ignores SIGINT)."""
        import subprocess
        import sys
        code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"

        def ignore():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from robust_helpers import _default_sigint
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             preexec_fn=lambda: (ignore(), _default_sigint()), timeout=60)
        assert got.stdout.strip() == "True", got
        assert os.environ.get("COLIBRI_API_KEY") != KEY
