"""Converter report: one row per family, built from tiny random-weight transformers models.

    python -m benchmarks.accuracy.convert_report [--families mixtral,deepseek_v3] [--medium-hidden 512]

Columns
- 32-bit err      max relative logit error (max|a-b|/max|ref|) of `--bits 32` vs transformers,
                  float routing and activations (3 prompts).
- INT4 vs deq     the same for `--bits 4` against transformers running Colibri's dequantized
                  weights (layout/kernel correctness, float path).
- INT4 loss       against the original float weights: max relative logit error, greedy
                  agreement (identical tokens before the first divergence, 3 prompts x 16),
                  perplexity change on a 96-token sequence.
- AWQ vs RTN      4-bit, activation outliers injected (norm channels and up/value rows x20),
                  calibrated on a text, measured on held-out text: KL(ref || quantized)
                  RTN -> AWQ, and the relative change.
- convert s / peak RSS   a `--bits 4` conversion of a larger ("medium") model of the family, run
                  in a child process: wall time and the child's peak RSS, next to the
                  checkpoint size and the baseline RSS of a child that only imports Colibri.

Accuracy columns use hidden 320 models (as the tests do); timing/RSS the medium ones.
Random-weight models have no redundancy, so their quantization loss is far larger than a
trained model's; the columns are for comparing settings, not for predicting real quality.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO as ROOT

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2"]
PROMPTS = [[5, 17, 42, 9, 88, 5, 61, 200, 3, 77, 120, 250, 1, 2, 99], [250, 1, 2], [7, 8]]


_HWM = ("import re; print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")


def _child_convert(hf: Path, out: Path) -> tuple[float, float, float]:
    """(seconds, peak RSS MiB of the converting child, baseline RSS MiB of an idle child).

    Peak RSS is the child's VmHWM (per address space, so not inflated by the fork from
    this torch-laden parent, which ru_maxrss would be)."""
    code = ("import sys, time; from colibri_core.convert import convert; t=time.perf_counter(); "
            "convert(sys.argv[1], sys.argv[2], bits=4); print(time.perf_counter()-t); " + _HWM)
    base = "import colibri_core.convert, numpy; print(0); " + _HWM
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def run(args):
        out = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True,
                             env=env, check=True).stdout.split()
        return float(out[0]), int(out[1]) / 1024
    secs, peak = run([code, str(hf), str(out)])
    _, baseline = run([base])
    return secs, peak, baseline


def family_row(fam: str, work: Path, medium_hidden: int) -> dict:
    import torch
    from tests.hf_helpers import (CALIBRATION_TEXT, HELD_OUT, inject_outliers, mean_kl,
                            hf_greedy, hf_logits, load_dequantized_into, make_hf_model,
                            perplexity, rel_err, save, write_tokenizer)
    from colibri_core.convert import convert
    from colibri_core.engine import Engine
    row = {"family": fam}
    d = work / fam
    m = make_hf_model(fam, seed=1, hidden_size=320)
    save(m, d / "hf")
    convert(d / "hf", d / "b32", bits=32)
    convert(d / "hf", d / "b4", bits=4)
    long_ids = np.random.default_rng(0).integers(0, 300, 96).tolist()
    with Engine.from_model_dir(d / "b32", routing="float", activations="float") as eng:
        row["err32"] = max(rel_err(eng.next_token_logits(p, all_positions=True), hf_logits(m, p))
                           for p in PROMPTS)
    ref = {tuple(p): hf_logits(m, p) for p in PROMPTS + [long_ids]}
    ref_greedy = [hf_greedy(m, p, 16) for p in PROMPTS]
    deq = load_dequantized_into(make_hf_model(fam, seed=1, hidden_size=320), d / "b4")
    with Engine.from_model_dir(d / "b4", routing="float", activations="float") as eng:
        ours = {tuple(p): eng.next_token_logits(p, all_positions=True) for p in PROMPTS + [long_ids]}
        row["err4_deq"] = max(rel_err(ours[tuple(p)], hf_logits(deq, p)) for p in PROMPTS)
        row["loss4_err"] = max(rel_err(ours[tuple(p)], ref[tuple(p)]) for p in PROMPTS)
        same = tot = 0
        for p, rg in zip(PROMPTS, ref_greedy):
            g = eng.generate(p, max_new_tokens=16, temperature=0).run().token_ids
            rg = rg[:len(g)]
            same += next((i for i, (a, b) in enumerate(zip(g, rg)) if a != b), len(g))
            tot += len(g)
        row["loss4_greedy"] = f"{same}/{tot}"
        row["loss4_ppl"] = perplexity(ours[tuple(long_ids)], long_ids) / perplexity(ref[tuple(long_ids)], long_ids) - 1
    # AWQ vs RTN on injected outliers
    from tokenizers import Tokenizer
    ma = inject_outliers(make_hf_model(fam, seed=2, hidden_size=320))
    save(ma, d / "awq_hf")
    write_tokenizer(d / "awq_hf")
    (d / "cal.txt").write_text(CALIBRATION_TEXT)
    ids = Tokenizer.from_file(str(d / "awq_hf" / "tokenizer.json")).encode(HELD_OUT).ids
    r = hf_logits(ma, ids)
    kls = {}
    for name, kw in (("rtn", {}), ("awq", {"calibration": d / "cal.txt"})):
        t0 = time.perf_counter()
        convert(d / "awq_hf", d / name, bits=4, **kw)
        if name == "awq":
            row["awq_s"] = time.perf_counter() - t0
        with Engine.from_model_dir(d / name, routing="float", activations="float") as eng:
            kls[name] = mean_kl(eng.next_token_logits(ids, all_positions=True), r)
    row["kl_rtn"], row["kl_awq"] = kls["rtn"], kls["awq"]
    # conversion time / peak RSS on a medium model
    over = dict(hidden_size=medium_hidden, num_hidden_layers=4, vocab_size=4000)
    if fam in ("deepseek_v3", "deepseek_v2"):
        over.update(n_routed_experts=16, moe_intermediate_size=384, intermediate_size=1024,
                    q_lora_rank=256, kv_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32,
                    v_head_dim=64, num_attention_heads=8, num_key_value_heads=8)
    elif fam == "mixtral":
        over.update(num_local_experts=16, intermediate_size=384, num_attention_heads=8, num_key_value_heads=4)
    else:
        over.update(num_experts=16, intermediate_size=1024 if fam != "olmoe" else 384,
                    num_attention_heads=8, num_key_value_heads=4)
        if fam != "olmoe":
            over.update(moe_intermediate_size=384)
        if fam == "qwen3_moe":
            over.update(head_dim=64)
    big = make_hf_model(fam, seed=0, **over)
    save(big, d / "big_hf", dtype=torch.bfloat16)
    del big
    ck = sum(f.stat().st_size for f in (d / "big_hf").glob("*.safetensors"))
    secs, peak, base = _child_convert(d / "big_hf", d / "big_out")
    row.update(conv_s=secs, peak_mib=peak, base_mib=base, ckpt_mib=ck / 2**20,
               out_mib=sum(f.stat().st_size for f in (d / "big_out").iterdir()) / 2**20)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--medium-hidden", type=int, default=512)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            print(f"... {fam}", file=sys.stderr, flush=True)
            rows.append(family_row(fam, Path(tmp), args.medium_hidden))
            shutil.rmtree(Path(tmp) / fam, ignore_errors=True)
    print("| family | 32-bit err | INT4 vs deq | INT4 loss: err / greedy / ppl | AWQ vs RTN (KL) "
          "| AWQ convert s | convert s (medium, bf16 ckpt) | peak RSS (baseline) | ckpt -> out |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['err32']:.1e} | {r['err4_deq']:.1e} | {r['loss4_err']:.3f} / "
              f"{r['loss4_greedy']} / {r['loss4_ppl'] * 100:+.2f}% | {r['kl_rtn']:.3f} -> "
              f"{r['kl_awq']:.3f} ({(r['kl_awq'] / r['kl_rtn'] - 1) * 100:+.0f}%) | "
              f"{r['awq_s']:.1f} | {r['conv_s']:.1f} | {r['peak_mib']:.0f} MiB ({r['base_mib']:.0f}) | "
              f"{r['ckpt_mib']:.0f} -> {r['out_mib']:.0f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
