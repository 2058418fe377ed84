"""The fraud example through `colibri serve`: scoring over HTTP (/v1/score) while the new
expert goes live in the server's watched folder.

    python examples/fraud/score_via_server.py              # ~20 s on 2 cores
    python examples/fraud/score_via_server.py --before 4000 --after 4000

What it does:

1. builds the card-testing expert (as run_demo.py does) and starts
   `colibri serve --config fraud --port 0` watching an empty folder;
2. scores a synthetic transaction stream batch after batch: each transaction is one item
   of a /v1/score request, its token ids up to LABEL as the prompt and the FRAUD token as
   the one candidate, so the candidate's log-prob is log P(FRAUD) at the LABEL position;
3. after --before transactions drops the .so into the folder (hidden name, then rename)
   and keeps scoring: every answer names the expert set that computed it
   (`expert_sets`), so the first batch scored by the new set is known exactly;
4. checks the server's P(FRAUD) against the engine called directly on a sample, and
   reports recall on the new pattern (card testing) and the old ones, before and after.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import (BUILD, CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER,  # noqa: E402
                          REPO, expert_q4_clip, fraud_prob, load_scoring)
from fraud_stream import FRAUD  # noqa: E402
from run_demo import make_stream  # noqa: E402


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--config",
                             str(CONFIG), "--port", "0", "--experts-dir", str(folder)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    found = threading.Event()
    url = {}

    def read():
        for line in proc.stdout:
            m = re.search(r"serving (http://\S+)", line)
            if m:
                url["url"] = m.group(1)
                found.set()
        found.set()
    threading.Thread(target=read, daemon=True).start()
    if not found.wait(60) or "url" not in url:
        proc.kill()
        raise SystemExit("colibri serve did not start")
    return proc, url["url"]


def score(client, url: str, ids: np.ndarray) -> tuple[np.ndarray, list]:
    """P(FRAUD) of each transaction (one /v1/score request) and the expert sets used."""
    items = [{"prompt": [int(t) for t in row], "candidates": [[FRAUD]]} for row in ids]
    r = client.post(url + "/v1/score", json={"items": items})
    if r.status_code != 200:
        raise SystemExit(f"/v1/score answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    lp = np.array([res["candidates"][0]["logprob"] for res in body["results"]])
    return np.exp(lp), body["expert_sets"]


def recall(flag: np.ndarray, is_group: np.ndarray) -> str:
    n = int(is_group.sum())
    return f"{int((flag & is_group).sum())}/{n}" + (f" ({100 * (flag & is_group).sum() / n:.0f}%)"
                                                    if n else "")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=int, default=2000, help="transactions before the drop")
    ap.add_argument("--after", type=int, default=2000, help="transactions after the drop")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(BUILD / "serve"))
    ap.add_argument("--live-timeout", type=float, default=60.0,
                    help="give up if the expert is not live this long after the drop")
    a = ap.parse_args(argv)
    import httpx
    from colibri_core.engine import Engine
    from colibri_core.hotplug.builder import build_expert
    say = lambda *s: print(*s, flush=True)  # noqa: E731
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    so = out / "card_testing.so"
    from colibri_core.fingerprint import fingerprint_of_dir
    build_expert(EXPERT_NPZ, so, NEW_EXPERT_LAYER, "card_testing", "1", q4_clip=expert_q4_clip(),
                 base_model=fingerprint_of_dir(MODEL_DIR))       # bound to the fraud model
    folder = out / "experts_so"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700)
    thr = load_scoring()["threshold"]
    txns = make_stream(a.before + a.after, a.seed, 0.008, 0.010)
    ids = np.array([tx.token_ids() for tx in txns], np.int64)
    pattern = np.array([tx.pattern for tx in txns])
    proc, url = start_server(folder)
    say(f"colibri serve --config fraud at {url}, watching {folder}")
    probs = np.zeros(len(ids))
    gen_of = np.zeros(len(ids), int)
    live_at, t_drop = None, None
    try:
        with httpx.Client(timeout=120) as client:
            g0 = client.get(url + "/v1/experts").json()["expert_set_generation"]
            t0 = time.perf_counter()
            for lo in range(0, len(ids), a.batch):
                if lo >= a.before and t_drop is None:
                    tmp = folder / f".{so.name}.part"
                    shutil.copyfile(so, tmp)
                    os.chmod(tmp, 0o644)
                    os.replace(tmp, folder / so.name)
                    t_drop = time.perf_counter()
                    say(f"dropped {so.name} into the watched folder after {lo} transactions")
                hi = min(len(ids), lo + a.batch)
                probs[lo:hi], sets = score(client, url, ids[lo:hi])
                gen_of[lo:hi] = sets[-1]["generation"]
                if live_at is None and sets[0]["generation"] > g0:
                    live_at = lo
                    say(f"transactions {lo}..{hi - 1}: expert set {g0} -> "
                        f"{sets[0]['generation']} ({sets[0]['id'][:12]}): card_testing is live,"
                        f" {time.perf_counter() - t_drop:.2f} s after the drop")
            wall = time.perf_counter() - t0
            if live_at is None and t_drop is not None:
                # the stream ran out first (a slow probe): wait, then score the last batch
                # again with the new set
                deadline = time.monotonic() + a.live_timeout
                while client.get(url + "/v1/experts").json()["expert_set_generation"] == g0:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"card_testing was not live {a.live_timeout:.0f} s "
                                         "after the drop")
                    time.sleep(0.1)
                lo = (len(ids) - 1) // a.batch * a.batch
                probs[lo:], sets = score(client, url, ids[lo:])
                gen_of[lo:] = sets[-1]["generation"]
                live_at = lo
                say(f"card_testing live {time.perf_counter() - t_drop:.2f} s after the drop "
                    f"(after the stream's end): last batch scored again")
    finally:
        proc.terminate()
        proc.wait(30)
    # the same transactions on the engine called directly, with the expert adopted
    eng = Engine.from_config(CONFIG, experts_dir=str(folder))
    try:
        sample = np.arange(max(live_at or len(ids), len(ids) - 256), len(ids))
        direct = fraud_prob(np.stack(eng.score_batch([list(r) for r in ids[sample]])))
    finally:
        eng.close()
    dp = float(np.abs(direct - probs[sample]).max()) if sample.size else float("nan")
    flag = probs >= thr
    new, old = pattern == "card_testing", (pattern != "legit") & (pattern != "card_testing")
    before = np.arange(len(ids)) < (live_at if live_at is not None else len(ids))
    say(f"{len(ids)} transactions in {wall:.1f} s ({len(ids) / wall:.0f} txn/s over HTTP)")
    say(f"card testing recall: before {recall(flag & before, new & before)}, after "
        f"{recall(flag & ~before, new & ~before)}; old patterns: before "
        f"{recall(flag & before, old & before)}, after {recall(flag & ~before, old & ~before)}")
    say(f"P(FRAUD) server vs engine direct on {sample.size} transactions after the switch: "
        f"max |dp| {dp:.2e}")
    return {"live_at": live_at, "generations": sorted(set(gen_of.tolist())),
            "max_abs_prob_diff": dp, "txn_per_s": len(ids) / wall}


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["live_at"] is not None else 1)
