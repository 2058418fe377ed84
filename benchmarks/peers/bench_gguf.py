"""A GGUF converted by Colibri beside llama.cpp running the same file (issue 33).

    python -m benchmarks.peers.bench_gguf [--hidden 1024] [--layers 4] [--experts 8]
        [--inter 1024] [--vocab 8192] [--threads 2] [--tokens 32] [--rounds 3]
        [--types Q4_K_M,Q5_K_M,Q6_K,Q8_0]

1. A Mixtral-shaped random transformers model (seeded; widths multiples of 256 so every
   K-quant applies) is written as an F32 GGUF by llama.cpp's convert_hf_to_gguf.py and
   quantized by llama-quantize (tests/data/gguf/remake.py's helpers, the same tokenizer
   patch).
2. Fidelity: logits over two 64-token prompts of transformers (float32, the reference),
   of llama.cpp on each file (libllama), and of Colibri on the file converted with
   `colibri convert FILE OUT` defaults (per class, no more bits per weight than the
   GGUF's), on its default fast path (fixed-point routing, int8 activations) and on the
   float path. Error = median over positions of the position's relative RMS logit error
   (tests/test_convert_gguf.py's token_error), and the mean.
3. Decode speed: llama-bench `-p 0 -n N` on the file (tokens/s, its mean) and Colibri's
   engine generating N tokens greedily after an 8-token prompt (median per-token latency),
   alternated over --rounds rounds (median of the rounds; the load average is printed, as a
   busy machine slows llama.cpp's spinning threads more than Colibri's).
Prints a markdown table with the command, date, CPU, backend, read bandwidth and commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, best_read_bandwidth, git_commit, machine


def _remake():
    """tests/data/gguf/remake.py (llama.cpp's converter and quantizer, libllama), loaded
    from its file."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gguf_remake",
                                                  REPO / "tests" / "data" / "gguf" / "remake.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def token_errors(a: list, ref: list) -> np.ndarray:
    out = []
    for x, r in zip(a, ref):
        x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
        out.append(np.sqrt(((x - r) ** 2).mean(axis=1) / (r ** 2).mean()))
    return np.concatenate(out)


def colibri_logits(out: Path, prompts, routing: str, activations: str) -> list:
    from colibri_core.engine import Engine
    with Engine.from_model_dir(out, routing=routing, activations=activations) as eng:
        return [np.asarray(eng.next_token_logits(p, all_positions=True)) for p in prompts]


def colibri_decode(out: Path, threads: int, n: int) -> dict:
    from colibri_core.engine import Engine
    from colibri_core.runtime.sampler import SamplingParams
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    with Engine.from_model_dir(out, threads=threads) as eng:
        prompt = list(range(3, 11))
        list(eng.generate(prompt, max_new_tokens=4, sampling=greedy))
        ev = list(eng.generate(prompt, max_new_tokens=n, sampling=greedy))
    lat = np.array([e.latency_s for e in ev[1:]])
    return {"tok_s": 1.0 / float(np.median(lat)), "p90_ms": float(np.percentile(lat, 90) * 1e3)}


def llama_bench(bindir: Path, path: Path, threads: int, n: int) -> float:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bindir))
    r = subprocess.run([str(bindir / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(n),
                        "-t", str(threads), "-r", "3", "-o", "json"], capture_output=True,
                       text=True, env=env)
    if r.returncode:
        raise SystemExit(f"llama-bench failed: {r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    return float(rows[0]["avg_ts"])


def main(argv=None) -> int:
    from colibri_core.convert import convert, tensor_classes
    from tests import hf_helpers
    remake = _remake()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="keep the files here")
    a = ap.parse_args(argv)
    bindir, src = remake.DEFAULT_BIN, remake.DEFAULT_SRC / "vendor/llama.cpp"
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    _, tr = hf_helpers._imports()
    cfg = tr.MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                           num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                           num_key_value_heads=max(1, a.hidden // 256),
                           max_position_embeddings=512, num_local_experts=a.experts,
                           num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = hf_helpers.random_model(cfg, tr.MixtralForCausalLM, 0)
    hf_dir = work / "hf"
    if not (hf_dir / "config.json").exists():
        hf_helpers.save(model, hf_dir)
        remake.write_tokenizer(hf_dir)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, a.vocab, 64).tolist() for _ in range(2)]
    ref = [hf_helpers.hf_logits(model, p) for p in prompts]
    del model
    f32 = work / "model-F32.gguf"
    if not f32.exists():
        remake.run_convert(src, hf_dir, "f32", f32)
    lib = remake.LlamaLib(remake.DEFAULT_SRC, bindir)
    bw = best_read_bandwidth(a.threads)
    rows = []
    for kind in [k for k in a.types.split(",") if k]:
        path = work / f"model-{kind}.gguf"
        if not path.exists():
            remake.run_quantize(bindir, f32, path, kind)
        ll = token_errors([lib.logits(path, p) for p in prompts], ref)
        out = work / f"colibri-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        rep: list = []
        qcfg = convert(path, out, bits=None, report=rep)
        t_conv = time.perf_counter() - t0
        fast = token_errors(colibri_logits(out, prompts, "fixed", "int8"), ref)
        flt = token_errors(colibri_logits(out, prompts, "float", "float"), ref)
        cls = tensor_classes(out)
        w = sum(r["weights"] for r in cls)
        col_bits = sum(r["bytes"] for r in cls) * 8 / w
        g = qcfg.quantization["gguf"]["classes"]
        gw = sum(sum(c["types"].values()) for k, c in g.items() if k != "lm_head" or
                 "lm_head" in {r["class"] for r in cls})
        g_bits = sum(c["bits"] * sum(c["types"].values()) for k, c in g.items()
                     if k != "lm_head" or "lm_head" in {r["class"] for r in cls}) / gw
        lts, cts, load = [], [], [os.getloadavg()[0]]
        for _ in range(a.rounds):
            lts.append(llama_bench(bindir, path, a.threads, a.tokens))
            cts.append(colibri_decode(out, a.threads, a.tokens)["tok_s"])
            load.append(os.getloadavg()[0])
        lt, ct = float(np.median(lts)), {"tok_s": float(np.median(cts))}
        rows.append(dict(kind=kind, gguf_bits=g_bits, colibri_bits=col_bits,
                         llama_err=float(np.median(ll)), llama_mean=float(ll.mean()),
                         fast_err=float(np.median(fast)), fast_mean=float(fast.mean()),
                         float_err=float(np.median(flt)), float_mean=float(flt.mean()),
                         llama_tok_s=lt, colibri_tok_s=ct["tok_s"], convert_s=t_conv,
                         llama_rounds=lts, colibri_rounds=cts, load_avg=load, report=rep))
        print(json.dumps(rows[-1], indent=1), flush=True)
    cmd = "python -m benchmarks.peers.bench_gguf " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: `{cmd}`; date {datetime.date.today()}; CPU {machine()}; backend "
          f"llama.cpp CPU (llama-bench, libllama) vs Colibri C kernels, {a.threads} threads; "
          f"read bandwidth {bw['GBps']:.1f} GB/s ({bw['source']}); commit {git_commit()}; model "
          f"Mixtral-shaped random, hidden {a.hidden}, {a.layers} layers, {a.experts} experts "
          f"x {a.inter}, vocab {a.vocab}\n")
    print("| GGUF | GGUF bits/w | Colibri bits/w | llama.cpp error | Colibri error (fast) | "
          "Colibri error (float) | ratio (fast / llama.cpp) | llama.cpp tok/s | Colibri tok/s | "
          "load average |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['gguf_bits']:.2f} | {r['colibri_bits']:.2f} | "
              f"{r['llama_err']:.4f} | {r['fast_err']:.4f} | {r['float_err']:.4f} | "
              f"{r['fast_err'] / r['llama_err']:.2f} | {r['llama_tok_s']:.1f} | "
              f"{r['colibri_tok_s']:.1f} | {min(r['load_avg']):.1f}-{max(r['load_avg']):.1f} |")
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
