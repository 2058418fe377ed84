"""At real size: random-weight models of published MoE shapes (_realscale_models.py),
Colibri beside llama.cpp's own tools on the same shape, same threads.

    python -m benchmarks.speed.bench_realscale --shape olmoe-1b-7b [--tokens 64] [--threads 2]
    python -m benchmarks.speed.bench_realscale --quick        # OLMoE-1B-7B, in-memory targets, 32 tokens
    python -m benchmarks.speed.bench_realscale --shape qwen3-30b-a3b --delete   # then delete it

Per shape (prefill and decode: `--rounds` alternating runs of each engine, Colibri
first then llama.cpp first, medians; load: one run each; the machine may be shared:
compare ratios within a run):

- load to first token, cold (posix_fadvise DONTNEED on each engine's own model files,
  never drop_caches) and warm (files read once before): process start to the first
  generated token of an 8-token prompt. Colibri: a fresh Python process (imports
  included) with the engine's defaults (background preload); llama.cpp:
  `llama-batched-bench -npp 8 -ntg 1 -npl 1` (load, 8-token prefill, one token), its
  process wall time. Not in --quick.
- prefill tok/s of 512- and 2,048-token prompts (random ids): Colibri one
  `Model.forward` of the whole prompt on a fresh cache; llama.cpp `llama-bench -p
  512,2048 -n 0` (its default batch 2,048 / ubatch 512).
- decode tok/s at 1, 4 and 16 sequences, 64-token prompts, `--tokens` steps, EOS ignored
  (argmax fed back, no stop): Colibri `Model.forward` of one token per sequence per step
  (bench_pipeline.batch_step), tok/s = sequences / median step; llama.cpp
  `llama-batched-bench -npp 64 -ntg N -npl 1,4,16` (S_TG). Every step's logits are
  asserted finite.
- per-token p50 (1 sequence) / the bandwidth floor: bytes of weights one token reads
  (_pipeline_inputs.weights_per_token: routed experts at top-k of E) / the read bandwidth
  measured in the same run (common.best_read_bandwidth). llama.cpp's floor from its
  GGUF's tensor sizes the same way.
- peak RSS of the decode process of each engine (wait4's ru_maxrss; both map their
  model, so mapped weights count in both).

Random routers route near-uniformly: every figure is for near-uniform routing.

Targets (issue 30): decode at 1 sequence >= 1.3x llama.cpp where llama.cpp's p1 is more
than 1.5x its own floor, else >= 1.1x; at 16 sequences >= 1.5x; per-token p50 <= 1.5x
the floor; prefill >= 1.0x at 512 and 2,048 tokens; warm load to first token <= 2 s for
Qwen3-30B-A3B; peak RSS <= llama.cpp's. Writes benchmarks/out/realscale.json (one entry
per target and shape: name, shape, ratio, target, met; entries of other shapes kept) and
benchmarks/out/realscale_runs.json (every figure, per shape).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, best_read_bandwidth, git_commit, machine
from benchmarks.speed import _realscale_models as RM

PROMPT = 64
BATCHES = (1, 4, 16)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- child

def child(job: dict) -> None:
    t_start = job["t_start"]
    from colibri_core.engine import Engine
    t_import = time.time()
    eng = Engine.from_model_dir(job["model"], threads=job["threads"])
    t_engine = time.time()
    V = eng.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    out = {"import_s": t_import - t_start, "engine_s": t_engine - t_import}
    if job["what"] == "ttft":
        g = eng.generate(rng.integers(1, V - 1, 8).tolist(), max_new_tokens=1, temperature=0)
        g.run()
        out["first_token_s"] = time.time() - t_start
        out["engine_to_first_token_s"] = time.time() - t_import
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)                     # as llama.cpp's tool: the process ends there
    eng.model.residency.wait_preload()
    from benchmarks.speed.bench_pipeline import batch_step
    if job["what"] == "prefill":
        for n in job["prefill"]:
            cache = eng.model.new_cache(n + 1)
            ids = rng.integers(1, V - 1, n)
            t = time.perf_counter()
            lg = batch_step(eng, [ids], [cache])
            dt = time.perf_counter() - t
            assert np.isfinite(lg[0]).all(), f"prefill {n}: non-finite logits"
            out[f"prefill_{n}_tps"] = n / dt
            del cache
    else:
        for m in job["batches"]:
            caches = [eng.model.new_cache(PROMPT + job["tokens"] + 2) for _ in range(m)]
            prompts = [rng.integers(1, V - 1, PROMPT) for _ in range(m)]
            lg = batch_step(eng, prompts, caches)
            times = []
            for s in range(job["tokens"] + 1):
                assert all(np.isfinite(x).all() for x in lg), f"{m} seqs, step {s}: non-finite"
                nxt = [[int(np.argmax(x))] for x in lg]          # EOS ignored: no stop
                t = time.perf_counter()
                lg = batch_step(eng, nxt, caches)
                if s:
                    times.append(time.perf_counter() - t)        # step 0 warms up
            a = np.asarray(times)
            out[f"decode_{m}"] = {"tps": m / float(np.median(a)), "p50_ms": float(np.median(a)) * 1e3,
                                  "p90_ms": float(np.percentile(a, 90)) * 1e3, "steps": len(a)}
            del caches
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- runs

class _Popen(subprocess.Popen):
    """Popen that keeps the child's own rusage (os.wait4) for its peak RSS."""

    def _try_wait(self, wait_flags):
        pid, sts, ru = os.wait4(self.pid, wait_flags)
        if pid == self.pid:
            self._rusage = ru
        return pid, sts


