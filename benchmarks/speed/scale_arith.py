"""The arithmetic of expert parallelism (issue 40; docs/SCALE.md "A model larger than one
machine"): single-stream decode of DeepSeek-V3 and Kimi K2 with their routed experts on
N machines, against one machine with enough memory.

    python -m benchmarks.speed.scale_arith [--hop-ms 0.5] [--mem-gbs 150]

Per MoE layer and token the driver (attention, router, shared expert, dense layers; on
machine 0) sends the token's normed hidden row (H float32) to every shard holding one of
its k experts and gets back k weighted expert outputs, unsummed (H float32 each: the
bit-exact sum is the driver's, in ascending expert id). The layer waits for the slowest
shard: hop + the wire (sends and receipts serialized on the driver's link, full duplex)
+ its experts' reads (its most loaded share of the k experts, uniform routing, Monte
Carlo) at the machine's memory bandwidth. Decode is memory-bound: time = bytes read /
bandwidth on the driver and the shards alike. Inputs not measured here are stated
(bytes per weight, memory bandwidth, link efficiency); --hop-ms defaults to
benchmarks/out/shard_hop.json's Compiled Graph per-hop cost when that file exists.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from benchmarks.common import OUT

# (hidden, MoE layers, routed experts, k, expert intermediate, active params, embedding params)
MODELS = {"DeepSeek-V3": (7168, 58, 256, 8, 2048, 37.0e9, 0.93e9),
          "Kimi K2": (7168, 60, 384, 8, 2048, 32.6e9, 1.17e9)}
BYTES_PER_WEIGHT = 0.5625        # q4 with a float scale per group of 64 (4.5 bits)
NON_EXPERT_RESIDENT_GB = {"DeepSeek-V3": 10.0, "Kimi K2": 15.0}   # driver's weights
USABLE = 0.85                    # of a machine's memory for weights (OS, KV cache, scratch)
LINK_EFF = 0.9                   # of the line rate TCP delivers
WIRE_RTT_MS = 0.02               # switch + NIC per hop, beyond the measured software hop


def max_share(n: int, k: int, trials: int = 20000) -> tuple[float, float]:
    """(E[most of a token's k experts on one shard], E[distinct shards hit]), uniform."""
    rng = np.random.default_rng(0)
    picks = rng.integers(0, n, size=(trials, k))
    counts = np.stack([(picks == s).sum(1) for s in range(n)], 1)
    return float(counts.max(1).mean()), float((counts > 0).sum(1).mean())


def predict(name: str, n: int, mem_gb: int, gbe: int, hop_ms: float, mem_gbs: float) -> dict:
    H, L, E, k, inter, active, embed = MODELS[name]
    expert_b = 3 * H * inter * BYTES_PER_WEIGHT
    routed_gb = L * E * expert_b / 1e9
    driver_b = (active - k * L * 3 * H * inter - embed) * BYTES_PER_WEIGHT
    fits = (routed_gb / n + NON_EXPERT_RESIDENT_GB[name]) <= USABLE * mem_gb
    most, hit = max_share(n, k)
    send, recv = hit * H * 4, k * H * 4
    link = gbe * 1e9 / 8 * LINK_EFF
    wire_ms = max(send, recv) / link * 1e3 + WIRE_RTT_MS
    shard_ms = most * expert_b / (mem_gbs * 1e9) * 1e3
    layer_ms = hop_ms + wire_ms + shard_ms
    token_ms = driver_b / (mem_gbs * 1e9) * 1e3 + L * layer_ms
    one_ms = (driver_b + k * L * expert_b) / (mem_gbs * 1e9) * 1e3
    return {"model": name, "machines": n, "mem_GB": mem_gb, "GbE": gbe, "fits": fits,
            "routed_GB_per_shard": round(routed_gb / n, 1),
            "wire_KB_per_token_layer": round((send + recv) / 1e3, 1),
            "added_ms_per_layer": round(hop_ms + wire_ms, 3), "tok_s": round(1e3 / token_ms, 2),
            "one_machine_tok_s": round(1e3 / one_ms, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scale_arith")
    ap.add_argument("--hop-ms", type=float, default=None,
                    help="per-hop software cost (default: shard_hop.json's compiled_2)")
    ap.add_argument("--mem-gbs", type=float, default=150.0,
                    help="one machine's memory bandwidth a decode reaches, GB/s")
    a = ap.parse_args(argv)
    hop = a.hop_ms
    if hop is None:
        f = OUT / "shard_hop.json"
        hop = json.loads(f.read_text())["fit_compiled_2"]["per_hop_ms"] if f.exists() else 0.5
    print(f"hop {hop:.3f} ms, memory {a.mem_gbs:.0f} GB/s, {BYTES_PER_WEIGHT * 8:.1f} bits "
          f"per weight", file=sys.stderr)
    print("| model | machines | fits machines of | routed GB / shard | GbE | wire KB / token "
          "/ layer | added ms / layer | tokens/s | one machine, tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        for n in (2, 4, 8):
            for gbe in (10, 25, 100):
                rs = [predict(name, n, mem, gbe, hop, a.mem_gbs) for mem in (256, 512)]
                fit = [f"{r['mem_GB']} GB" for r in rs if r["fits"]]
                if not fit:
                    continue
                r = rs[0]
                print(f"| {name} | {n} | {', '.join(fit)} | {r['routed_GB_per_shard']} | {gbe} "
                      f"| {r['wire_KB_per_token_layer']} | {r['added_ms_per_layer']} "
                      f"| {r['tok_s']} | {r['one_machine_tok_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
