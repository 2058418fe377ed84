"""The lm_head at q6 against q8 on the benchmark model of bench_vs_llamacpp.py: bytes per
token, decode speed, the lm_head alone, logit error against the float model.

    python -m benchmarks.speed.bench_q6_head [--rounds 5] [--threads 2] [--tokens 128] [--prompt 64]
        [--hf benchmarks/out/vs_llamacpp/hf] [--q8 benchmarks/out/vs_llamacpp/colibri_q4]

The q8-head model is bench_vs_llamacpp.py's Colibri conversion (`convert(hf, bits=4)`,
built here the same way when missing); the q6-head model is the same conversion with
`lm_head_bits=6` (benchmarks/out/vs_llamacpp/colibri_q4_q6head, rebuilt when the
checkpoint or the converter's code change). Per round, each model decodes `--tokens`
tokens after a `--prompt`-token prompt in a fresh process, alternating; medians over
rounds of each round's per-token p50, and the ratio. The lm_head alone: the one-token
q8 / q6 product of 32000 x 1024 (kernels.q8_matmul / q6_matmul, int8 activations),
median of 200 calls after a warm-up, as GB/s of its stored bytes. Logit error: both
models' logits on 3 prompts of 64 tokens against transformers' float32 forward of the
checkpoint (relative RMS, max, KL, top-1, as bench_vs_llamacpp.py's fidelity step).
The model is random-weight (built for speed), so these errors say how far each format is
from the float product, not which precision a trained model needs
(benchmarks/accuracy/precision_sensitivity.py measures that).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, best_read_bandwidth, machine
from benchmarks.peers._vs_models import WORK, _convert_key, build_colibri, build_hf, colibri_inventory

CHILD = r'''
import json, sys, numpy as np
from colibri_core.engine import Engine
from colibri_core.config import EngineConfig
from colibri_core import kernels
e = Engine(sys.argv[1], EngineConfig(threads=int(sys.argv[2])))
n, plen = int(sys.argv[3]), int(sys.argv[4])
prompt = list(np.random.default_rng(0).integers(1, e.model_cfg.vocab_size - 1, plen))
e.generate(prompt[:8], max_new_tokens=4, temperature=0).run()
lat = [ev.latency_s for ev in e.generate(prompt, max_new_tokens=n + 1, temperature=0)][1:]
print(json.dumps({"p50_ms": float(np.median(lat)) * 1e3, "mean_ms": float(np.mean(lat)) * 1e3,
                  "backend": kernels.backend()}))
'''


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build_q6(hf: Path, path: Path) -> Path:
    marker = path.with_name(path.name + ".key.json")
    key = dict(_convert_key(hf), convert={"bits": 4, "lm_head_bits": 6})
    if (path / "config.json").exists() and marker.exists() and json.loads(marker.read_text()) == key:
        return path
    from colibri_core.convert import convert
    t0 = time.time()
    log(f"converting to Colibri q4 with a q6 lm_head in {path} ...")
    convert(hf, path, bits=4, lm_head_bits=6, overwrite=True)
    marker.write_text(json.dumps(key))
    log(f"  converted in {time.time() - t0:.0f} s")
    return path


def decode(model: Path, threads: int, tokens: int, prompt: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(threads), str(tokens),
                          str(prompt)], env=env, cwd="/", capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_q6_head: the run of {model} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def head_alone(models: dict, threads: int) -> dict:
    from colibri_core import kernels as K
    from colibri_core.model.weights import load_model
    K.set_threads(threads)       # the backend: COLIBRI_KERNELS's, as in the decode runs
    res = {}
    for name, path in models.items():
        w = load_model(path)
        t = w.lm_head
        mm = K.q6_matmul if type(t).__name__ == "Q6Tensor" else K.q8_matmul
        x = np.random.default_rng(1).standard_normal(t.cols).astype(np.float32)
        out = np.empty(t.rows, np.float32)
        for _ in range(20):
            mm(t, x, out)
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            mm(t, x, out)
            ts.append(time.perf_counter() - t0)
        nbytes = t.data.nbytes + t.scales.nbytes + getattr(t, "zeros", np.zeros(0)).nbytes
        med = statistics.median(ts)
        res[name] = {"ms": med * 1e3, "MiB": nbytes / 2**20, "GBps": nbytes / med / 1e9}
        w.close()
    return res


def fidelity(hf: Path, models: dict, n_prompts: int = 3, plen: int = 64) -> dict:
    import torch
    import transformers
    from benchmarks.peers.bench_vs_llamacpp import logit_errors
    from colibri_core.engine import Engine
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 31999, plen).tolist() for _ in range(n_prompts)]
    torch.set_num_threads(2)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        ref = np.concatenate([m(torch.tensor([p])).logits[0].float().numpy() for p in prompts])
    del m
    out = {}
    for name, path in models.items():
        with Engine.from_model_dir(path) as e:
            got = np.concatenate(e.score_batch(prompts, all_positions=True))
        out[name] = logit_errors(got, ref)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--hf", default=str(WORK / "hf"))
    ap.add_argument("--q8", default=str(WORK / "colibri_q4"))
    ap.add_argument("--q6", default=str(WORK / "colibri_q4_q6head"))
    ap.add_argument("--json", default=str(OUT / "bench_q6_head.json"))
    ap.add_argument("--no-fidelity", action="store_true",
                    help="skip the logit error (transformers' float forward: ~2 min)")
    a = ap.parse_args()
    hf = Path(a.hf)
    if not (hf / "config.json").exists():
        build_hf(hf)
    q8 = Path(a.q8)
    if not (q8 / "config.json").exists():
        build_colibri(hf, q8)
    models = {"q8 head": q8, "q6 head": build_q6(hf, Path(a.q6))}
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "bandwidth": best_read_bandwidth(a.threads), "models": {}}
    log(f"{res['machine']}; read bandwidth {res['bandwidth']['GBps']:.2f} GB/s "
        f"({res['bandwidth']['source']}, {a.threads} threads)")
    for name, path in models.items():
        inv = colibri_inventory(path)
        res["models"][name] = {"path": str(path), "bytes_per_token": inv["bytes_per_token"],
                               "lm_head_bytes": inv["roles"]["lm_head"]["bytes"],
                               "lm_head_bits": inv["roles"]["lm_head"]["bits_per_weight"],
                               "floor_ms": inv["bytes_per_token"] / res["bandwidth"]["GBps"] / 1e6,
                               "rounds": []}
    for r in range(a.rounds):
        for name in (models if r % 2 == 0 else reversed(list(models))):
            got = decode(models[name], a.threads, a.tokens, a.prompt)
            res["models"][name]["rounds"].append(got)
            res["backend"] = got["backend"]
            log(f"  round {r + 1} {name}: p50 {got['p50_ms']:.2f} ms, mean {got['mean_ms']:.2f} ms")
    for name, m in res["models"].items():
        m["p50_ms"] = statistics.median(x["p50_ms"] for x in m["rounds"])
        m["decode_tok_s"] = 1e3 / statistics.median(x["mean_ms"] for x in m["rounds"])
    res["head_alone"] = head_alone(models, a.threads)
    res["fidelity"] = None if a.no_fidelity else fidelity(hf, models)
    q8m, q6m = res["models"]["q8 head"], res["models"]["q6 head"]
    log(f"\nbackend {res['backend']}, {a.threads} threads, {a.rounds} rounds")
    for name, m in res["models"].items():
        h = res["head_alone"][name]
        f = res["fidelity"][name] if res["fidelity"] else None
        log(f"{name}: {m['bytes_per_token'] / 2**20:.1f} MiB/token (lm_head "
            f"{m['lm_head_bytes'] / 2**20:.1f} MiB, {m['lm_head_bits']:.2f} bits), floor "
            f"{m['floor_ms']:.2f} ms; p50 {m['p50_ms']:.2f} ms ({m['p50_ms'] / m['floor_ms']:.2f}x "
            f"floor), {m['decode_tok_s']:.1f} tokens/s; lm_head alone {h['ms']:.3f} ms "
            f"({h['GBps']:.1f} GB/s)" + (f"; logits vs float: rel RMS {f['rel_rms']:.4f}, KL "
                                         f"{f['kl_mean']:.5f}, top-1 {f['top1_agree']:.3f}"
                                         if f else ""))
    log(f"q6 / q8: bytes per token {q6m['bytes_per_token'] / q8m['bytes_per_token']:.3f}, "
        f"p50 {q6m['p50_ms'] / q8m['p50_ms']:.3f}, tokens/s "
        f"{q6m['decode_tok_s'] / q8m['decode_tok_s']:.3f}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
