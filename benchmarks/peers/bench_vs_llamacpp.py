"""Colibri vs llama.cpp (and transformers on PyTorch CPU) on the Mixtral-shaped benchmark
model, timed the same way, in the same run.

    python -m benchmarks.peers.bench_vs_llamacpp [--rounds 3] [--tokens 128] [--prompt 64] [--threads 2]

What it does (everything cached under benchmarks/out/vs_llamacpp/, git-ignored):

1. builds a random-weight MixtralForCausalLM (hidden 1024, 8 layers, 8 experts top-2,
   intermediate 2816, 16 heads / 4 KV heads, vocab 32000; linear weights N(0, 1/fan_in),
   router included, embeddings N(0, 1), norms N(1, 0.1)) and saves it as fp16 safetensors;
2. converts it to Colibri (`colibri_core.convert.convert(..., bits=4)`) and to a GGUF at
   F16 (written here with the `gguf` package, tensor names and Q/K row permutation as
   llama.cpp's convert_hf_to_gguf.py writes them), then to Q4_0 with
   `llama_cpp.llama_model_quantize`;
3. measures the machine's memory read bandwidth (numpy, as many threads as --threads);
4. fidelity: logits of the same prompts from transformers (the fp16 weights run in
   float32: the reference), Colibri q4, llama.cpp F16 and llama.cpp Q4_0;
5. timing: each engine in its own process (benchmarks/_peer_*.py), alternating engines,
   --rounds rounds: first-token latency of a --prompt-token prompt, then --tokens greedy
   tokens (token ids in, token id out); per-token p50/p99/std; the child's peak RSS
   (ru_maxrss from wait4);
6. prints and writes medians, ratios, targets, a markdown table
   (benchmarks/out/vs_llamacpp.md), JSON (benchmarks/out/vs_llamacpp.json) and a PNG of
   per-token latency (benchmarks/out/vs_llamacpp_latency.png).

llama-cpp-python and gguf are installed on demand (pip) when missing; they are never
project dependencies. If that install fails the Colibri + transformers part still runs.

Options: `--profile` re-runs one generation per engine afterwards under py-spy --native
(when py-spy is installed: what the calling thread does during decode steps) and one
Colibri generation under cProfile (decode steps, and the first token separately); all
printed and written to benchmarks/out/vs_llamacpp_profile.txt. `--env KEY=VALUE` adds to
every runner's environment (e.g. OMP_WAIT_POLICY=ACTIVE); `--tag _x` suffixes the output
names; `--report-only` re-renders table and PNG from the last JSON; `--fidelity-only` runs
steps 1, 2 and 4 only. The Colibri conversion is redone when the model, the convert()
arguments (CONVERT_KW) or the converter's code (quant.py, convert/) change. Per-role
causes of the logit error: benchmarks/peers/_peer_fidelity_ablation.py.

Peak RSS is each runner's ru_maxrss from wait4; the runners are started by
benchmarks/peers/_peer_launcher.py, a process forked while this one is small, because Linux
carries the parent's RSS into a forked child's ru_maxrss.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, best_read_bandwidth  # (shared with the other benchmarks)
from benchmarks.peers._vs_models import (  # the model, its conversions, inventories
    HERE, OUT, SHAPE, WORK, build_colibri, build_gguf_f16,
    build_gguf_q4, build_hf, colibri_inventory, gguf_inventory, log)

RUNNER = {"colibri": "_peer_colibri.py", "llama.cpp": "_peer_llamacpp.py",
          "transformers": "_peer_transformers.py"}


def runner_module(engine: str) -> str:
    """The runner of `engine` as a module name (run with -m from the repository root)."""
    return "benchmarks.peers." + RUNNER[engine].removesuffix(".py")


# ----------------------------------------------------------------------------- set-up

def ensure_llama_cpp() -> str | None:
    """Import (or pip install) llama-cpp-python and gguf. -> None, or the error text."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
        return None
    except ImportError:
        pass
    log("llama-cpp-python / gguf missing: pip install llama-cpp-python gguf (builds llama.cpp "
        "from source; ~15 min on 2 cores) ...")
    # the same ISA choice as the llama.cpp tools' build (AMX left out where it crashed)
    from benchmarks.peers._llamacpp_tools import cpu_flags
    env = dict(os.environ)
    if cpu_flags():
        env["CMAKE_ARGS"] = " ".join([env.get("CMAKE_ARGS", ""), *cpu_flags()]).strip()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python", "gguf"],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip().splitlines()[-30:]
        return "pip install llama-cpp-python gguf failed:\n" + "\n".join(tail)
    try:
        import importlib
        importlib.invalidate_caches()
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"installed but not importable: {e}"
    return None