def run(cmd: list, timeout: int = 2400, cwd: Path | None = None) -> dict:
    """Run `cmd`; its wall time, output and peak RSS (this child's own, from wait4)."""
    t = time.time()
    p = _Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    wall = time.time() - t
    ru = getattr(p, "_rusage", None)
    return {"rc": p.returncode, "out": out, "err": err, "wall_s": wall, "t0": t,
            "maxrss_mib": ru.ru_maxrss / 1024 if ru else None}


def run_child(job: dict) -> dict:
    job = {**job, "t_start": time.time()}
    r = run([sys.executable, "-m", "benchmarks.speed.bench_realscale", "--child", json.dumps(job)],
            cwd=REPO)
    lines = [x for x in r["out"].splitlines() if x.startswith("RESULT ")]
    if r["rc"] != 0 or not lines:
        raise RuntimeError(f"colibri child ({job['what']}) exit {r['rc']}: {r['err'][-1500:]}")
    res = json.loads(lines[-1][7:])
    res.update(wall_s=r["wall_s"], maxrss_mib=r["maxrss_mib"])
    return res


def run_tool(cmd: list) -> dict:
    r = run(cmd)
    if r["rc"] != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exit {r['rc']}: {r['err'][-1500:]}")
    return r


def drop(paths) -> None:
    from colibri_core.memstat import drop_file_cache
    for f in paths:
        drop_file_cache(f, sync=True)


def warm(paths) -> None:
    buf = bytearray(8 << 20)
    for f in paths:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def gguf_floor_bytes(cfg) -> float:
    """Bytes of the GGUF one decode token reads: every tensor but the embedding (one row)
    and the expert tensors and their biases (top-k of E)."""
    total = 0.0
    for name, t, shape, _ in RM._gguf_tensors(cfg, None):
        n = RM.gguf_tensor_bytes(t, shape)
        if name == "token_embd.weight":
            n /= shape[0]
        elif "_exps" in name:
            n *= cfg.top_k / cfg.num_experts
        total += n
    return total


