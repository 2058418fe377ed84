"""Where a decode token's time goes: each C call of the decode fast path timed from Python.

    python benchmarks/bench_decode_breakdown.py [--model DIR] [--threads 2] [--steps 150]

Runs the steps of decode.DecodePlan.step by hand (same calls, same order) after a 64-token
prefill, timing the attention blocks, the routers, the FFN blocks and the lm_head of each
step, and prints the median per step of each part together with the bytes of weights it
reads and the rate that makes. Default model: the one bench_vs_llamacpp.py converts.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def nbytes(t) -> int:
    return sum(int(getattr(t, f).nbytes) for f in ("data", "scales", "zeros") if getattr(t, f, None) is not None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HERE / "out" / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args(argv)
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.kernels import lib

    eng = Engine(a.model, EngineConfig(threads=a.threads))
    m = eng.model
    plan = m.decode_plan()
    if isinstance(plan, str):
        raise SystemExit(f"the decode fast path does not apply: {plan}")
    k = m.cfg.top_k
    cache = m.new_cache(64 + a.steps + 1)
    m.forward([np.arange(1, 65)], [cache])
    pc = time.perf_counter
    parts = {p: [] for p in ("attention", "router", "ffn", "lm_head", "python", "step")}
    tok = 5
    for it in range(a.steps):
        t_step = pc()
        att = rou = ffn = 0.0
        s, pos = plan.s, cache.length
        lib.ck_mat_row(plan._embed_mat, tok, plan.p_x)
        plan._scores(pos + 1)
        caches = plan._layer_caches(cache)
        for L in plan.layers:
            kc, vc = caches[L["index"]]
            t0 = pc()
            lib.ck_decode_attention(L["attn"], plan.p_x, kc, vc, pos, plan.p_xn, s)
            t1 = pc()
            if L["moe"]:
                lib.ck_decode_route(L["router"], plan.p_xn, k, L["p_rl"], L["p_ids"], L["p_w"])
                t2 = pc()
                lib.ck_decode_ffn(L["block"], L["p_ids"], L["p_w"], k, plan.p_xn, plan.p_x, s)
            else:
                t2 = pc()
                lib.ck_decode_ffn(L["block"], plan.p_dense_ids, plan.p_dense_w, 1, plan.p_xn,
                                  plan.p_x, s)
            t3 = pc()
            att, rou, ffn = att + t1 - t0, rou + t2 - t1, ffn + t3 - t2
        cache.length = pos + 1
        t0 = pc()
        lib.ck_decode_head(plan.head, plan.final_norm, plan.eps, plan.p_x, plan.p_logits, s)
        t1 = pc()
        tok = int(plan.logits.argmax())
        total = pc() - t_step
        if it < 10:                                   # warm-up steps
            continue
        for p, v in (("attention", att), ("router", rou), ("ffn", ffn), ("lm_head", t1 - t0),
                     ("step", total)):
            parts[p].append(v)
        parts["python"].append(total - (att + rou + ffn + t1 - t0))
    w = m.w
    att_bytes = sum(nbytes(getattr(lw.attn, n)) for lw in w.layers for n in ("wq", "wk", "wv", "wo"))
    ffn_bytes = 0
    for lw in w.layers:
        if lw.kind == "dense":
            ffn_bytes += sum(nbytes(getattr(lw.dense, n)) for n in ("w1", "w3", "w2"))
        else:
            e = lw.experts[0].ffn
            ffn_bytes += k * sum(nbytes(getattr(e, n)) for n in ("w1", "w3", "w2"))
            if lw.shared is not None:
                ffn_bytes += sum(nbytes(getattr(lw.shared, n)) for n in ("w1", "w3", "w2"))
    reads = {"attention": att_bytes, "ffn": ffn_bytes, "lm_head": nbytes(w.lm_head)}
    print(f"{a.model}: {a.threads} threads, median of {a.steps - 10} steps at positions "
          f"{64 + 10}..{64 + a.steps}")
    print("| part | ms per token | weights read (MB) | GB/s |")
    print("|---|---|---|---|")
    for p, v in parts.items():
        ms = statistics.median(v) * 1e3
        b = reads.get(p)
        mb = f"{b / 1e6:.1f}" if b else ""
        rate = f"{b / (ms * 1e-3) / 1e9:.1f}" if b else ""
        print(f"| {p} | {ms:.3f} | {mb} | {rate} |")
    eng.close()


if __name__ == "__main__":
    main()