class Launcher:
    """The runners' parent (benchmarks/peers/_peer_launcher.py), started while this process is
    small so that each runner's ru_maxrss is its own (see that file)."""

    def __init__(self):
        self.p = subprocess.Popen([sys.executable, "-m", "benchmarks.peers._peer_launcher"],
                                  cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, cmd, env, cwd, timeout) -> dict:
        self.p.stdin.write(json.dumps({"cmd": cmd, "env": env, "cwd": str(cwd), "timeout": timeout}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.write("\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)


LAUNCHER: Launcher | None = None


EXTRA_ENV: dict = {}


def run_child(engine: str, job: dict, threads: int, timeout: float = 3600) -> dict:
    """Run one engine runner (through the launcher): its JSON, plus its peak RSS (the
    child's ru_maxrss from wait4, KiB on Linux)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **EXTRA_ENV)
    cmd = [sys.executable, "-m", runner_module(engine), json.dumps(job)]
    t0 = time.time()
    r = LAUNCHER.run(cmd, env, REPO, timeout)
    if r["timed_out"]:
        raise RuntimeError(f"{engine} runner timed out after {timeout} s")
    if r["rc"] != 0:
        raise RuntimeError(f"{engine} runner failed (rc {r['rc']}):\n" +
                           "\n".join(r["stderr"].strip().splitlines()[-25:]))
    lines = [ln for ln in r["stdout"].splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1])
    res["peak_rss_mib"] = r["maxrss_kib"] / 1024
    res["wall_s"] = time.time() - t0
    return res


def logit_errors(x: np.ndarray, ref: np.ndarray) -> dict:
    x, ref = x.astype(np.float64), ref.astype(np.float64)
    d = x - ref

    def logp(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lr, lx = logp(ref), logp(x)
    kl = (np.exp(lr) * (lr - lx)).sum(-1)
    return {"rel_rms": float(np.sqrt((d ** 2).sum() / (ref ** 2).sum())),
            "rel_max": float(np.abs(d).max() / np.abs(ref).max()),
            "top1_agree": float((x.argmax(-1) == ref.argmax(-1)).mean()),
            "kl_mean": float(kl.mean())}


# ----------------------------------------------------------------------------- reporting

from benchmarks.peers._vs_report import machine_info, markdown, plot, stats, summarize  # noqa: E402


def profile_colibri(job: dict, threads: int, top: int = 30) -> str:
    """cProfile of the decode steps of one Colibri generation (the timed job re-run)."""
    import io
    import pstats
    prof = OUT / "vs_llamacpp_colibri.pstats"
    pre = OUT / "vs_llamacpp_colibri_prefill.pstats"
    run_child("colibri", {**job, "profile": str(prof), "profile_prefill": str(pre)}, threads)
    buf = io.StringIO()
    st = pstats.Stats(str(prof), stream=buf)
    buf.write("=== cProfile, decode steps only, by own time (tottime) ===\n")
    st.sort_stats("tottime").print_stats(top)
    buf.write("=== by cumulative time ===\n")
    st.sort_stats("cumulative").print_stats(top)
    st = pstats.Stats(str(pre), stream=buf)
    buf.write("=== cProfile, first token (prompt prefill + 1 sample), by own time ===\n")
    st.sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def _leaf_kind(frame: str) -> str:
    lib = frame[frame.rfind("(") + 1:-1] if frame.endswith(")") else ""
    if "libgomp" in lib:
        return "libgomp (OpenMP team start / barrier wait, no compute)"
    if lib.startswith(("ck_", "xmmintrin", "emmintrin", "avx", "fma", "immintrin", "smmintrin",
                       "tmmintrin", "pmmintrin", "f16c")):
        return "kernel compute (ck_*.c, intrinsics)"
    if "libggml" in lib or "libllama" in lib:
        return "llama.cpp compute/graph (libggml*, libllama)"
    if "madvise" in frame:
        return "madvise (expert prefetch)"
    if "libc" in lib or "libm" in lib:
        return "libc/libm"
    if "numpy" in lib or "_multiarray" in lib:
        return "numpy internals"
    if lib.endswith(".py") or ".py:" in lib:
        return "Python interpreter"
    return "other native: " + frame[:60]


def pyspy(engine: str, job: dict, threads: int, rate: int = 250) -> str | None:
    """py-spy --native samples of one generation, aggregated over the decode steps: what
    the engine's calling thread is doing (leaf kind), and from which frame."""
    import collections
    import shutil
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    raw = OUT / f"vs_llamacpp_pyspy_{engine.replace('.', '')}.txt"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **EXTRA_ENV)
    cmd = [spy, "record", "--native", "-r", str(rate), "-f", "raw", "-o", str(raw), "--",
           sys.executable, "-m", runner_module(engine), json.dumps(job)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0 or not raw.exists():
        return "py-spy failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]
    if engine == "colibri":
        import colibri_core.runtime.generate as g
        src = Path(g.__file__).read_text().splitlines()
        fwd = [i + 1 for i, ln in enumerate(src) if "eng.model.forward(" in ln]
        decode_tag = f"generate.py:{fwd[-1]})" if len(fwd) >= 2 else "Model.forward"
        mine = "colibri_core/"
    else:
        src = (HERE / RUNNER[engine]).read_text().splitlines()
        decode_tag = f"{RUNNER[engine]}:{[i + 1 for i, ln in enumerate(src) if 'llm.eval([tok])' in ln][0]})"
        mine = "llama_cpp/"
    kinds, frames, callers = collections.Counter(), collections.Counter(), collections.Counter()
    tot = 0
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        if decode_tag not in stack:
            continue
        n = int(n)
        fr = stack.split(";")
        tot += n
        k = _leaf_kind(fr[-1])
        kinds[k] += n
        cc = [f for f in fr if mine in f or "ck_core.c" in f or "libggml" in f]
        frames[cc[-1] if cc else "(none)"] += n
        if k.startswith("libgomp"):
            c = [f for f in fr if "ck_core.c" in f or "libggml" in f]
            callers[c[-1] if c else "?"] += n
    if not tot:
        return "py-spy: no decode samples"
    out = [f"=== {engine}: py-spy --native, {tot} samples of the calling thread during decode steps "
           f"(stacks through {decode_tag}) ===", "-- leaf kind --"]
    small = sum(v for v in kinds.values() if v < 0.005 * tot)
    out += [f"{100 * v / tot:5.1f}%  {k}" for k, v in kinds.most_common() if v >= 0.005 * tot]
    if small:
        out.append(f"{100 * small / tot:5.1f}%  (other leaves, < 0.5% each)")
    out.append(f"-- deepest {mine} / kernel frame --")
    out += [f"{100 * v / tot:5.1f}%  {k}" for k, v in frames.most_common(12)]
    out.append("-- libgomp samples by the kernel line that entered OpenMP --")
    out += [f"{100 * v / tot:5.1f}%  {k}" for k, v in callers.most_common(10)]
    return "\n".join(out)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fidelity-prompts", type=int, default=4)
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers peer's timing")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="afterwards: cProfile one Colibri decode; py-spy --native both engines")
    ap.add_argument("--tag", default="", help="suffix for the output file names")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for every engine runner (e.g. OMP_WAIT_POLICY=ACTIVE)")
    ap.add_argument("--fidelity-only", action="store_true",
                    help="only the logit-error part (no bandwidth, no timing); writes "
                         "benchmarks/out/vs_llamacpp{tag}_fidelity.json")
    ap.add_argument("--report-only", action="store_true",
                    help="re-render the table and PNG from the last run's JSON (no measuring)")
    a = ap.parse_args(argv)
    if a.report_only:
        stem = OUT / f"vs_llamacpp{a.tag}"
        res = json.loads(stem.with_suffix(".json").read_text())
        summarize(res)
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float))
        err = plot(res, stem.with_name(stem.name + "_latency.png"))
        if err:
            print(f"plot skipped: {err}", file=sys.stderr)
        md = markdown(res)
        stem.with_suffix(".md").write_text(md + "\n")
        print(md)
        return
    global LAUNCHER
    EXTRA_ENV.update(kv.split("=", 1) for kv in a.env)
    LAUNCHER = Launcher()          # first, while this process is small
    try:
        _main(a)
    finally:
        LAUNCHER.close()


def _main(a):
    WORK.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    res: dict = {"args": vars(a), "machine": machine_info(), "loadavg_start": os.getloadavg()}
    log(f"{res['machine']['date']}  load average {res['loadavg_start']}")

    llama_err = "skipped (--no-llamacpp)" if a.no_llamacpp else ensure_llama_cpp()
    if llama_err:
        log("llama.cpp part skipped: " + llama_err)
        res["llama_cpp_error"] = llama_err
    hf = build_hf(WORK / "hf_f16")
    col = build_colibri(hf, WORK / "colibri_q4")
    paths = {"colibri": str(col), "transformers": str(hf)}
    if not llama_err:
        try:
            import llama_cpp
            res["llama_cpp_version"] = llama_cpp.__version__
            f16 = build_gguf_f16(hf, WORK / "model-f16.gguf")
            q4 = build_gguf_q4(f16, WORK / "model-q4_0.gguf", a.threads)
            paths["llama.cpp"] = str(q4)
            paths["llama.cpp F16"] = str(f16)
        except Exception as e:
            llama_err = f"{type(e).__name__}: {e}"
            log("llama.cpp part skipped: " + llama_err)
            res["llama_cpp_error"] = llama_err
    res["paths"] = paths

    res["inventory"] = {"colibri": colibri_inventory(col)}
    if "llama.cpp" in paths:
        res["inventory"]["llama.cpp"] = gguf_inventory(Path(paths["llama.cpp"]))
        res["inventory"]["llama.cpp F16"] = gguf_inventory(Path(paths["llama.cpp F16"]))
    if not a.fidelity_only:
        log("measuring read bandwidth ...")
        res["bandwidth"] = best_read_bandwidth(a.threads)
        log(f"  {res['bandwidth']['GBps']:.2f} GB/s ({a.threads} threads, "
            f"{res['bandwidth']['source']} read)")

    # ---- fidelity: the same prompts through every model
    V = SHAPE["vocab_size"]
    rng = np.random.default_rng(1)
    fprompts = [rng.integers(3, V, a.prompt).tolist() for _ in range(a.fidelity_prompts)]
    logits = {}
    for name, eng, model in (("hf_fp16", "transformers", paths["transformers"]),
                             ("colibri_q4", "colibri", paths["colibri"]),
                             ("llama.cpp F16", "llama.cpp", paths.get("llama.cpp F16")),
                             ("llama.cpp Q4_0", "llama.cpp", paths.get("llama.cpp"))):
        if model is None:
            continue
        log(f"logits: {name} ...")
        fn = WORK / f"logits_{name.replace(' ', '_').replace('.', '')}.npy"
        run_child(eng, {"mode": "logits", "model": model, "threads": a.threads,
                               "prompts": fprompts, "out": str(fn)}, a.threads)
        logits[name] = np.load(fn)
    fid = {"prompts": len(fprompts), "positions_per_prompt": a.prompt}
    pairs = [("colibri_q4", "hf_fp16"), ("llama.cpp Q4_0", "llama.cpp F16"),
             ("llama.cpp Q4_0", "hf_fp16"), ("llama.cpp F16", "hf_fp16")]
    for x, ref in pairs:
        if x in logits and ref in logits:
            fid[f"{x} vs {ref}"] = logit_errors(logits[x], logits[ref])
    res["fidelity"] = fid
    for k, v in fid.items():
        if isinstance(v, dict):
            log(f"  {k}: rel RMS {v['rel_rms']:.4f}  rel max {v['rel_max']:.4f}  "
                f"top-1 {100 * v['top1_agree']:.1f}%  KL {v['kl_mean']:.4f}")
    if a.fidelity_only:
        out = OUT / f"vs_llamacpp{a.tag}_fidelity.json"
        out.write_text(json.dumps(res, indent=1, default=float))
        print(json.dumps(fid, indent=1, default=float))
        print(f"wrote {out}")
        return

    # ---- timing rounds
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, V, a.prompt).tolist()
    warm = rng.integers(3, V, a.prompt).tolist()
    engines = ["colibri"] + (["llama.cpp"] if "llama.cpp" in paths else [])
    runs = []
    for rnd in range(a.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        if not a.no_transformers:
            order = order + ["transformers"]
        for e in order:
            job = {"mode": "time", "model": paths[e], "threads": a.threads, "prompt": prompt,
                   "warmup": warm, "tokens": a.tokens}
            r = run_child(e, job, a.threads)
            r["round"] = rnd
            r["engine"] = e
            r["stats"] = stats(r)
            runs.append(r)
            s = r["stats"]
            log(f"round {rnd} {e:12s} first {s['first_token_ms']:7.1f} ms  decode "
                f"{s['decode_tok_s']:6.2f} tok/s  p50 {s['p50_ms']:6.2f}  p99 {s['p99_ms']:6.2f}  "
                f"std {s['std_ms']:5.2f} ms  RSS {s['peak_rss_mib']:6.0f} MiB  "
                f"load {os.getloadavg()[0]:.2f}")
    res["runs"] = runs
    summarize(res)
    if a.profile:
        log("profiling one Colibri decode (cProfile) ...")
        pjob = {"mode": "time", "model": paths["colibri"], "threads": a.threads,
                "prompt": prompt, "warmup": warm, "tokens": a.tokens}
        txt = profile_colibri(pjob, a.threads)
        for e in engines:
            log(f"py-spy --native of one {e} generation ...")
            spy = pyspy(e, {**pjob, "model": paths[e]}, a.threads)
            if spy:
                txt = spy + "\n\n" + txt
                print(spy)
        (OUT / f"vs_llamacpp{a.tag}_profile.txt").write_text(txt)
        res["profile_file"] = str(OUT / f"vs_llamacpp{a.tag}_profile.txt")
    res["loadavg_end"] = os.getloadavg()
    res["elapsed_s"] = time.time() - t_start
    stem = OUT / f"vs_llamacpp{a.tag}"
    err = plot(res, stem.with_name(stem.name + "_latency.png"))
    if err:
        res["plot_error"] = err
        print(f"plot skipped: {err}", file=sys.stderr)
    md = markdown(res)
    stem.with_suffix(".md").write_text(md + "\n")
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float))

    # ---- console
    print()
    print(md)
    print()
    for e, inv in res["inventory"].items():
        print(f"{e}: {inv['bytes_per_token'] / 2**20:.1f} MiB of weights read per token "
              f"(of {inv['total_bytes'] / 2**20:.0f} MiB); floor at "
              f"{res['bandwidth']['GBps']:.2f} GB/s: {res['bandwidth_floor_ms'][e]:.2f} ms/token")
    if "ratios_colibri_over_llamacpp" in res:
        print("ratios Colibri / llama.cpp:", json.dumps({k: round(v, 3) for k, v in
                                                          res["ratios_colibri_over_llamacpp"].items()}))
    if llama_err:
        print("llama.cpp not measured:", llama_err)
    print(f"load average: start {res['loadavg_start']}, end {res['loadavg_end']}")
    print(f"wrote {stem}.json, {stem}.md, {stem}_latency.png")


if __name__ == "__main__":
    main()
