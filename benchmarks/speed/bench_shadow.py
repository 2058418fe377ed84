"""What a candidate in shadow costs the scoring of the fraud example (issue 35): scored
transactions per second without a candidate, and with one in shadow whose routing takes
none (the routing tap's own cost), about 10 %, 30 % or 100 % of the transactions (the
card-testing expert with its router bias lowered by 200, 28, 25 or 0), each shadowed
transaction scored again under the candidate's set (what the server's shadow thread does;
here inline, on the same thread) two ways, alternated: `whole` (both passes in full, as
before) and `layer` (from the candidate's first layer on, from the rows the live pass
kept: server/candidates.py from_layer, what the server does).

    python -m benchmarks.speed.bench_shadow            # ~1 min on 2 busy cores
    python -m benchmarks.speed.bench_shadow --batches 6 --batch 256

Each round scores the same batches once per variant, in rotating order; the figure is the
median over rounds of transactions per second (live pass + shadow pass), and its ratio to
the no-candidate variant measured in the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, git_commit, machine

FRAUD = REPO / "examples" / "fraud"
SHIFTS = {"0%": -200.0, "10%": -28.0, "30%": -25.0, "100%": 0.0}   # 0 %: the tap alone


def engines(tmp: Path):
    sys.path.insert(0, str(FRAUD))
    from fraud_common import CONFIG, EXPERT_NPZ, MODEL_DIR, NEW_EXPERT_LAYER, expert_q4_clip
    from colibri_core.engine import Engine
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.model.fingerprint import fingerprint_of_dir
    out = {"none": Engine.from_config(CONFIG)}
    z = dict(np.load(EXPERT_NPZ))
    for label, shift in SHIFTS.items():
        d = tmp / label.rstrip("%")
        (d / "shadow").mkdir(parents=True, mode=0o700)
        d.chmod(0o700)
        npz = tmp / f"{label.rstrip('%')}.npz"
        np.savez(npz, **{**z, "router_bias": np.asarray(z["router_bias"]) + shift})
        build_expert(npz, d / "shadow" / "cand.so", NEW_EXPERT_LAYER, "cand", "1",
                     q4_clip=expert_q4_clip(), base_model=fingerprint_of_dir(MODEL_DIR))
        out[label] = Engine.from_config(CONFIG, experts_dir=str(d))
        assert out[label].candidates.active(), f"the {label} candidate was not loaded"
    return out


def one_batch(eng, seqs, how: str = "whole") -> tuple[float, int]:
    """Seconds for the live pass and the shadow pass of the routed sequences; how many."""
    t0 = time.perf_counter()
    got = eng.score(seqs, all_positions=True)
    routed = [(i, s, x) for i, (s, x) in enumerate(zip(seqs, got)) if x.shadow]
    if routed:
        cand = eng.candidates.active()[0]
        if how == "layer":
            from colibri_core.server.candidates import runner
            outs = runner(eng).from_layer(cand, cand.es, [((i, 0, s), x) for i, s, x in routed],
                                          "bench#shadow")
            assert outs is not None, "the live pass kept no rows"
        else:
            eng.score([s for _, s, _ in routed], all_positions=True, expert_set=cand.es)
    return time.perf_counter() - t0, len(routed)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=4, help="batches per variant and round")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(FRAUD))
    from fraud_stream import FRAUD as FRAUD_TOKEN
    from run_demo import make_stream
    txns = make_stream(a.batch * a.batches, 21, 0.008, 0.010)
    seqs = [tx.token_ids() + [FRAUD_TOKEN] for tx in txns]
    batches = [seqs[i:i + a.batch] for i in range(0, len(seqs), a.batch)]
    tmp = Path(tempfile.mkdtemp(prefix="bench_shadow_"))
    engs = engines(tmp)
    try:
        names = ["none", "0%"] + [f"{s}:{how}" for s in list(SHIFTS)[1:]
                                  for how in ("whole", "layer")]
        for name in names:                       # warm: the candidates' tables built
            one_batch(engs[name.split(":")[0]], batches[0], name.partition(":")[2])
        rate = {n: [] for n in names}
        share = {n: [] for n in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t, routed = 0.0, 0
                for b in batches:
                    dt, k = one_batch(engs[name.split(":")[0]], b, name.partition(":")[2])
                    t, routed = t + dt, routed + k
                rate[name].append(len(seqs) / t)
                share[name].append(routed / len(seqs))
        base = np.array(rate["none"])
        rows = {n: {"routed_share": float(np.median(share[n])),
                    "txn_per_s": float(np.median(rate[n])),
                    "ratio_to_none": float(np.median(np.array(rate[n]) / base))}
                for n in names}
        for n in names:                          # from the layer vs whole, same rounds
            if n.endswith(":layer"):
                w = np.array(rate[n.replace(":layer", ":whole")])
                rows[n]["ratio_to_whole"] = float(np.median(np.array(rate[n]) / w))
    finally:
        from colibri_core.server.candidates import stop
        for e in engs.values():
            if e.candidates is not None:
                stop(e)                          # the runner's idle thread
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"command": "python -m benchmarks.speed.bench_shadow " + " ".join(argv or sys.argv[1:]),
           "batch": a.batch, "transactions": len(seqs), "rounds": a.rounds,
           "machine": machine(), "commit": git_commit(), "load_avg": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "variants": rows}
    for n, v in rows.items():
        print(f"{n:>10}: routed {100 * v['routed_share']:5.1f} %  {v['txn_per_s']:7.0f} txn/s"
              f"  x{v['ratio_to_none']:.2f} of no candidate" +
              (f", x{v['ratio_to_whole']:.2f} of whole" if "ratio_to_whole" in v else ""))
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_shadow.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
