"""Where a decode token's time goes: each C call of the pipeline timed from Python.

    python benchmarks/bench_decode_breakdown.py [--model DIR] [--threads 2] [--steps 150]

Decodes one sequence after a 64-token prefill through the engine's own pipeline
(pipeline.py), with its C calls wrapped in a timer, and prints the median per step of the
attention blocks, the routers, the expert blocks, the lm_head and the rest (Python
between the calls), with the bytes of weights each reads and the rate that makes.
Default model: the one bench_vs_llamacpp.py converts.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PARTS = {"ck_step_attention": "attention", "ck_step_route": "router",
         "ck_step_experts": "ffn", "ck_step_head": "lm_head"}


def nbytes(t) -> int:
    return sum(int(getattr(t, f).nbytes) for f in ("data", "scales", "zeros") if getattr(t, f, None) is not None)


class TimedLib:
    """The kernels' `lib` with the pipeline's C calls timed (seconds per part)."""

    def __init__(self, lib):
        self._lib = lib
        self.t: dict = defaultdict(float)

    def __getattr__(self, name):
        f = getattr(self._lib, name)
        part = PARTS.get(name)
        if part is None:
            return f
        pc, t = time.perf_counter, self.t

        def timed(*args):
            t0 = pc()
            rc = f(*args)
            t[part] += pc() - t0
            return rc
        return timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HERE / "out" / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args(argv)
    from colibri_core import pipeline
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine

    eng = Engine(a.model, EngineConfig(threads=a.threads))
    m = eng.model
    k = m.cfg.top_k
    cache = m.new_cache(64 + a.steps + 1)
    m.forward([np.arange(1, 65)], [cache])
    timed = TimedLib(pipeline.lib)
    pipeline.lib = timed
    pc = time.perf_counter
    parts = {p: [] for p in ("attention", "router", "ffn", "lm_head", "python", "step")}
    tok = 5
    try:
        for it in range(a.steps):
            timed.t.clear()
            t0 = pc()
            tok = int(m.decode_step(tok, cache, k).argmax())
            total = pc() - t0
            if it < 10:                               # warm-up steps
                continue
            for p in ("attention", "router", "ffn", "lm_head"):
                parts[p].append(timed.t[p])
            parts["step"].append(total)
            parts["python"].append(total - sum(timed.t.values()))
    finally:
        pipeline.lib = timed._lib
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
