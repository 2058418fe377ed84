"""Training in the loop against a live `colibri serve` (issue 35 item 4): POST
/v1/experts/train is off by default, needs the API key, runs one job at a time, refuses
bad examples with a one-line 400 naming the field; a job trains the card-testing expert
with the fraud example's recipe, lands in shadow/ as a candidate, and the gate promotes it
on labelled feedback -- the expected verdict worked out in this process from an engine
with the built file live.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from server_helpers import LiveServer, training_server, wait_until

FRAUD_DIR = Path(__file__).resolve().parent.parent / "examples" / "fraud"
sys.path.insert(0, str(FRAUD_DIR))
from fraud_common import CONFIG  # noqa: E402
from fraud_stream import FRAUD, OK  # noqa: E402
from run_demo import make_stream  # noqa: E402

from colibri_core.engine import Engine  # noqa: E402
from test_server_candidates import THRESHOLD, ref_logprobs, verdict  # noqa: E402

KEY = "train-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def examples(n: int, seed: int) -> list[dict]:
    txns = make_stream(n, seed, 0.04, 0.12)
    return [{"prompt": tx.token_ids(), "target": FRAUD if tx.is_fraud else OK,
             "route": tx.pattern == "card_testing"} for tx in txns]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with training_server(tmp_path_factory.mktemp("train"), CONFIG, KEY) as w:
        yield w


def post(url, body, status, path="/v1/experts/train", headers=AUTH):
    r = httpx.post(url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def job(url, jid):
    r = httpx.get(f"{url}/v1/experts/train/{jid}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_training_is_off_by_default(tmp_path):
    experts = tmp_path / "experts"
    experts.mkdir(mode=0o700)
    (experts / "shadow").mkdir(mode=0o700)
    srv = LiveServer("--config", str(CONFIG), experts_dir=experts)
    try:
        err = post(srv.url, {"name": "x", "examples": examples(40, 1)}, 403, headers={})
        assert err["error"]["code"] == "training_disabled"
        assert "--allow-expert-training" in err["error"]["message"]
    finally:
        srv.stop()


def test_training_needs_a_key_and_an_allowlist_to_start(tmp_path):
    import os
    import subprocess
    (tmp_path / "a").write_text("0" * 64 + "\n")
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_API_KEY"}
    for extra in ([], ["--expert-allowlist", str(tmp_path / "a")],
                  ["--api-key-file", str(tmp_path / "a")]):          # a key, no allowlist
        r = subprocess.run([sys.executable, "-m", "colibri_core", "serve", "--config",
                            str(CONFIG), "--port", "0", "--allow-expert-training", *extra],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and "--allow-expert-training needs an API key" in r.stderr


def test_bad_requests_name_the_field(world):
    url = world["url"]
    ex = examples(60, 2)
    assert post(url, {"name": "x", "examples": ex}, 401, headers={})["error"]["code"] == \
        "invalid_api_key"
    cases = [({"name": "x", "examples": ex[:3]}, "examples"),
             ({"name": "../x", "examples": ex}, "name"),
             ({"name": "x", "examples": ex, "steps": 0}, "steps"),
             ({"name": "x", "examples": ex, "colour": 1}, "colour"),
             ({"name": "x", "examples": [dict(e, route=False) for e in ex]}, "examples"),
             ({"name": "x", "examples": ex[:5] + [dict(ex[5], target=10**6)] + ex[6:]},
              "examples[5].target"),
             ({"name": "x", "examples": ex[:7] + [dict(ex[7], prompt=[1, -2])] + ex[8:]},
              "examples[7].prompt"),
             ({"name": "x", "examples": ex[:9] + [dict(ex[9], route="yes")] + ex[10:]},
              "examples[9].route"),
             ({"name": "x", "path": "../allow.txt"}, "path"),
             ({"name": "x", "examples": ex, "path": "a.jsonl"}, "examples")]
    for body, param in cases:
        e = post(url, body, 400)["error"]
        assert e["param"] == param and "\n" not in e["message"], (param, e)
        assert e["message"].startswith(param.split("[")[0]), e["message"]
    (world["data"] / "bad.jsonl").write_text('{"prompt": [1, 2], "target": 3}\nnot json\n')
    e = post(url, {"name": "x", "path": "bad.jsonl"}, 400)["error"]
    assert e["param"] == "path" and "line 2" in e["message"]
    assert httpx.get(url + "/v1/experts/train", headers=AUTH).json()["data"] == []  # no job


def test_a_failed_job_says_why(world):
    url = world["url"]
    j = post(url, {"name": "early", "examples": examples(60, 3), "layer": 1}, 202)
    assert j["status"] in ("queued", "running")
    done = wait_until(lambda: (x := job(url, j["id"]))["status"] == "failed" and x,
                      "the job failed", timeout=120)
    assert "layer 1" in done["reason"] and "last layer" in done["reason"]
    assert "\n" not in done["reason"]
    ev = httpx.get(url + "/v1/experts/events", headers=AUTH).json()["data"]
    assert [e["event"] for e in ev if e["reason"] == j["id"]] == \
        ["train_queued", "train_running", "train_failed"]


def test_trained_candidate_is_promoted_by_its_gate(world):
    url, tmp = world["url"], world["tmp"]
    ex = examples(12000, 4)
    import json
    (world["data"] / "ct.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ex))
    j = post(url, {"name": "ct_trained", "path": "ct.jsonl", "steps": 400}, 202)
    busy = post(url, {"name": "other", "examples": ex[:100]}, 409)["error"]
    assert j["id"] in busy["message"] and busy["code"] == "training_busy"
    done = wait_until(lambda: (x := job(url, j["id"]))["status"] in ("built", "failed") and x,
                      "the job built", timeout=900)
    assert done["status"] == "built", done["reason"]
    so = world["experts"] / "shadow" / "ct_trained.so"
    assert done["candidate"] == str(so) and done["result"]["examples"] == len(ex)
    ref_dir = tmp / "ref"
    ref_dir.mkdir(mode=0o700)
    shutil.copyfile(so, ref_dir / "ct_trained.so")
    cand = wait_until(lambda: next((c for c in httpx.get(url + "/v1/experts", headers=AUTH)
                                    .json()["candidates"] if c["name"] == "ct_trained"
                                    and c["state"] == "shadow"), None), "in shadow")
    assert cand["version"] == "1"
    post(url, {"threshold": THRESHOLD, "min_positives": 10, "auto": True}, 200,
         path="/v1/experts/candidates/ct_trained")
    txns = make_stream(300, 14, 0.05, 0.10)
    labels = np.array([tx.pattern != "legit" for tx in txns])
    score_auth(url, txns, "train-gate")
    with Engine.from_config(CONFIG) as base, \
            Engine.from_config(CONFIG, experts_dir=str(ref_dir)) as trained:
        want = verdict(ref_logprobs(base, txns), ref_logprobs(trained, txns), labels)
        trained_id = trained.expert_set_id
    wait_until(lambda: httpx.get(url + "/v1/experts", headers=AUTH).json()["candidates"][0]
               ["gate"]["pending"] == 0, "the shadow pass")
    fb = post(url, {"items": [{"request_id": "train-gate", "item": i, "label": bool(y)}
                              for i, y in enumerate(labels)]}, 200, path="/v1/experts/feedback")
    assert want == "promote" and fb["decisions"] == {"ct_trained": "promote"}
    wait_until(lambda: httpx.get(url + "/v1/experts", headers=AUTH).json()["expert_set_id"]
               == trained_id, "promoted by the gate")
    ev = [(e["event"], e["reason"]) for e in
          httpx.get(url + "/v1/experts/events", headers=AUTH).json()["data"]
          if e["name"] == "ct_trained"]
    assert ev[:3] == [("train_queued", j["id"]), ("train_running", j["id"]),
                      ("train_built", j["id"])]
    assert ("promote", "gate") in ev


def score_auth(url, txns, rid):
    items = [{"prompt": tx.token_ids(), "candidates": [[FRAUD]]} for tx in txns]
    r = httpx.post(url + "/v1/score", json={"items": items},
                   headers={"X-Request-ID": rid, **AUTH}, timeout=120)
    assert r.status_code == 200, r.text


