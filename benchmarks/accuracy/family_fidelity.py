"""The issue-32 families at the default precision beside llama.cpp's 4-bit files.

    python -m benchmarks.accuracy.family_fidelity [--families granitemoe,...] [--seed 0]
        [--work DIR] [--json benchmarks/out/family_fidelity.json]

For each family (Granite MoE, Granite MoE shared, GLM-4.5, ERNIE-4.5-MoE, Llama 4 text,
gpt-oss, Phi-3.5-MoE) a tiny random transformers model is built (seeded; widths multiples of 32 so
that Q4_0 / MXFP4 apply to every matrix) and saved with the byte-level tokenizer of
tests/data/gguf/remake.py. Then:

1. the reference: transformers' float32 logits at every position of two 48-token prompts;
2. llama.cpp: its own `convert_hf_to_gguf.py` writes the F32 GGUF (remake.py's tokenizer
   patch only) and `llama-quantize` makes Q4_0 (gpt-oss: MXFP4_MOE, llama.cpp's type for
   it, and Q4_0); libllama's logits on the same ids (remake.LlamaLib). The F32 file's error
   is printed too: it checks that llama.cpp's graph runs the same model (a family whose
   F32 error is not ~1e-6 is compared on a different model, and the row says so);
3. Colibri: `colibri convert HF OUT` with its defaults, run on its default engine path
   (int8 activations, fixed-point routing).

Error = median over positions of the position's relative RMS logit error against
transformers (benchmarks/peers/bench_gguf.token_errors); ratio = Colibri / llama.cpp.

The tiny models differ from the parity tests' where llama.cpp hard-codes a value the
tests vary: Llama 4's attention chunk (8192 in llama.cpp) and temperature-tuning floor
(8192) stay at the published values, ERNIE's dense FFN width is the shared experts' width
x the KV heads (llama.cpp derives the shared width from it). Phi-3.5-MoE's config names
the published checkpoint's architecture (`PhiMoEForCausalLM`, the name llama.cpp's
converter registers), its LongRoPE has the published shape (original length 4096, max
131072, equal mscales) with the mscale llama.cpp computes, sqrt(1 + ln 32 / ln 4096) (the
published config says 1.243; llama.cpp's converter does not read it), the sliding window is
the published 131072 (llama.cpp's phimoe reads none: full attention) and the router's
jitter eps the published 0.01.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, git_commit, machine
from benchmarks.peers.bench_gguf import _remake, token_errors

FAMILIES = ("granitemoe", "granitemoeshared", "glm4_moe", "ernie4_5_moe", "llama4", "gpt_oss",
            "phimoe")
LLAMA_TYPES = {"gpt_oss": ("MXFP4_MOE", "Q4_0")}
VOCAB = 288
COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
# family -> make_more_model overrides (hf_helpers_more sets every feature on)
MORE = {"granitemoe": dict(intermediate_size=128),
        "granitemoeshared": dict(intermediate_size=128, shared_intermediate_size=192),
        "glm4_moe": dict(intermediate_size=320, moe_intermediate_size=96, head_dim=64),
        "ernie4_5_moe": dict(intermediate_size=192, moe_intermediate_size=96)}


def build(fam: str, seed: int, helpers):
    hf_helpers, hf_helpers_more = helpers
    torch, tr = hf_helpers._imports()
    if fam in MORE:
        return hf_helpers_more.make_more_model(fam, seed, **COMMON, **MORE[fam])
    if fam == "llama4":
        cfg = tr.Llama4TextConfig(**dict(COMMON, num_hidden_layers=4), intermediate_size=128,
                                  intermediate_size_mlp=320, head_dim=64, num_local_experts=8,
                                  num_experts_per_tok=1, interleave_moe_layer_step=2,
                                  attention_chunk_size=8192, max_position_embeddings=256,
                                  rms_norm_eps=1e-6, tie_word_embeddings=False)
        return hf_helpers.random_model(cfg, tr.Llama4ForCausalLM, seed)
    if fam == "gpt_oss":
        cfg = tr.GptOssConfig(**dict(COMMON, num_hidden_layers=4), intermediate_size=128,
                              num_local_experts=4, num_experts_per_tok=2, head_dim=64,
                              sliding_window=6, max_position_embeddings=128,
                              rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0,
                                               "truncate": False, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 32})
        model = hf_helpers.random_model(cfg, tr.GptOssForCausalLM, seed)
        with torch.no_grad():              # as tests/test_convert_gptoss.py: sinks, clamp, bias
            for lyr in model.model.layers:
                lyr.self_attn.sinks.normal_(0.0, 1.0)
                lyr.mlp.experts.gate_up_proj.mul_(4.0)
                lyr.mlp.router.bias.normal_(0.0, 0.5)
        return model
    if fam == "phimoe":
        head, orig, longest = 64, 4096, 131072
        rng = np.random.default_rng(seed + 7)
        mscale = float(np.sqrt(1 + np.log(longest / orig) / np.log(orig)))
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_mscale": mscale,
                "long_mscale": mscale, "original_max_position_embeddings": orig,
                "short_factor": [float(v) for v in 1.0 + rng.random(head // 2) * 3],
                "long_factor": [float(v) for v in 4.0 + rng.random(head // 2) * 8]}
        cfg = tr.PhimoeConfig(**COMMON, intermediate_size=128, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=longest,
                              attention_bias=True, lm_head_bias=True, sliding_window=longest,
                              router_jitter_noise=0.01, rope_parameters=rope)
        return hf_helpers.random_model(cfg, tr.PhimoeForCausalLM, seed)
    raise SystemExit(f"unknown family {fam!r}; expected one of {', '.join(FAMILIES)}")


def colibri_logits(out: Path, prompts) -> list:
    from colibri_core.engine import Engine
    with Engine.from_model_dir(out) as eng:
        return [np.asarray(eng.next_token_logits(p, all_positions=True)) for p in prompts]


def gguf_types(path: Path) -> tuple[str, float]:
    """The GGML types of the file's weight matrices (with counts) and their stored bits per
    weight: the tensors Colibri's bits per weight counts (embedding, lm_head, attention,
    FFNs, experts; not norms, biases, sinks, routers, LongRoPE's factors)."""
    import gguf
    got: dict = {}
    nbytes = nweights = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = t.name
        if (n.endswith((".bias", "norm.weight")) or "sinks" in n or "ffn_gate_inp" in n or
                n.startswith("rope_factors")):
            continue
        got[t.tensor_type.name] = got.get(t.tensor_type.name, 0) + 1
        nbytes, nweights = nbytes + int(t.n_bytes), nweights + int(t.n_elements)
    return " ".join(f"{k} x{v}" for k, v in sorted(got.items())), nbytes * 8 / nweights


