"""Issue 34 items 1-2 through `colibri serve`: every /v1/score result and every
completion choice names the expert set the engine computed it with, one field name for
all (`expert_set`: {generation, id}); --audit-log writes a line per item, keyed by the
request id, that replays bit for bit."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import LiveServer, wait_until


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("prov")
    experts = d / "experts"
    experts.mkdir(mode=0o755)
    log = d / "audit.jsonl"
    srv = LiveServer("--audit-log", str(log), experts_dir=experts)
    yield srv, log
    srv.stop()


def _lines(log, want):
    def ready():
        if not log.exists():
            return None
        got = [json.loads(x) for x in log.read_text().splitlines()]
        return got if sum(d["kind"] in ("score", "generation") for d in got) >= want else None
    return wait_until(ready, f"{want} audit lines")


def test_every_answer_names_its_items_set_and_the_log_replays(served):
    srv, log = served
    listing = httpx.get(srv.url + "/v1/experts").json()
    current = {"generation": listing["expert_set_generation"], "id": listing["expert_set_id"]}
    r = httpx.post(srv.url + "/v1/score", headers={"X-Request-ID": "score-1"}, json={
        "items": [{"prompt": "The assert statement", "candidates": [" is", " raises"]},
                  {"prompt": [1, 2, 3], "candidates": [[4], [5, 6]]}]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [res["expert_set"] for res in body["results"]] == [current, current]
    assert body["expert_sets"] == [current]                  # deprecated, still there
    c = httpx.post(srv.url + "/v1/completions", headers={"X-Request-ID": "gen-1"}, json={
        "prompt": "The import system", "max_tokens": 5, "temperature": 0, "n": 2,
        "ignore_eos": True}, timeout=60).json()
    assert [ch["expert_set"] for ch in c["choices"]] == [current, current]
    assert c["expert_sets"] == [{"expert_set_generation": current["generation"],
                                 "expert_set_id": current["id"]}]
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
            "temperature": 0, "stream": True}, timeout=60) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines()
                  if x.startswith("data: {")]
    first = next(ch for ch in chunks if "expert_set" in ch)
    assert first["expert_set"] == current
    assert (first["expert_set_generation"], first["expert_set_id"]) == \
        (current["generation"], current["id"])

    lines = _lines(log, 4 + 2 + 1)
    scores = [d for d in lines if d["kind"] == "score" and d["request_id"] == "score-1"]
    assert len(scores) == 4 and [d["item"] for d in scores] == [0, 1, 2, 3]
    assert all(d["expert_set"] == current and d["all_positions"] for d in scores)
    # the log's log-probs are the answer's: a candidate's is the sum over its tokens
    res = body["results"][1]["candidates"][1]
    d = scores[3]
    assert d["tokens"] == [1, 2, 3, 5, 6]
    assert sum(d["scores"][2:]) == pytest.approx(res["logprob"], abs=1e-9)
    gens = [d for d in lines if d["kind"] == "generation"]
    assert {d["request_id"] for d in gens} >= {"gen-1.0", "gen-1.1"}
    assert all(d["expert_set"] == current and d["output"]["n_tokens"] == 5
               for d in gens if d["request_id"].startswith("gen-1"))

    from colibri_core.engine import Engine
    from colibri_core.replay import replay
    with Engine.from_config("builtin", threads=1) as eng:
        rep = replay(eng, [log])
    assert rep.items >= 4 and rep.differ == []
