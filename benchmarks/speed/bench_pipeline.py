"""One forward pipeline (issue 14): its targets measured side by side in one run.

    python -m benchmarks.speed.bench_pipeline [--rounds 2] [--threads 2] [--tokens 128]
                                        [--only a,b,c,d,e,f,g] [--quick] [--no-build]
    python -m benchmarks.speed.bench_pipeline --render      # the tables of the last run again

On the Mixtral-shaped benchmark model of bench_vs_llamacpp.py (benchmarks/peers/_vs_models.py;
built and converted on first use, cached under benchmarks/out/vs_llamacpp/), `--threads`
threads, 64-token random prompts, greedy:

  a  plain single-sequence decode: per-token p50, p90, p99 (`--tokens` tokens after the
     prompt; the first token, which carries the prefill, is left out)
  b  the same, each alone: a memory budget holding the whole model (max_resident_mb 1.1x
     the model's files), one no-op colibri_before_layer plugin, the metrics plugin, and
     `--debug routing` tracing to a file (COLIBRI_DEBUG=routing COLIBRI_DEBUG_FILE=...):
     per-token p50 / plain (target <= 1.15)
  c  a budget of half the model's files: per-token p50, expert-cache hit rate, MB loaded
     into the cache per token (the engine's memory_report) and MB read from disk per token
     (/proc/self/io), and the bound 1.2 x (plain + MB loaded per token / the cold read rate
     of the expert files: posix_fadvise DONTNEED on each, then read whole, as many threads
     as the cache's I/O pool)
  d  batched decode of 4, 16 and 64 sequences (their 64-token prompts prefilled first;
     then one token per sequence per step, `--batch-steps` steps): step time, aggregate
     tokens/s, and the roofline max(bytes read per step / read bandwidth, multiply-adds
     per step / the q4 batch-kernel rate, measured here with bench_kernels.py's `bench`)
  e  a DeepSeek-V3-shaped model (_vs_models.DEEPSEEK_SHAPE: MLA, first layer dense, 64
     experts top-8 in 8 groups (top-4 groups, sigmoid + e_score_correction_bias), one
     shared expert; cached under benchmarks/out/vs_deepseek/): per-token p50 / its
     bandwidth floor, against the same ratio on the Mixtral-shaped model (target: <= 1.2x)
  f  llama.cpp's `llama-batched-bench -c 12288 -npp 64 -ntg 128 -npl 1,4,16,64` on the
     Q4_0 GGUF of the same model: aggregate generation tokens/s (S_TG) per batch, next to
     Colibri's from d (built on demand: benchmarks/peers/_llamacpp_tools.py, ~11 minutes once;
     `--no-build` skips the part instead)
  g  lines of Python and C of the forward path

Each configuration runs in its own fresh process (this script with --child), the
configurations interleaved (the order reversed every other round), `--rounds` rounds; the
tables give medians over the rounds and ratios of medians. Before each child the model's
files are read into the page cache (the budget runs: dropped from it instead). Read
bandwidth: one figure per run, the higher of numpy's and a C streaming read
(common.best_read_bandwidth). Bytes and multiply-adds per token come from the model files'
sections (_pipeline_inputs.weights_per_token). Writes benchmarks/out/bench_pipeline.json.

Batched decode goes through `engine.model.forward` (the engine has no public batch API
yet); `batch_step` is the one place that says so.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, best_read_bandwidth, git_commit, machine
from benchmarks.speed._pipeline_inputs import (cold_read_rate, drop_cache, forward_lines, kernel_rate,
                                              model_bytes, warm_cache, weights_per_token)
from benchmarks.speed._pipeline_report import LLAMA_ARGS, MiB, render, summarize

PROMPT = 64
BATCHES = (4, 16, 64)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the child

def _use_checkout_plugins() -> None:
    """Built-in plugins from this checkout's plugins/ (as ab_decode.py does): the editable
    install maps colibri_core.builtin_plugins to whichever checkout installed it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "colibri_core.builtin_plugins", str(REPO / "plugins" / "__init__.py"),
        submodule_search_locations=[str(REPO / "plugins")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)