def run_family(fam: str, a, remake, helpers, lib, work: Path) -> dict:
    from colibri_core.convert import convert, tensor_classes
    hf_helpers = helpers[0]
    src, bindir = remake.DEFAULT_SRC / "vendor/llama.cpp", remake.DEFAULT_BIN
    model = build(fam, a.seed, helpers)
    hf_dir = work / fam / "hf"
    shutil.rmtree(work / fam, ignore_errors=True)
    hf_helpers.save(model, hf_dir)
    remake.write_tokenizer(hf_dir)
    if fam == "phimoe":                  # the published checkpoint's name (llama.cpp's too)
        for name, key, value in (("config.json", "architectures", ["PhiMoEForCausalLM"]),
                                 # llama.cpp's Phi-3 vocab: sentencepiece unless GPT2Tokenizer
                                 ("tokenizer_config.json", "tokenizer_class", "GPT2Tokenizer")):
            cfg = json.loads((hf_dir / name).read_text())
            cfg[key] = value
            (hf_dir / name).write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(32)
    prompts = [rng.integers(0, VOCAB, 48).tolist() for _ in range(2)]
    ref = [hf_helpers.hf_logits(model, p) for p in prompts]
    del model
    row = {"family": fam}
    out = work / fam / "colibri"
    convert(hf_dir, out)
    cls = tensor_classes(out)
    row["colibri_bits"] = sum(r["bytes"] for r in cls) * 8 / sum(r["weights"] for r in cls)
    row["colibri"] = float(np.median(token_errors(colibri_logits(out, prompts), ref)))
    f32 = work / fam / "F32.gguf"
    try:
        remake.run_convert(src, hf_dir, "f32", f32)
    except SystemExit as e:
        row["llama_cpp"] = f"convert_hf_to_gguf.py fails: {str(e).strip().splitlines()[-1]}"
        return row
    row["llama_f32"] = float(np.median(token_errors([lib.logits(f32, p) for p in prompts], ref)))
    row["llama"] = {}
    for kind in LLAMA_TYPES.get(fam, ("Q4_0",)):
        path = work / fam / f"{kind}.gguf"
        remake.run_quantize(bindir, f32, path, kind)
        err = float(np.median(token_errors([lib.logits(path, p) for p in prompts], ref)))
        types, bits = gguf_types(path)
        row["llama"][kind] = {"error": err, "types": types, "bits": bits}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="keep the files here")
    ap.add_argument("--json", type=Path, default=OUT / "family_fidelity.json")
    a = ap.parse_args(argv)
    remake = _remake()
    helpers = remake._helpers()
    lib = remake.LlamaLib(remake.DEFAULT_SRC, remake.DEFAULT_BIN)
    work = a.work or Path(tempfile.mkdtemp(prefix="family-fidelity-"))
    rows = []
    for fam in [f for f in a.families.split(",") if f]:
        rows.append(run_family(fam, a, remake, helpers, lib, work))
        print(json.dumps(rows[-1]), flush=True)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    cmd = "python -m benchmarks.accuracy.family_fidelity " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"\ncommand: `{cmd}`; date {datetime.date.today()}; CPU {machine()}; backend "
          f"Colibri C kernels (default engine: int8 activations, fixed-point routing) vs "
          f"llama.cpp CPU (libllama); commit {git_commit()}; error = median over 96 positions "
          f"of the relative RMS logit error against transformers float32\n")
    print("| family | Colibri default bits/w | Colibri error | llama.cpp file (types) | bits/w | "
          "llama.cpp error | ratio Colibri / llama.cpp | llama.cpp F32 check |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['family']} | {r['colibri_bits']:.2f} | {r['colibri']:.4f} |"
        if "llama" not in r:
            print(f"{head} {r['llama_cpp']} | | | | |")
            continue
        for kind, v in r["llama"].items():
            print(f"{head} {kind} ({v['types']}) | {v['bits']:.2f} | {v['error']:.4f} | "
                  f"{r['colibri'] / v['error']:.2f} | {r['llama_f32']:.1e} |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"command": cmd, "commit": git_commit(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
