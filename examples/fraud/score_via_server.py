"""The fraud example through `colibri serve`: scoring over HTTP (/v1/score) while the new
expert goes live in the server's watched folder, every transaction attributed to the
expert set the engine names for it.

    python examples/fraud/score_via_server.py              # ~25 s on 2 cores
    python examples/fraud/score_via_server.py --runs 20    # the drop at random moments

What it does:

1. builds the card-testing expert (as run_demo.py does) and starts
   `colibri serve --config fraud --port 0 --audit-log ...` watching an empty folder;
2. scores a synthetic transaction stream batch after batch: each transaction is one item
   of a /v1/score request, its token ids up to LABEL as the prompt and the FRAUD token as
   the one candidate, so the candidate's log-prob is log P(FRAUD) at the LABEL position;
3. drops the .so into the folder (hidden name, then rename) at a random moment while a
   request is in flight (--drop-at: after that many transactions' requests instead) and
   keeps scoring. Each result names the one expert set that computed it
   (`results[i].expert_set`), so a batch that straddles the change is split item by item:
   "before" is every item the base set scored, "after" every item the new set scored;
4. scores the same transactions in this process, each with the set the server named for
   it (the engine without the expert, or with it), and checks the decisions and the
   recall are the same; and replays the server's audit log (`colibri replay`): every
   item's output bits must come out again under the set it names.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import (BUILD, CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER,  # noqa: E402
                          expert_q4_clip, fraud_prob, load_scoring, serve)
from fraud_stream import FRAUD  # noqa: E402
from run_demo import make_stream  # noqa: E402


def start_server(folder: Path, audit: Path) -> tuple[subprocess.Popen, str]:
    return serve(["--experts-dir", str(folder), "--audit-log", str(audit)], timeout=60)


def score(client, url: str, ids: np.ndarray) -> tuple[np.ndarray, list]:
    """P(FRAUD) of each transaction (one /v1/score request) and, per transaction, the
    (generation, id) of the expert set that computed it."""
    items = [{"prompt": [int(t) for t in row], "candidates": [[FRAUD]]} for row in ids]
    r = client.post(url + "/v1/score", json={"items": items})
    if r.status_code != 200:
        raise SystemExit(f"/v1/score answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    lp = np.array([res["candidates"][0]["logprob"] for res in body["results"]])
    return np.exp(lp), [(res["expert_set"]["generation"], res["expert_set"]["id"])
                        for res in body["results"]]


def recall(flag: np.ndarray, is_group: np.ndarray) -> str:
    n = int(is_group.sum())
    return f"{int((flag & is_group).sum())}/{n}" + (f" ({100 * (flag & is_group).sum() / n:.0f}%)"
                                                    if n else "")


def recall_line(flag, new, old, before) -> str:
    return (f"card testing recall: before {recall(flag & before, new & before)}, after "
            f"{recall(flag & ~before, new & ~before)}; old patterns: before "
            f"{recall(flag & before, old & before)}, after {recall(flag & ~before, old & ~before)}")


def run_once(a, so: Path, out: Path, ids: np.ndarray, say, drop_s: float | None) -> dict:
    """One server run: score the stream, drop the expert (after drop_s seconds of
    scoring, or after --drop-at transactions), stop. -> per-item probabilities and sets."""
    import httpx
    folder = out / "experts_so"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700)
    audit = out / "audit.jsonl"
    for old in out.glob("audit.jsonl*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    proc, url = start_server(folder, audit)
    say(f"colibri serve --config fraud at {url}, watching {folder}")
    probs = np.zeros(len(ids))
    sets: list = [None] * len(ids)
    dropped = {}
    scored = len(ids)            # items the server scored (and audited)

    def drop(lo=None):
        tmp = folder / f".{so.name}.part"
        shutil.copyfile(so, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / so.name)
        dropped["t"] = time.perf_counter()
        say(f"dropped {so.name} into the watched folder "
            + (f"after {lo} transactions" if lo is not None else f"{drop_s:.2f} s into the stream"))
    try:
        with httpx.Client(timeout=120) as client:
            base = client.get(url + "/v1/experts").json()
            g0, id0 = base["expert_set_generation"], base["expert_set_id"]
            t0 = time.perf_counter()
            timer = None
            if drop_s is not None:       # at a random moment: mostly while a request runs
                timer = threading.Timer(drop_s, drop)
                timer.start()
            for lo in range(0, len(ids), a.batch):
                if drop_s is None and lo >= a.drop_at and not dropped:
                    drop(lo)
                hi = min(len(ids), lo + a.batch)
                probs[lo:hi], sets[lo:hi] = score(client, url, ids[lo:hi])
            wall = time.perf_counter() - t0
            if timer is not None:
                timer.join()
            # the expert must have gone live; a stream that ran out first scores its last
            # batch again with the new set
            deadline = time.monotonic() + a.live_timeout
            while client.get(url + "/v1/experts").json()["expert_set_generation"] == g0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"card_testing was not live {a.live_timeout:.0f} s "
                                     "after the drop")
                time.sleep(0.1)
            if all(s[1] == id0 for s in sets):
                lo = (len(ids) - 1) // a.batch * a.batch
                probs[lo:], sets[lo:] = score(client, url, ids[lo:])
                scored += len(ids) - lo
                say("card_testing went live after the stream's end: last batch scored again")
    finally:
        proc.terminate()
        proc.wait(30)
    new_set = np.array([s[1] != id0 for s in sets])
    first = int(np.argmax(new_set))
    say(f"transaction {first}: the first the new expert set scored "
        f"(generation {sets[first][0]}, {sets[first][1][:12]}), "
        f"{int(new_set.sum())} of {len(ids)} in all")
    return {"probs": probs, "sets": sets, "new_set": new_set, "base_id": id0, "wall": wall,
            "audit": audit, "folder": folder, "scored": scored}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=int, default=2000,
                    help="transactions before the drop's earliest moment")
    ap.add_argument("--after", type=int, default=2000, help="transactions after it")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--runs", type=int, default=1, help="server runs (a new drop moment each)")
    ap.add_argument("--drop-at", type=int, default=None,
                    help="drop between two requests, after this many transactions (default: "
                         "at a random moment in the middle half of the stream's time)")
    ap.add_argument("--out", default=str(BUILD / "serve"))
    ap.add_argument("--live-timeout", type=float, default=60.0,
                    help="give up if the expert is not live this long after the drop")
    a = ap.parse_args(argv)
    from colibri_core.engine import Engine
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.replay import replay
    say = lambda *s: print(*s, flush=True)  # noqa: E731
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    so = out / "card_testing.so"
    from colibri_core.model.fingerprint import fingerprint_of_dir
    build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "card_testing", "1", q4_clip=expert_q4_clip(),
                 base_model=fingerprint_of_dir(MODEL_DIR))       # bound to the fraud model
    live_dir = out / "engine_experts"              # the in-process engine's, with the expert
    shutil.rmtree(live_dir, ignore_errors=True)
    live_dir.mkdir(mode=0o700)
    shutil.copyfile(so, live_dir / so.name)
    thr = load_scoring()["threshold"]
    txns = make_stream(a.before + a.after, a.seed, 0.008, 0.010)
    ids = np.array([tx.token_ids() for tx in txns], np.int64)
    pattern = np.array([tx.pattern for tx in txns])
    new, old = pattern == "card_testing", (pattern != "legit") & (pattern != "card_testing")
    rng = np.random.default_rng(a.seed)
    eng0 = Engine.from_config(CONFIG)                                   # the base set
    eng1 = Engine.from_config(CONFIG, experts_dir=str(live_dir))       # with card_testing
    est = len(ids) / 1000.0                       # the stream's duration, refined per run
    runs = []
    try:
        # the in-process demo's scores of every transaction under either set
        direct0 = fraud_prob(np.stack(eng0.score_batch([list(r) for r in ids])))
        direct1 = fraud_prob(np.stack(eng1.score_batch([list(r) for r in ids])))
        for r in range(a.runs):
            drop_s = None if a.drop_at is not None else \
                float(rng.uniform(0.25, 0.75)) * est * (1 if a.before == a.after else
                                                        2 * a.before / len(ids))
            got = run_once(a, so, out, ids, say, drop_s)
            est = got["wall"]
            probs, before = got["probs"], ~got["new_set"]
            if {s[1] for s in got["sets"]} - {got["base_id"], eng1.expert_set_id}:
                raise SystemExit("an item names an expert set that is neither the base set "
                                 "nor the one with card_testing")
            direct = np.where(before, direct0, direct1)     # each item under its named set
            dp = float(np.abs(direct - probs).max())
            flag, flag_direct = probs >= thr, direct >= thr
            line = recall_line(flag, new, old, before)
            same = bool((flag == flag_direct).all()) and line == recall_line(flag_direct, new,
                                                                                old, before)
            rep = replay(eng0, [got["audit"]])
            say(f"{len(ids)} transactions in {got['wall']:.1f} s "
                f"({len(ids) / got['wall']:.0f} txn/s over HTTP)")
            say(line)
            say(f"in-process, each transaction under the set the server named: "
                f"{'the same decisions and recall' if same else 'DIFFERENT decisions'}; "
                f"P(FRAUD) max |dp| {dp:.2e}")
            say(f"replay of the server's audit log: {rep.items} items, "
                f"{len(rep.differ)} differ in any bit")
            runs.append({"first_new": int(np.argmax(got["new_set"])) if got["new_set"].any()
                         else None, "new_items": int(got["new_set"].sum()),
                         "recall": line, "same_as_in_process": same, "max_abs_prob_diff": dp,
                         "replayed": rep.items, "replay_differ": len(rep.differ),
                         "scored": got["scored"],
                         "txn_per_s": len(ids) / got["wall"],
                         "generations": sorted({s[0] for s in got["sets"]})})
    finally:
        eng0.close()
        eng1.close()
    if a.runs > 1:
        ok = sum(x["same_as_in_process"] and x["replay_differ"] == 0 for x in runs)
        say(f"{a.runs} runs: {ok} with the in-process recall and a bit-exact replay; the first "
            f"transaction of the new set: {sorted(x['first_new'] for x in runs)}")
    last = runs[-1]
    return {"live_at": last["first_new"], "generations": last["generations"],
            "max_abs_prob_diff": max(x["max_abs_prob_diff"] for x in runs),
            "same_as_in_process": all(x["same_as_in_process"] for x in runs),
            "replay_differ": sum(x["replay_differ"] for x in runs),
            "replayed": sum(x["replayed"] for x in runs),
            "scored": sum(x["scored"] for x in runs), "runs": runs,
            "txn_per_s": last["txn_per_s"]}


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["live_at"] is not None and res["same_as_in_process"]
             and res["replay_differ"] == 0 else 1)