def _plugin_manager(names: list):
    if not names:
        return None
    from colibri_core.hookspecs import hookimpl
    from colibri_core.plugins import DEFAULT_BUILTINS, build_plugin_manager

    class NoOpBeforeLayer:
        @hookimpl
        def colibri_before_layer(self, layer, hidden):
            return None

    builtins = list(DEFAULT_BUILTINS) + (["metrics"] if "metrics" in names else [])
    pm = build_plugin_manager(builtins=tuple(builtins))
    if "noop_before_layer" in names:
        pm.register(NoOpBeforeLayer(), name="noop-before-layer")
    return pm


def pcts(lat_s: list) -> dict:
    a = np.asarray(lat_s) * 1e3
    return {"n": int(a.size), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean())}


def batch_step(eng, tokens: list, caches: list) -> list:
    """One forward over m sequences, `tokens[i]` continuing the sequence of `caches[i]`:
    logits [V] per sequence. Today `engine.model.forward` (no public batch API yet): the one
    place to switch when there is one."""
    return eng.model.forward([np.asarray(t, np.int64) for t in tokens], caches)


def child_decode(job: dict, eng) -> dict:
    from colibri_core.memstat import proc_read_bytes
    from colibri_core.runtime.sampler import SamplingParams
    rng = np.random.default_rng(job.get("seed", 0))
    prompt = rng.integers(1, eng.model_cfg.vocab_size - 1, PROMPT).tolist()
    eng.generate(prompt[:8], max_new_tokens=4, temperature=0.0).run()     # warm-up
    lat, snap = [], None
    greedy = SamplingParams(temperature=0.0, ignore_eos=bool(job.get("ignore_eos")))
    for ev in eng.generate(prompt, max_new_tokens=job["tokens"] + 1 + job.get("warmup", 0),
                           sampling=greedy):
        lat.append(ev.latency_s)
        if snap is None:               # after the prefill: decode-only counters from here
            snap = (eng.memory_report(page_cache=False), proc_read_bytes() or 0)
    rep, read = eng.memory_report(page_cache=False), proc_read_bytes() or 0
    skip = 1 + job.get("warmup", 0)    # the first token carries the prefill
    n = len(lat) - 1
    out = {**pcts(lat[skip:]), "first_token_ms": lat[0] * 1e3}
    if rep.get("budget"):
        d = {k: rep[k] - snap[0][k] for k in ("hits", "misses", "loaded_bytes", "stall_s")}
        out.update(budget=rep["budget"], capacity=rep["capacity"], whole_model=bool(rep.get("whole_model")),
                   experts_total=rep["plan"]["experts_total"],
                   hit_rate=d["hits"] / (d["hits"] + d["misses"]) if d["hits"] + d["misses"] else None,
                   loaded_per_token=d["loaded_bytes"] / n, stall_ms_per_token=d["stall_s"] / n * 1e3,
                   disk_read_per_token=(read - snap[1]) / n)
    return out


