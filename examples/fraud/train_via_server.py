"""The whole loop through `colibri serve` (issue 35): a new fraud pattern, labelled
examples posted, an expert trained by the server, tried in shadow, promoted by its gate
on labelled feedback, and recall measured per item before and after.

    python examples/fraud/train_via_server.py                   # the example's mix
    python examples/fraud/train_via_server.py --cards 400       # a smaller mix, quicker

1. starts `colibri serve --config fraud --allow-expert-training` (an API key and a hash
   allowlist, as training requires) watching an empty folder with a shadow/ subfolder;
2. "before": scores a stream with card testing (the pattern the model never saw);
3. posts labelled examples (train_new_expert.py's mix: each transaction's token ids, the
   label token as target, `route` true for card testing) to POST /v1/experts/train and
   polls the job until the trained expert is built and in shadow/;
4. scores gate traffic (the candidate's shadow pass records what it would change), then
   posts its labels to /v1/experts/feedback: the gate promotes the candidate if its recall
   on them is at least the live set's and its precision at least the live set's minus
   --precision-margin (0.1);
5. "after": scores a fresh stream; each item names the set that computed it. Every item is
   scored again in this process under the set it names (the base model, or the model
   with the built .so) and must come out bit for bit: no item attributed to the wrong set.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import CONFIG, load_scoring, serve  # noqa: E402
from fraud_stream import FRAUD, OK, OLD_PATTERNS, generate  # noqa: E402
from run_demo import make_stream  # noqa: E402
from train_new_expert import MIX  # noqa: E402

KEY = "fraud-loop-key"
H = {"Authorization": f"Bearer {KEY}"}


def start(folder: Path, allow: Path) -> tuple[subprocess.Popen, str]:
    return serve(["--experts-dir", str(folder), "--allow-expert-training",
                  "--expert-allowlist", str(allow), "--api-key", KEY])


def score(c, url, txns, rid):
    items = [{"prompt": tx.token_ids(), "candidates": [[FRAUD]]} for tx in txns]
    r = c.post(url + "/v1/score", json={"items": items}, headers={**H, "X-Request-ID": rid})
    if r.status_code != 200:
        raise SystemExit(f"/v1/score answered {r.status_code}: {r.text[:300]}")
    res = r.json()["results"]
    return (np.array([x["candidates"][0]["logprob"] for x in res]),
            [x["expert_set"]["id"] for x in res])


def until(pred, what, timeout=1800.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def recall(lp, txns, group, thr):
    flag = np.exp(lp) >= thr
    g = np.array([tx.pattern in group for tx in txns])
    return int((flag & g).sum()), int(g.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cards", type=int, default=MIX.n_cards, help="cards in the training mix")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n", type=int, default=4096, help="transactions before and after")
    ap.add_argument("--precision-margin", type=float, default=0.1, dest="precision_margin",
                    help="the gate's: precision the candidate may lose against the live set")
    a = ap.parse_args()
    import httpx
    from colibri_core.engine import Engine
    from colibri_core.model.ops import log_softmax
    thr = load_scoring()["threshold"]
    work = Path(tempfile.mkdtemp(prefix="fraud-loop-"))
    folder = work / "experts"
    (folder / "shadow").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    allow = work / "allow.txt"
    allow.write_text("0" * 64 + "\n")      # training needs one; the server adds its own builds
    proc, url = start(folder, allow)
    print(f"colibri serve --config fraud --allow-expert-training at {url}")
    try:
        with httpx.Client(timeout=600) as c:
            base_id = c.get(url + "/v1/experts", headers=H).json()["expert_set_id"]
            before = make_stream(a.n, 21, 0.01, 0.05)
            lp0, sets0 = score(c, url, before, "loop-before")
            mix = generate(MIX.__class__(**{**MIX.__dict__, "n_cards": a.cards}))
            examples = [{"prompt": tx.token_ids(), "target": FRAUD if tx.is_fraud else OK,
                         "route": tx.pattern == "card_testing"} for tx in mix]
            t0 = time.perf_counter()
            r = c.post(url + "/v1/experts/train", headers=H, json={
                "name": "card_testing", "version": "1", "examples": examples,
                "steps": a.steps})
            if r.status_code != 202:
                raise SystemExit(f"/v1/experts/train answered {r.status_code}: {r.text[:300]}")
            job = r.json()
            print(f"posted {len(examples)} labelled examples "
                  f"({sum(e['route'] for e in examples)} card testing): job {job['id']}")
            done = until(lambda: (j := c.get(f"{url}/v1/experts/train/{job['id']}",
                                             headers=H).json())["status"] in ("built", "failed")
                         and j, "the training job")
            t_train = time.perf_counter() - t0
            if done["status"] != "built":
                raise SystemExit(f"training failed: {done['reason']}")
            res = done["result"]
            print(f"built in {t_train:.0f} s (features {res['features_s']:.0f} s, training "
                  f"{res['train_s']:.0f} s; label accuracy on the examples "
                  f"{res['accuracy_before']:.4f} -> {res['accuracy_after']:.4f})")
            ref = work / "ref"
            ref.mkdir(mode=0o700)
            shutil.copyfile(done["candidate"], ref / "card_testing.so")
            until(lambda: any(x["name"] == "card_testing" and x["state"] == "shadow" for x in
                              c.get(url + "/v1/experts", headers=H).json()["candidates"]),
                  "the candidate in shadow", 120)
            c.post(url + "/v1/experts/candidates/card_testing", headers=H,
                   json={"threshold": thr, "min_positives": 20, "auto": True,
                         "precision_margin": a.precision_margin})
            gate = make_stream(2048, 22, 0.01, 0.05)
            score(c, url, gate, "loop-gate")
            until(lambda: c.get(url + "/v1/experts", headers=H).json()["candidates"][0]
                  ["gate"]["pending"] == 0, "the shadow pass", 300)
            fb = c.post(url + "/v1/experts/feedback", headers=H, json={"items": [
                {"request_id": "loop-gate", "item": i, "label": tx.is_fraud}
                for i, tx in enumerate(gate)]}).json()
            print(f"feedback on {fb['matched']} items: gate decisions {fb['decisions']}")
            why = [e["message"] for e in c.get(url + "/v1/experts/events", headers=H)
                   .json()["data"] if e["reason"] == "gate"]
            print(f"gate: {why[-1] if why else 'no decision'}")
            if fb["decisions"].get("card_testing") != "promote":
                raise SystemExit("the gate did not promote the trained expert")
            live = until(lambda: (x := c.get(url + "/v1/experts", headers=H).json())
                         ["expert_set_id"] != base_id and x, "the promotion", 120)
            after = make_stream(a.n, 23, 0.01, 0.05)
            lp1, sets1 = score(c, url, after, "loop-after")
            ev = [e["event"] for e in c.get(url + "/v1/experts/events", headers=H).json()["data"]
                  if e["name"] == "card_testing"]
            print("events: " + " ".join(ev))
    finally:
        proc.terminate()
        proc.wait(30)
    # each item again in this process under the set it names, bit for bit
    engines = {base_id: Engine.from_config(CONFIG),
               live["expert_set_id"]: Engine.from_config(CONFIG, experts_dir=str(ref))}
    # the "after" transactions under the base set too: a paired comparison, same items
    got = engines[base_id].score([tx.token_ids() + [FRAUD] for tx in after], all_positions=True)
    lp1_base = np.array([float(log_softmax(np.asarray(s.logits)[-2:-1])[0, FRAUD]) for s in got])
    wrong = 0
    for txns, lp, sets in ((before, lp0, sets0), (after, lp1, sets1)):
        for sid in set(sets):
            idx = [i for i, s in enumerate(sets) if s == sid]
            if sid not in engines:
                wrong += len(idx)
                continue
            got = engines[sid].score([txns[i].token_ids() + [FRAUD] for i in idx],
                                     all_positions=True)
            mine = np.array([float(log_softmax(np.asarray(s.logits)[-2:-1])[0, FRAUD])
                             for s in got])
            wrong += int((mine != lp[idx]).sum())
    for e in engines.values():
        e.close()
    for label, txns, lp, sets, sid in (("before", before, lp0, sets0, base_id),
                                       ("after", after, lp1, sets1, live["expert_set_id"])):
        assert all(s == sid for s in sets), f"{label}: items scored by another set"
        k, n = recall(lp, txns, ["card_testing"], thr)
        ko, no = recall(lp, txns, OLD_PATTERNS, thr)
        print(f"{label:>6}: card testing recall {k}/{n} ({100 * k / n:.1f}%), old patterns "
              f"{ko}/{no} ({100 * ko / max(no, 1):.1f}%)")
    for name, group in (("card testing", ["card_testing"]), ("old patterns", OLD_PATTERNS)):
        (k0, n), (k1, _) = recall(lp1_base, after, group, thr), recall(lp1, after, group, thr)
        print(f"the after stream's {name}: {k0}/{n} without the expert, {k1}/{n} with it")
    legit = np.array([tx.pattern == "legit" for tx in after])
    print(f"its legit transactions flagged: {int((np.exp(lp1_base) >= thr)[legit].sum())} "
          f"without, {int((np.exp(lp1) >= thr)[legit].sum())} with (of {int(legit.sum())})")
    print(f"items whose output differs from their named set's: {wrong} of "
          f"{len(before) + len(after)}")
    print(json.dumps({"train_s": round(t_train, 1), "examples": len(examples)}))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
