"""Candidate experts against a live `colibri serve` (issue 35 items 2 and 3): a file in
the watched folder's shadow/ is a candidate; shadow scoring never reaches an answer; a
canary fraction picks requests by a hash of their id, and every item names the set that
computed it (checked bit for bit against this process's engines); promote and demote
round-trip; the gate promotes or drops a candidate on labelled feedback.

The model is the fraud example's; the candidate its card-testing expert (and a broken
copy of it for the gate's drop)."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from server_helpers import LiveServer, metric, wait_until

FRAUD_DIR = Path(__file__).resolve().parent.parent / "examples" / "fraud"
sys.path.insert(0, str(FRAUD_DIR))
from fraud_common import CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER, expert_q4_clip  # noqa: E402
from fraud_stream import FRAUD  # noqa: E402
from run_demo import make_stream  # noqa: E402

from colibri_core.engine import Engine  # noqa: E402
from colibri_core.model.ops import log_softmax  # noqa: E402

THRESHOLD = 0.916          # examples/fraud/scoring.json's


def build(out: Path, name: str, version: str, npz: Path) -> Path:
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.model.fingerprint import fingerprint_of_dir
    so = out / f"{name}-{version}.so"
    build_expert(npz, so, NEW_EXPERT_LAYER, name, version, q4_clip=expert_q4_clip(),
                 base_model=fingerprint_of_dir(MODEL_DIR))
    return so


def drop(so: Path, folder: Path, name: str) -> None:
    tmp = folder / f".{name}.tmp"
    shutil.copyfile(so, tmp)
    os.replace(tmp, folder / name)


def canary(request_id: str, fraction: float) -> bool:
    """The documented rule, worked out here: sha256 of the id, first 8 bytes, < fraction."""
    d = hashlib.sha256(request_id.encode()).digest()
    return int.from_bytes(d[:8], "big") / 2.0 ** 64 < fraction


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cand")
    good = build(tmp, "card_testing", "1", EXPERT_NPZ)
    bad_npz = tmp / "bad.npz"                  # always chosen, and pulls the wrong way
    z = dict(np.load(EXPERT_NPZ))
    z["w2"] = -4.0 * z["w2"]
    z["router_bias"] = np.asarray(z["router_bias"]) + 30.0
    np.savez(bad_npz, **z)
    bad = build(tmp, "card_testing", "2", bad_npz)
    rare_npz = tmp / "rare.npz"                # chosen by about half the transactions
    z = dict(np.load(EXPERT_NPZ))
    z["router_bias"] = np.asarray(z["router_bias"]) - 20.0
    np.savez(rare_npz, **z)
    rare = build(tmp, "rare", "1", rare_npz)
    folders = {}
    for key, so in (("good", good), ("bad", bad), ("rare", rare)):
        d = folders[key] = tmp / f"ref_{key}"
        d.mkdir(mode=0o700)
        shutil.copyfile(so, d / f"{so.name.split('-')[0]}.so")
    shutil.copyfile(good, folders["rare"] / "card_testing.so")     # v1 live, rare beside
    refs = {"base": Engine.from_config(CONFIG), **{
        k: Engine.from_config(CONFIG, experts_dir=str(d)) for k, d in folders.items()}}
    experts = tmp / "experts"
    experts.mkdir(mode=0o700)
    (experts / "shadow").mkdir(mode=0o700)
    srv = LiveServer("--config", str(CONFIG), experts_dir=experts)
    try:
        yield {"url": srv.url, "experts": experts, "good": good, "bad": bad, "rare": rare,
               "refs": refs, "server": srv}
    finally:
        srv.stop()
        for e in refs.values():
            e.close()


def listing(url: str) -> dict:
    return httpx.get(url + "/v1/experts", timeout=30).json()


def candidate(url: str, name: str = "card_testing") -> dict | None:
    return next((c for c in listing(url)["candidates"] if c["name"] == name
                 and c["state"] in ("shadow", "canary")), None)


def score(url: str, txns, rid: str) -> tuple[np.ndarray, list]:
    items = [{"prompt": tx.token_ids(), "candidates": [[FRAUD]]} for tx in txns]
    r = httpx.post(url + "/v1/score", json={"items": items}, headers={"X-Request-ID": rid},
                   timeout=120)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    return np.array([x["candidates"][0]["logprob"] for x in res]), [x["expert_set"] for x in res]


def ref_logprobs(eng, txns) -> np.ndarray:
    """log P(FRAUD) at LABEL, computed in this process the way the server computes it."""
    got = eng.score([tx.token_ids() + [FRAUD] for tx in txns], all_positions=True)
    return np.array([float(log_softmax(np.asarray(s.logits)[-2:-1])[0, FRAUD]) for s in got])


def post(url: str, path: str, body: dict | None = None, status: int = 202) -> dict:
    r = httpx.post(url + path, json=body or {}, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def events(url: str) -> list[tuple]:
    data = httpx.get(url + "/v1/experts/events", timeout=30).json()["data"]
    return [(e["event"], e["name"], e["reason"]) for e in data]


def test_shadow_scores_are_recorded_never_returned(world):
    url, refs = world["url"], world["refs"]
    drop(world["good"], world["experts"] / "shadow", "card_testing.so")
    c = wait_until(lambda: candidate(url), "the candidate in shadow")
    assert c["state"] == "shadow" and c["fraction"] == 0
    assert c["expert_set"]["id"] == refs["good"].expert_set_id     # live + it, by content
    assert not any(r["name"] == "card_testing" for r in listing(url)["data"])  # not joined
    post(url, "/v1/experts/candidates/card_testing", {"threshold": THRESHOLD}, 200)
    txns = make_stream(300, 11, 0.05, 0.10)
    lp, sets = score(url, txns, "shadow-1")
    base, good = ref_logprobs(refs["base"], txns), ref_logprobs(refs["good"], txns)
    assert all(s == {"generation": 0, "id": refs["base"].expert_set_id} for s in sets)
    assert np.array_equal(lp, base)             # the live set's bits; no shadow output
    assert not np.array_equal(lp, good)
    g = wait_until(lambda: (x := candidate(url)["gate"])["pending"] == 0 and
                   x["items"] == len(txns) and x, "the shadow pass recorded")
    changed = (np.exp(good) >= THRESHOLD) != (np.exp(base) >= THRESHOLD)
    assert changed.sum() > 0 and g["changed"] == int(changed.sum())
    assert (good != base).sum() <= g["routed"] <= len(txns)
    assert g["score_delta_max"] == pytest.approx(np.abs(good - base).max(), abs=1e-12)
    assert g["agreement"] == pytest.approx(1 - changed.mean())
    m = httpx.get(url + "/metrics", timeout=30).text
    assert metric(m, "colibri_candidate_items_total",
                  'candidate="card_testing",kind="changed"') == changed.sum()


def test_canary_fraction_by_request_id_and_attribution(world):
    url, refs = world["url"], world["refs"]
    wait_until(lambda: candidate(url), "the candidate")
    post(url, "/v1/experts/candidates/card_testing", {"fraction": 0.3}, 200)
    txns = make_stream(160, 12, 0.05, 0.10)
    base, good = ref_logprobs(refs["base"], txns), ref_logprobs(refs["good"], txns)
    cand_id = refs["good"].expert_set_id
    picked = 0
    for i in range(32):
        rid = f"canary-{i}"
        part = slice(5 * i, 5 * i + 5)
        lp, sets = score(url, txns[part], rid)
        on = canary(rid, 0.3)
        picked += on
        want = {"generation": 0, "id": cand_id, "candidate": "card_testing"} if on else \
            {"generation": 0, "id": refs["base"].expert_set_id}
        assert all(s == want for s in sets), (rid, sets)
        assert np.array_equal(lp, (good if on else base)[part])      # bit for bit
    assert 0 < picked < 32
    again = score(url, txns[:5], "canary-0")[1]                     # the same id: the same set
    assert again[0].get("candidate") == ("card_testing" if canary("canary-0", 0.3) else None)
    for rid in ("canary-0", "canary-1", "canary-2", "canary-5"):     # completions name it too
        r = httpx.post(url + "/v1/completions", json={"prompt": "ch_online", "max_tokens": 2,
                       "temperature": 0}, headers={"X-Request-ID": rid}, timeout=60).json()
        assert r["choices"][0]["expert_set"]["id"] == \
            (cand_id if canary(rid, 0.3) else refs["base"].expert_set_id)
    assert candidate(url)["gate"]["canary"] == 5 * (picked + canary("canary-0", 0.3))
    assert ("canary", "card_testing", None) in events(url)
    post(url, "/v1/experts/candidates/card_testing", {"fraction": 0}, 200)
    r = httpx.post(url + "/v1/experts/candidates/card_testing", json={"fraction": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "fraction"
    r = httpx.post(url + "/v1/experts/candidates/nope/promote")
    assert r.status_code == 404 and "card_testing" in r.json()["error"]["message"]


def test_promote_then_demote_round_trip(world):
    url, refs = world["url"], world["refs"]
    wait_until(lambda: candidate(url), "the candidate")
    g0 = listing(url)["expert_set_generation"]
    post(url, "/v1/experts/candidates/card_testing/promote")
    live = wait_until(lambda: (x := listing(url))["expert_set_id"] == refs["good"].expert_set_id
                      and x, "promoted live")
    assert live["expert_set_generation"] > g0 and candidate(url) is None
    assert (world["experts"] / "card_testing.so").exists()
    txns = make_stream(40, 13, 0.05, 0.10)
    lp, sets = score(url, txns, "after-promote")
    assert all("candidate" not in s and s["id"] == refs["good"].expert_set_id for s in sets)
    assert np.array_equal(lp, ref_logprobs(refs["good"], txns))
    post(url, "/v1/experts/candidates/card_testing/demote")
    wait_until(lambda: candidate(url) and listing(url)["expert_set_id"] ==
               refs["base"].expert_set_id, "demoted: back in shadow, out of the live set")
    ev = [e[0] for e in events(url) if e[1] == "card_testing"]
    order = [ev.index(k) for k in ("promote", "adopt", "demote", "remove")]
    assert order == sorted(order) and ev[-1] == "candidate"
    r = httpx.post(url + "/v1/experts/candidates/card_testing/demote")
    assert r.status_code == 404                     # nothing promoted any more


def verdict(base, cand, labels) -> str:
    def rp(lp):
        d = np.exp(lp) >= THRESHOLD
        tp = (d & labels).sum()
        return tp / labels.sum(), (tp / d.sum() if d.sum() else 1.0)
    (rb, pb), (rc, pc) = rp(base), rp(cand)
    return "promote" if rc >= rb and pc >= pb else "drop"


def test_gate_promotes_then_drops_on_feedback(world):
    url, refs = world["url"], world["refs"]
    wait_until(lambda: candidate(url), "the candidate")
    post(url, "/v1/experts/candidates/card_testing",
         {"threshold": THRESHOLD, "min_positives": 10, "auto": True}, 200)
    txns = make_stream(300, 14, 0.05, 0.10)
    labels = np.array([tx.pattern != "legit" for tx in txns])
    score(url, txns, "gate-1")
    wait_until(lambda: candidate(url)["gate"]["pending"] == 0, "the shadow pass")
    want = verdict(ref_logprobs(refs["base"], txns), ref_logprobs(refs["good"], txns), labels)
    fb = post(url, "/v1/experts/feedback", {"items": [
        {"request_id": "gate-1", "item": i, "label": bool(y)} for i, y in enumerate(labels)]}, 200)
    assert want == "promote" and fb["decisions"] == {"card_testing": want}
    assert fb["matched"] == len(txns)
    wait_until(lambda: listing(url)["expert_set_id"] == refs["good"].expert_set_id,
               "promoted by the gate")
    assert ("promote", "card_testing", "gate") in events(url)
    # a broken version 2 arrives as a candidate beside the live version 1
    drop(world["bad"], world["experts"] / "shadow", "card_testing.so")
    wait_until(lambda: (c := candidate(url)) and c["version"] == "2", "version 2 in shadow")
    post(url, "/v1/experts/candidates/card_testing",
         {"threshold": THRESHOLD, "min_positives": 10}, 200)
    txns = make_stream(300, 15, 0.05, 0.10)
    labels = np.array([tx.pattern != "legit" for tx in txns])
    score(url, txns, "gate-2")
    wait_until(lambda: candidate(url)["gate"]["pending"] == 0, "the shadow pass")
    want = verdict(ref_logprobs(refs["good"], txns), ref_logprobs(refs["bad"], txns), labels)
    fb = post(url, "/v1/experts/feedback", {"items": [
        {"request_id": "gate-2", "item": i, "label": bool(y)} for i, y in enumerate(labels)]}, 200)
    assert want == "drop" and fb["decisions"] == {"card_testing": "drop"}
    assert (world["experts"] / "shadow" / "dropped" / "card_testing.so").exists()
    assert ("drop", "card_testing", "gate") in events(url)
    assert listing(url)["expert_set_id"] == refs["good"].expert_set_id      # v1 stays live
    r = httpx.post(url + "/v1/experts/feedback", json={"items": [{"request_id": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items[0]"


def test_shadow_recomputes_only_the_items_routed_to_it(world):
    """Which items the shadow pass recomputes: those whose routing at the candidate's
    layer chooses its slot, as the candidate's own set routes them (worked out here from
    an engine where it is live); the others keep the live bits under its set anyway."""
    url, refs = world["url"], world["refs"]
    assert listing(url)["expert_set_id"] == refs["good"].expert_set_id   # v1 live
    drop(world["rare"], world["experts"] / "shadow", "rare.so")
    wait_until(lambda: candidate(url, "rare"), "rare in shadow")
    post(url, "/v1/experts/candidates/rare", {"threshold": THRESHOLD, "auto": False}, 200)
    txns = make_stream(200, 16, 0.05, 0.10)
    lp, _ = score(url, txns, "rare-1")
    live, cand = ref_logprobs(refs["good"], txns), ref_logprobs(refs["rare"], txns)
    assert np.array_equal(lp, live)
    eng = refs["rare"]
    slot = eng.hotplug.active()["rare"].slot
    routed = []
    for tx in txns:
        eng.score([tx.token_ids() + [FRAUD]], all_positions=True)
        trace = next(t for t in eng.model.last_routing if t.layer == NEW_EXPERT_LAYER)
        routed.append(bool((trace.routing.ids == slot).any()))
    routed = np.array(routed)
    g = wait_until(lambda: (x := candidate(url, "rare")["gate"])["pending"] == 0 and
                   x["items"] == len(txns) and x, "the shadow pass recorded")
    assert 0 < routed.sum() < len(txns) and g["routed"] == routed.sum()
    assert np.array_equal(cand[~routed], live[~routed])
    changed = (np.exp(cand) >= THRESHOLD) != (np.exp(live) >= THRESHOLD)
    assert g["changed"] == changed.sum()


def test_cli_canary_promote_demote(world):
    import json
    import subprocess
    url = world["url"]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "colibri_core", "experts", *args,
                               "--url", url], capture_output=True, text=True, timeout=120)
    wait_until(lambda: candidate(url, "rare"), "rare in shadow")
    r = cli("canary", "rare", "0.25")
    assert r.returncode == 0 and json.loads(r.stdout)["fraction"] == 0.25, r.stderr
    r = cli("candidates")
    assert r.returncode == 0 and "rare 1 slot" in r.stdout and "canary fraction 0.25" in r.stdout
    assert cli("promote", "rare").returncode == 0
    active = lambda: any(x["name"] == "rare" and x["status"] == "active"   # noqa: E731
                         for x in listing(url)["data"])
    wait_until(active, "rare promoted by the CLI")
    assert cli("demote", "rare").returncode == 0
    wait_until(lambda: candidate(url, "rare") and not active(), "rare back in shadow")
    r = cli("promote", "nope")
    assert r.returncode == 1 and "no candidate 'nope'" in r.stderr
    assert [e[0] for e in events(url) if e[1] == "rare"][-1] == "candidate"