def child_batch(job: dict, eng) -> dict:
    m, steps = job["batch"], job["steps"]
    V = eng.model_cfg.vocab_size
    rng = np.random.default_rng(job.get("seed", 0))
    prompts = [rng.integers(1, V - 1, PROMPT) for _ in range(m)]
    caches = [eng.model.new_cache(PROMPT + steps + 2) for _ in range(m)]
    t0 = time.perf_counter()
    logits = []
    for i in range(0, m, 16):                     # prefill, 16 sequences per forward
        logits += batch_step(eng, prompts[i:i + 16], caches[i:i + 16])
    prefill_s = time.perf_counter() - t0
    nxt = [int(np.argmax(lg)) for lg in logits]
    per_pos = eng.model.cache_bytes(1)            # KV bytes per position, every layer
    times, distinct, kv_read, ctx = [], [], [], []
    for s in range(steps + 1):
        kv = sum(c.length + 1 for c in caches) * per_pos
        ctx.append(sum(c.length + 1 for c in caches))
        t = time.perf_counter()
        logits = batch_step(eng, [[t_] for t_ in nxt], caches)
        dt = time.perf_counter() - t
        nxt = [int(np.argmax(lg)) for lg in logits]
        if s == 0:
            continue                              # the first step warms up
        times.append(dt)
        kv_read.append(kv)
        tr = eng.model.last_routing
        distinct.append([int(np.unique(lt.routing.ids[lt.routing.ids >= 0]).size) for lt in tr])
    return {**pcts(times), "batch": m, "steps": steps, "prefill_s": prefill_s,
            "distinct_experts_per_layer": float(np.mean([sum(d) / max(len(d), 1) for d in distinct])),
            "distinct_experts_per_step": float(np.mean([sum(d) for d in distinct])),
            "kv_bytes_per_step": float(np.mean(kv_read)),
            "attended_positions_per_step": float(np.mean(ctx[1:]))}


def _decode_path(eng, job) -> str:
    """Which forward ran: the one pipeline (naming its reference blocks on a checkout
    that still had them), or on a checkout from before it the decode fast path or the
    general path."""
    m = eng.model
    pipeline = getattr(m, "pipeline", None)
    if pipeline is not None:
        ref = getattr(pipeline, "blocks", None)
        return "pipeline" + (" (reference: " + ", ".join(f"{b}: {why}" for b, why in ref.items()) + ")"
                             if ref else "")
    if job["kind"] == "batch":
        return "Model.forward, batched"
    plan = m.decode_plan()
    return "fast path" if not isinstance(plan, str) else f"general path: {plan}"


def child(job: dict) -> None:
    _use_checkout_plugins()
    from colibri_core import kernels as K
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    t = time.perf_counter()
    eng = Engine(job["model"], EngineConfig(threads=job["threads"], **job.get("settings", {})),
                 plugin_manager=_plugin_manager(job.get("plugins", [])))
    load_s = time.perf_counter() - t
    out = child_batch(job, eng) if job["kind"] == "batch" else child_decode(job, eng)
    out.update(load_s=load_s, backend=K.backend(), decode_path=_decode_path(eng, job))
    eng.close()
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- the parent

KV_TOKENS = 256     # KV positions a budget reserves (64 + 128 used), not the 2,048 context


def whole_model_budget(model_dir: Path) -> float:
    """max_resident_mb (MiB) of about 1.1x the model's files, raised where needed until the
    budget's expert cache holds every expert (residency.check_budget's plan)."""
    from colibri_core.config import EngineConfig
    from colibri_core.experts.residency import check_budget
    mb = round(1.1 * model_bytes(model_dir) / MiB, 1)
    for _ in range(8):
        plan = check_budget(model_dir, EngineConfig(max_resident_mb=mb,
                                                    residency={"kv_tokens": KV_TOKENS}))
        short = plan.experts_total - plan.capacity
        if short <= 0:
            return mb
        mb = round(mb + short / MiB + 1, 1)
    return mb