def measure(shape: str, a) -> dict:
    from benchmarks.speed._pipeline_inputs import weights_per_token
    from benchmarks.peers._llamacpp_tools import ensure_tools, parse_batched_bench
    from benchmarks.speed._realscale_routing import routing_variant, set_routing
    p = RM.ensure(shape, a.dir)
    mdir, gguf = p["colibri"], p["gguf"]
    variant = routing_variant(shape, a.dir)     # set on the Colibri model (issue 31)
    if variant is not None:     # a GGUF written since then has its own routers: make them one
        set_routing(shape, variant, a.dir)
    cfiles = sorted(x for x in mdir.iterdir() if x.suffix == ".bin")
    tools = ensure_tools(("llama-bench", "llama-batched-bench"), build=not a.no_build)
    cfg = RM.model_config(shape)
    T = str(a.threads)
    res = {"shape": shape, "threads": a.threads, "tokens": a.tokens, "loadavg_before": os.getloadavg(),
           "routing": variant or "uniform (each file its own random draw)",
           "colibri_bytes": sum(x.stat().st_size for x in cfiles), "gguf_bytes": gguf.stat().st_size}
    log("read bandwidth ...")
    res["bandwidth"] = best_read_bandwidth(a.threads, 1024, 5)
    bw = res["bandwidth"]["GBps"] * 1e9
    wpt = weights_per_token(mdir)
    res["floor_ms"] = {"colibri": wpt["bytes_per_token"] / bw * 1e3,
                       "llama": gguf_floor_bytes(cfg) / bw * 1e3}
    if not a.quick:
        for state in ("cold", "warm"):
            for eng in ("colibri", "llama"):
                files = cfiles if eng == "colibri" else [gguf]
                (drop if state == "cold" else warm)(files)
                log(f"load to first token, {state}, {eng} ...")
                if eng == "colibri":
                    r = run_child({"what": "ttft", "model": str(mdir), "threads": a.threads})
                    res[f"ttft_{state}_colibri"] = r
                else:
                    r = run_tool([str(tools["llama-batched-bench"]), "-m", str(gguf), "-c", "256",
                                  "-npp", "8", "-ntg", "1", "-npl", "1", "-t", T])
                    lt = re.search(r"load time\s*=\s*([\d.]+) ms", r["err"] + r["out"])
                    res[f"ttft_{state}_llama"] = {"first_token_s": r["wall_s"],
                                                  "load_ms": float(lt.group(1)) if lt else None}
    warm(cfiles + [gguf])
    ctx = (PROMPT + a.tokens + 8) * max(BATCHES)
    runs = {k: [] for k in ("prefill_colibri", "prefill_llama", "decode_colibri", "decode_llama")}
    for rnd in range(a.rounds):                 # alternating: C L, then L C, ...
        for eng in (("colibri", "llama") if rnd % 2 == 0 else ("llama", "colibri")):
            log(f"round {rnd + 1}: prefill and decode, {eng} ...")
            warm(cfiles if eng == "colibri" else [gguf])    # both may not fit in memory
            if eng == "colibri":
                runs["prefill_colibri"].append(run_child(
                    {"what": "prefill", "model": str(mdir), "threads": a.threads,
                     "prefill": [512, 2048]}))
                runs["decode_colibri"].append(run_child(
                    {"what": "decode", "model": str(mdir), "threads": a.threads,
                     "tokens": a.tokens, "batches": list(BATCHES)}))
                continue
            r = run_tool([str(tools["llama-bench"]), "-m", str(gguf), "-p", "512,2048", "-n", "0",
                          "-r", "1", "-t", T, "-o", "json"])
            runs["prefill_llama"].append({f"prefill_{row['n_prompt']}_tps": row["avg_ts"]
                                          for row in json.loads(r["out"])})
            r = run_tool([str(tools["llama-batched-bench"]), "-m", str(gguf), "-c", str(ctx),
                          "-npp", str(PROMPT), "-ntg", str(a.tokens), "-npl",
                          ",".join(map(str, BATCHES)), "-t", T])
            rows = parse_batched_bench(r["out"] + "\n" + r["err"])
            d = {f"decode_{row['B']}": {"tps": row["S_TG t/s"], "p50_ms": 1e3 * row["B"] / row["S_TG t/s"]}
                 for row in rows}
            d["maxrss_mib"] = r["maxrss_mib"]
            runs["decode_llama"].append(d)
    res["rounds"] = runs
    res.update({k: median_of(v) for k, v in runs.items()})
    res["loadavg_after"] = os.getloadavg()
    return res


