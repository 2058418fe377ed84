"""Where a decode token's time goes: each C call of the pipeline timed from Python.

    python -m benchmarks.speed.bench_decode_breakdown [--model DIR] [--threads 2] [--steps 150]

Decodes one sequence after a 64-token prefill through the engine's own pipeline
(pipeline.py), with its C calls wrapped in a timer, and prints the median per step of the
attention blocks, the routers, the expert blocks, the lm_head and the rest (Python
between the calls), with the bytes of weights each reads and the rate that makes; and
the synchronization inside those calls: the time the calling thread waited at the end of
the thread pool's loops for chunks other threads still ran (ck_pool.c's statistics, read
where the pipeline's thread control reads them), with the share of chunks the other
threads ran.
Default model: the one bench_vs_llamacpp.py converts.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from benchmarks.common import OUT
PARTS = {"ck_step_attention": "attention", "ck_step_mla_attention": "attention", "ck_step_route": "router",
         "ck_step_experts": "ffn", "ck_step_head": "lm_head"}


def nbytes(t) -> int:
    return sum(int(getattr(t, f).nbytes) for f in ("data", "scales", "zeros") if getattr(t, f, None) is not None)


class TimedLib:
    """The kernels' `lib` with the pipeline's C calls timed (seconds per part)."""

    def __init__(self, lib):
        self._lib = lib
        self.t: dict = defaultdict(float)
        self.pool: dict = defaultdict(int)

    def __getattr__(self, name):
        f = getattr(self._lib, name)
        if name == "ck_pool_stats":               # the thread control's read, every step
            return self._pool_stats
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

    def _pool_stats(self, out):
        self._lib.ck_pool_stats(out)              # mine, others' chunks, loop, wait cycles
        for i, key in enumerate(("mine", "others", "loop_cycles", "wait_cycles")):
            self.pool[key] += int(out[i])


def cycles_per_second(lib) -> float:
    """The rate of ck_rdtsc's counter (the pool's statistics count in it)."""
    t0, c0 = time.perf_counter(), int(lib.ck_rdtsc())
    time.sleep(0.2)
    return (int(lib.ck_rdtsc()) - c0) / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(OUT / "vs_llamacpp" / "colibri_q4"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    a = ap.parse_args(argv)
    from colibri_core.forward import pipeline, steptables
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine

    eng = Engine(a.model, EngineConfig(threads=a.threads))
    m = eng.model
    k = m.cfg.top_k
    cache = m.new_cache(64 + a.steps + 1)
    m.forward([np.arange(1, 65)], [cache])
    timed = TimedLib(pipeline.lib)
    pipeline.lib = steptables.lib = timed
    hz = cycles_per_second(timed._lib)
    pc = time.perf_counter
    parts = {p: [] for p in ("attention", "router", "ffn", "lm_head", "python", "step")}
    sync, shares = [], []
    tok = 5
    try:
        for it in range(a.steps):
            timed.t.clear()
            timed.pool.clear()
            t0 = pc()
            tok = int(m.decode_step(tok, cache, k).argmax())
            total = pc() - t0
            if it < 10:                               # warm-up steps
                continue
            for p in ("attention", "router", "ffn", "lm_head"):
                parts[p].append(timed.t[p])
            parts["step"].append(total)
            parts["python"].append(total - sum(timed.t.values()))
            sync.append(timed.pool["wait_cycles"] / hz)
            ran = timed.pool["mine"] + timed.pool["others"]
            if ran:
                shares.append(timed.pool["others"] / ran)
    finally:
        pipeline.lib = steptables.lib = timed._lib
    w = m.w
    att_bytes = sum(nbytes(getattr(lw.attn, n)) for lw in w.layers   # GQA's or MLA's matrices
                    for n in ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b")
                    if getattr(lw.attn, n, None) is not None)
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
    other = f"{statistics.median(shares):.2f}" if shares else "no parallel loops"
    print(f"| synchronization (inside the parts above) | {statistics.median(sync) * 1e3:.3f} |"
          f" | chunks run by the other threads: {other} |")
    eng.close()


if __name__ == "__main__":
    main()