def configs(a, mix: Path, ds: Path | None) -> list[dict]:
    """The configurations to run, each a child job (`name`, `part`)."""
    size = model_bytes(mix)
    kv = {"kv_tokens": KV_TOKENS}
    base = dict(kind="decode", model=str(mix), threads=a.threads, tokens=a.tokens)
    want = set(a.only)
    out = []
    if want & set("abce"):
        out.append({**base, "name": "plain", "part": "a"})
    if "b" in want:
        out += [
            {**base, "name": "budget: whole model", "part": "b",
             "settings": {"max_resident_mb": whole_model_budget(mix), "residency": kv}},
            {**base, "name": "no-op before_layer plugin", "part": "b", "plugins": ["noop_before_layer"]},
            {**base, "name": "metrics plugin", "part": "b", "plugins": ["metrics"]},
            {**base, "name": "--debug routing to a file", "part": "b",
             "env": {"COLIBRI_DEBUG": "routing",
                     "COLIBRI_DEBUG_FILE": str(OUT / "bench_pipeline_routing.log")}},
        ]
    if "c" in want:
        out.append({**base, "name": "budget: half the model", "part": "c",
                    "settings": {"max_resident_mb": round(0.5 * size / MiB, 1), "residency": kv}})
    if "d" in want:
        out += [{**base, "kind": "batch", "name": f"batch {m}", "part": "d", "batch": m,
                 "steps": a.batch_steps} for m in a.batches]
    if "e" in want and ds is not None:
        out.append({**base, "model": str(ds), "name": "DeepSeek-V3-shaped, plain", "part": "e"})
    return out


def run_child(job: dict) -> dict:
    model = Path(job["model"])
    state = job.get("cache", "cold" if job.get("settings", {}).get("max_resident_mb") else "warm")
    if state == "cold":       # the job's page-cache state; default: budget dropped, plain read
        drop_cache(model)
    else:
        warm_cache(model)
    if job.get("env", {}).get("COLIBRI_DEBUG_FILE"):
        Path(job["env"]["COLIBRI_DEBUG_FILE"]).unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        **job.get("env", {}))
    p = subprocess.run([sys.executable, "-m", "benchmarks.speed.bench_pipeline", "--child",
                        json.dumps(job)], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["?"])[-1],
                "stderr": p.stderr[-3000:]}
    res = json.loads(lines[-1][len("RESULT "):])
    f = job.get("env", {}).get("COLIBRI_DEBUG_FILE")
    if f and Path(f).exists():
        res["trace_bytes"] = Path(f).stat().st_size
    return res


def run_rounds(jobs: list, rounds: int, runs: dict, line) -> None:
    """Every job once a round, each a fresh child (run_child), the order reversed every
    other round; results appended to runs[job name], logged with line(result)."""
    for r in range(rounds):
        for j in (jobs if r % 2 == 0 else jobs[::-1]):
            got = run_child(j)
            runs[j["name"]].append(got)
            log(f"round {r} {j['name']:22s} " + (line(got) if "p50_ms" in got else got.get("error", "?")))


def run_llama(tools: dict, gguf: Path, threads: int, quick: bool) -> dict:
    args = list(LLAMA_ARGS)
    if quick:
        args[args.index("-ntg") + 1] = "32"
    cmd = [str(tools["llama-batched-bench"]), "-m", str(gguf), *args, "-t", str(threads)]
    from benchmarks.peers._llamacpp_tools import parse_batched_bench
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    rows = parse_batched_bench(p.stdout + "\n" + p.stderr)
    if p.returncode != 0 or not rows:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-800:]}", "cmd": cmd}
    return {"rows": rows, "cmd": cmd}