def median_of(runs: list) -> dict:
    """Per numeric leaf, the median over the rounds (peak RSS: the largest)."""
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = median_of([r[k] for r in runs])
        elif isinstance(v, (int, float)) and v is not None:
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = max(vals) if k == "maxrss_mib" else float(np.median(vals))
        else:
            out[k] = v
    return out


def targets(shape: str, r: dict) -> list:
    c, l = r["decode_colibri"], r["decode_llama"]
    out = []

    def add(name, ratio, target, higher=True, note=""):
        met = ratio is not None and (ratio >= target if higher else ratio <= target)
        out.append({"name": name, "shape": shape, "ratio": None if ratio is None else round(ratio, 3),
                    "target": target, "better": "higher" if higher else "lower", "met": bool(met),
                    "note": note})
    llama_p1_ms = 1e3 / l["decode_1"]["tps"]
    strict = llama_p1_ms > 1.5 * r["floor_ms"]["llama"]
    add("decode_1seq_vs_llama", c["decode_1"]["tps"] / l["decode_1"]["tps"], 1.3 if strict else 1.1,
        note=f"llama.cpp p1 {llama_p1_ms:.0f} ms = {llama_p1_ms / r['floor_ms']['llama']:.2f}x its floor")
    add("decode_16seq_vs_llama", c["decode_16"]["tps"] / l["decode_16"]["tps"], 1.5)
    add("p50_over_floor", c["decode_1"]["p50_ms"] / r["floor_ms"]["colibri"], 1.5, higher=False)
    for n in (512, 2048):
        add(f"prefill_{n}_vs_llama", r["prefill_colibri"][f"prefill_{n}_tps"]
            / r["prefill_llama"][f"prefill_{n}_tps"], 1.0)
    if shape == "qwen3-30b-a3b" and "ttft_warm_colibri" in r:
        add("ttft_warm_s", r["ttft_warm_colibri"]["first_token_s"], 2.0, higher=False)
    add("peak_rss_vs_llama", c["maxrss_mib"] / l["maxrss_mib"], 1.0, higher=False)
    return out


def table(entries: list) -> str:
    lines = ["| shape | target | figure | target | met |", "|---|---|---|---|---|"]
    for e in entries:
        op = ">=" if e["better"] == "higher" else "<="
        lines.append(f"| {e['shape']} | {e['name']} | {e['ratio']} | {op} {e['target']} | "
                     f"{'yes' if e['met'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(RM.GGUF_ARCH), default="olmoe-1b-7b")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each engine")
    ap.add_argument("--dir", type=Path, default=RM.DEFAULT_DIR)
    ap.add_argument("--no-build", action="store_true", help="do not build llama.cpp's tools")
    ap.add_argument("--delete", action="store_true", help="delete the shape's files afterwards")
    ap.add_argument("--child")
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    if a.quick:
        a.shape, a.tokens, a.rounds = "olmoe-1b-7b", 32, 1
    t0 = time.time()
    r = measure(a.shape, a)
    r.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=git_commit(),
             machine=machine(), minutes=(time.time() - t0) / 60, quick=a.quick,
             routing="random routers: near-uniform routing")
    OUT.mkdir(exist_ok=True)
    runs_p = OUT / "realscale_runs.json"
    runs = json.loads(runs_p.read_text()) if runs_p.exists() else {}
    runs[a.shape + (" (quick)" if a.quick else "")] = r
    runs_p.write_text(json.dumps(runs, indent=1, default=str) + "\n")
    new = targets(a.shape, r)
    tp = OUT / "realscale.json"
    old = json.loads(tp.read_text()) if tp.exists() else []
    keep = [e for e in old if e["shape"] != a.shape or e["name"] not in {n["name"] for n in new}]
    tp.write_text(json.dumps(keep + new, indent=1) + "\n")
    print(table(keep + new))
    if a.delete:
        RM.delete(a.shape, a.dir)


if __name__ == "__main__":
    main()