def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=None, help="decoded tokens per run (128; quick 32)")
    ap.add_argument("--batch-steps", type=int, default=None, help="timed steps per batch (32; quick 6)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--only", default="abcdefg", help="parts, e.g. a,b,d")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and steps (a smoke run)")
    ap.add_argument("--no-build", action="store_true", help="skip f unless llama.cpp is built")
    ap.add_argument("--render", action="store_true",
                    help="print the tables of the last run (benchmarks/out/bench_pipeline.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    if a.render:
        return print(render(summarize(json.loads((OUT / "bench_pipeline.json").read_text()))))
    a.only = [p for p in a.only.replace(",", "") if p in "abcdefg"]
    a.tokens = a.tokens or (32 if a.quick else 128)
    a.batch_steps = a.batch_steps or (6 if a.quick else 32)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    from colibri_core import kernels as K
    from benchmarks.peers._vs_models import DEEPSEEK_WORK, WORK, build_colibri, build_hf, build_hf_deepseek
    mix = build_colibri(build_hf(WORK / "hf"), WORK / "colibri_q4")
    ds = (build_colibri(build_hf_deepseek(DEEPSEEK_WORK / "hf"), DEEPSEEK_WORK / "colibri_q4")
          if "e" in a.only else None)
    res = {"command": "python -m benchmarks.speed.bench_pipeline " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": git_commit(), "machine": machine(), "backend": K.backend(),
           "threads": a.threads, "rounds": a.rounds, "parts": a.only, "tokens": a.tokens,
           "batch_steps": a.batch_steps, "load_before": os.getloadavg()[0]}
    res["weights"] = {"mixtral": weights_per_token(mix)}
    if ds is not None:
        res["weights"]["deepseek"] = weights_per_token(ds)
    mcfg = json.loads((mix / "config.json").read_text())
    res["attn_macs_per_position"] = 2 * mcfg["num_layers"] * mcfg["num_heads"] * (
        mcfg.get("head_dim") or mcfg["hidden_size"] // mcfg["num_heads"])
    log("measuring read bandwidth ...")
    res["bandwidth"] = best_read_bandwidth(a.threads, 512 if a.quick else 1024, 5 if a.quick else 7)
    log(f"  {res['bandwidth']['GBps']:.1f} GB/s ({res['bandwidth']['source']})")
    if "c" in a.only:
        from colibri_core.config import ResidencyConfig
        res["expert_read"] = cold_read_rate(mix, ResidencyConfig().io_threads)
        log(f"  expert files read cold: {res['expert_read']['GBps']:.2f} GB/s")
    if "d" in a.only:
        res["kernel_rate"] = kernel_rate(a.threads, a.quick)
        log(f"  q4 batch kernel: {res['kernel_rate']['macs_per_s'] / 1e9:.1f} GMAC/s")
    tools, gguf = None, None
    if "f" in a.only:
        try:
            from benchmarks.peers import _llamacpp_tools as LT
            tools = LT.ensure_tools(build=not a.no_build)
            gguf = LT.q4_gguf(WORK / "hf", WORK, a.threads, build=not a.no_build)
            marker = LT.BUILD / "colibri-cmake-flags.txt"
            res["llama_cpp"] = {"tool": str(tools["llama-batched-bench"]), "gguf": str(gguf),
                                "source": str(LT.source_dir()), "runs": [],
                                "flags": marker.read_text() if marker.exists() else "?"}
        except Exception as e:
            res["llama_cpp"] = {"error": f"{type(e).__name__}: {e}"}
            log("llama.cpp part skipped: " + res["llama_cpp"]["error"])
            tools = None
    jobs = configs(a, mix, ds)
    res["parts_of"] = {j["name"]: j["part"] for j in jobs}
    res["jobs"] = jobs
    res["runs"] = {j["name"]: [] for j in jobs}
    for r in range(a.rounds):
        order = jobs if r % 2 == 0 else jobs[::-1]
        for j in order:
            got = run_child(j)
            res["runs"][j["name"]].append(got)
            log(f"round {r} {j['name']:28s} " + (f"p50 {got['p50_ms']:.2f} ms" if "p50_ms" in got
                                                 else got.get("error", "?")))
        if tools is not None:
            got = run_llama(tools, gguf, a.threads, a.quick)
            res["llama_cpp"]["runs"].append(got)
            log(f"round {r} llama-batched-bench " + ("ok" if "rows" in got else got["error"]))
    if "g" in a.only:
        res["lines"] = forward_lines()
    res["load_after"] = os.getloadavg()[0]
    summarize(res)
    text = render(res)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_pipeline.json").write_text(json.dumps(res, indent=1, default=str))
    print(text)
    print(f"\n(JSON: {OUT / 'bench_pipeline.json'})")


if __name__ == "__main__":
    main()
