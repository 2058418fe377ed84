"""Per tensor class precision by measured sensitivity, on the two trained models.

    python -m benchmarks.accuracy.precision_sensitivity [--builtin-hf build/builtin_hf]
        [--fraud-hf build/fraud/hf_model] [--seqs 8 --seq-len 512 --fraud-rows 1500]
        [--json benchmarks/out/precision_sensitivity.json]

The models: the built-in demo model's Hugging Face checkpoint (scripts/train_builtin.py;
checked: its default conversion must give the committed colibri_core/models/builtin
byte for byte) and the fraud example's (examples/fraud/train_base.py keeps it in
build/fraud/hf_model). Random-weight models are never used here: their weights have no
structure for a precision to lose.

Held-out data: the built-in model's validation documents (scripts/builtin_corpus.py's
content-hash split, never trained on), `--seqs` sequences of `--seq-len` tokens; the
fraud model's validation stream (examples/fraud/train_base.py's VALID, a seed it never
trained on), `--fraud-rows` transactions of 14 tokens.

The reference is the unquantized model: the checkpoint's float32 weights (`--bits 32`)
run with float activations and float routing. Every other row runs Colibri's default
engine (int8 activations, fixed-point routing) on a conversion in which ONE tensor class
is at the given precision and every other class is float32 -- the sensitivity of that
class alone -- then the mixes the converter offers. Per row: perplexity of the held-out
next tokens, mean KL(reference || row) per position (nats), top-1 agreement with the
reference, and the class's stored bits per weight (data, scales, zero points).

llama.cpp on the same models: `--llamacpp` (on when llama-cpp-python and gguf are
installed) writes each checkpoint as an F32 GGUF for llama.cpp's qwen2moe graph (its dense
first layer rewritten as an MoE layer that computes exactly the dense FFN:
_qwen2moe_gguf.py), quantizes it with llama.cpp's own quantizer (Q4_0, Q8_0: llama.cpp's
default type per tensor for that file type; the K-quants need rows of a multiple of 256
values and these models' hidden size is 128, so the quantizer falls back for them), and
scores the same held-out positions through llama-cpp-python with its default settings
(f16 KV cache). The F32 row checks the rewrite: its KL against the reference is the f16 KV
cache's alone. Bits per weight count the stored weights of the same tensors as Colibri's
(embedding, lm_head, attention, FFNs and experts; not norms, routers, biases), each at
its llama.cpp type's size. `--no-classes` skips the one-class-at-a-time sweep.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO as ROOT, fraud_module
from colibri_core.config import EngineConfig
from colibri_core.convert import (SIX_BIT_CLASSES, TENSOR_CLASSES, convert,
                                  tensor_classes)
from colibri_core.engine import Engine

LLAMA_CPP_BPW = {4: ("Q4_0 / Q4_K", 4.5), 6: ("Q6_K", 6.5625), 8: ("Q8_0", 8.5), 16: ("F16", 16.0)}
GGML_BPW = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5,
            "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q3_K": 3.4375,
            "Q2_K": 2.625}
LLAMACPP_ROWS = (("llama.cpp F32 (the rewrite's check)", "ALL_F32"),
                 ("llama.cpp Q4_0", "MOSTLY_Q4_0"), ("llama.cpp Q8_0", "MOSTLY_Q8_0"))
FLOAT = {c: 32 for c in TENSOR_CLASSES}
# The mixes the converter offers: its default (the first: choose() measures against it),
# format 1.0's default (lm_head q8) and the other q6 alternatives.
MIXES = {
    "default (--bits 4: lm_head q6; embed, K/V q8)": {},
    "--lm-head-bits 8 (format 1.0's default)": {"lm_head": 8},
    "default + --embed-bits 6": {"embed": 6},
    "default + --kv-bits 6": {"attn_kv": 6},
    "default + --tensor-bits attn_kv=6,attn_qo=6": {"attn_kv": 6, "attn_qo": 6},
    "all 4 (--tensor-bits lm_head=4,embed=4,attn_kv=4)": {"lm_head": 4, "embed": 4, "attn_kv": 4},
}


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def logits_of(model_dir: Path, seqs: list, **settings) -> np.ndarray:
    """Next-token logits at every position of every sequence, [N positions, V] float64."""
    with Engine(model_dir, EngineConfig(threads=2, **settings)) as eng:
        out = [eng.score_batch(seqs[i:i + 8], all_positions=True) for i in range(0, len(seqs), 8)]
    return np.concatenate([np.asarray(a, np.float64) for part in out for a in part])


def metrics(lp: np.ndarray, ref_lp: np.ndarray, targets: np.ndarray) -> dict:
    """lp, ref_lp: log-probabilities [N, V]; targets [N] (-1: no next token)."""
    keep = targets >= 0
    nll = -lp[keep, targets[keep]]
    p_ref = np.exp(ref_lp)
    kl = (p_ref * (ref_lp - lp)).sum(axis=1)
    return {"ppl": float(np.exp(nll.mean())), "kl": float(kl.mean()),
            "kl_p99": float(np.quantile(kl, 0.99)),
            "top1": float((lp.argmax(1) == ref_lp.argmax(1)).mean())}


def builtin_data(hf: Path, seqs: int, seq_len: int) -> list:
    from scripts.builtin_corpus import EOS, build_corpus, encode_stream, split_docs
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    _, val = split_docs(build_corpus())
    stream = encode_stream(tok, val, tok.token_to_id(EOS))
    if len(stream) < seqs * seq_len:
        raise SystemExit(f"only {len(stream)} held-out tokens for {seqs} x {seq_len}")
    return [stream[i * seq_len:(i + 1) * seq_len].astype(np.int64).tolist() for i in range(seqs)]


def fraud_data(rows: int) -> list:
    encode = fraud_module("fraud_common").encode
    generate = fraud_module("fraud_stream").generate
    VALID = fraud_module("train_base").VALID
    ids = encode(generate(VALID))
    rng = np.random.default_rng(0)
    return ids[np.sort(rng.choice(len(ids), min(rows, len(ids)), replace=False))].tolist()


def targets_of(seqs: list) -> np.ndarray:
    return np.concatenate([np.r_[np.asarray(s[1:], np.int64), -1] for s in seqs])


def check_builtin_source(hf: Path, tmp: Path) -> str:
    """The checkpoint the committed built-in model came from: its default conversion gives
    the committed model.bin byte for byte."""
    out = tmp / "builtin_check"
    cfg = convert(hf, out, bits=4, overwrite=True)
    committed = json.loads((ROOT / "colibri_core" / "models" / "builtin" / "config.json").read_text())
    same = cfg.files["model.bin"].sha256 == committed["files"]["model.bin"]["sha256"]
    shutil.rmtree(out)
    return "reproduces colibri_core/models/builtin" if same else \
        "WARNING: does not reproduce colibri_core/models/builtin (another checkpoint)"


def llamacpp_bits(hf: Path, types: dict, dense: list) -> float:
    """Bits per weight of the model's own matrices (not the rewrite's copies and padding) at
    the types llama.cpp's quantizer gave their GGUF tensors."""
    c = json.loads((hf / "config.json").read_text())
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    E, I, S, D = (c["num_experts"], c["moe_intermediate_size"],
                  c["shared_expert_intermediate_size"], c["intermediate_size"])
    hd = H // nh
    n = {"token_embd.weight": V * H, "output.weight": V * H}
    for i in range(L):
        n.update({f"blk.{i}.attn_q.weight": H * H, f"blk.{i}.attn_k.weight": H * nkv * hd,
                  f"blk.{i}.attn_v.weight": H * nkv * hd, f"blk.{i}.attn_output.weight": H * H})
        for m in ("gate", "up", "down"):
            if i in dense:
                n[f"blk.{i}.ffn_{m}_exps.weight"] = D * H
            else:
                n[f"blk.{i}.ffn_{m}_exps.weight"] = E * I * H
                n[f"blk.{i}.ffn_{m}_shexp.weight"] = S * H
    return sum(k * GGML_BPW[types[t]] for t, k in n.items()) / sum(n.values())


def llamacpp_rows(hf: Path, seqs: list, ref_lp: np.ndarray, targets: np.ndarray, tmp: Path,
                  log, ref_ppl: float) -> list:
    from benchmarks.peers._qwen2moe_gguf import llamacpp_logits, quantize, tensor_types, write_qwen2moe_gguf
    f32 = tmp / "llamacpp-f32.gguf"
    info = write_qwen2moe_gguf(hf, f32)
    log(f"  llama.cpp (qwen2moe GGUF; dense layers {info['dense_layers']} rewritten as MoE of "
        f"width {info['expert_width']}):")
    rows = []
    for label, ftype in LLAMACPP_ROWS:
        g = f32 if ftype == "ALL_F32" else quantize(f32, tmp / f"llamacpp-{ftype}.gguf", ftype)
        types = tensor_types(g)
        m = metrics(log_softmax(llamacpp_logits(g, seqs)), ref_lp, targets)
        m.update(label=label, bits=llamacpp_bits(hf, types, info["dense_layers"]), types={
            k: types[k] for k in ("token_embd.weight", "output.weight", "blk.1.attn_q.weight",
                                  "blk.1.attn_k.weight", "blk.1.attn_v.weight",
                                  "blk.1.ffn_down_exps.weight")})
        rows.append(m)
        log(f"  {label:<44} ppl {m['ppl']:8.4f} ({100 * (m['ppl'] / ref_ppl - 1):+6.2f}%)  "
            f"KL {m['kl']:.5f}  p99 {m['kl_p99']:.4f}  top1 {m['top1']:.4f}  "
            f"{m['bits']:5.2f} bits/w  {m['types']}")
        if g != f32:
            g.unlink()
    f32.unlink()
    return rows


def sweep(name: str, hf: Path, seqs: list, tmp: Path, log, classes: bool = True,
          llamacpp: bool = False) -> dict:
    t0 = time.time()
    targets = targets_of(seqs)
    ref_dir = tmp / f"{name}_f32"
    convert(hf, ref_dir, bits=32, overwrite=True)
    ref_lp = log_softmax(logits_of(ref_dir, seqs, activations="float", routing="float"))
    ref = metrics(ref_lp, ref_lp, targets)
    res = {"model": name, "positions": int((targets >= 0).sum()), "reference_ppl": ref["ppl"],
           "classes": [], "mixes": []}
    log(f"\n{name}: {res['positions']} held-out next tokens; unquantized (f32 weights, float "
        f"activations and routing) perplexity {ref['ppl']:.4f}")

    def run(label: str, bits: int, tb: dict, cls=None) -> dict:
        d = tmp / f"{name}_var"
        convert(hf, d, bits=bits, tensor_bits=tb, overwrite=True)
        m = metrics(log_softmax(logits_of(d, seqs)), ref_lp, targets)
        rows = {r["class"]: r for r in tensor_classes(d)}
        m["bits"] = rows[cls]["bits"] if cls else sum(r["bytes"] for r in rows.values()) * 8 / \
            sum(r["weights"] for r in rows.values())
        m["mib"] = sum(r["bytes"] for r in rows.values()) / 2**20
        m["label"] = label
        shutil.rmtree(d)
        log(f"  {label:<44} ppl {m['ppl']:8.4f} ({100 * (m['ppl'] / ref['ppl'] - 1):+6.2f}%)  "
            f"KL {m['kl']:.5f}  p99 {m['kl_p99']:.4f}  top1 {m['top1']:.4f}  "
            f"{m['bits']:5.2f} bits/w")
        return m

    # float weights multiply float activations in the default engine too (int8 activations
    # are for quantized matrices): only the fixed-point routing differs from the reference
    res["f32_default"] = run("f32 weights, default engine", 32, {})
    if classes:
        log("  one class at a time, the others f32:")
    for cls in TENSOR_CLASSES if classes else ():
        for b in ((4, 6, 8, 16) if cls in SIX_BIT_CLASSES else (4, 8, 16)):
            try:
                m = run(f"{cls} {b}-bit", 32, {**FLOAT, cls: b}, cls)
            except KeyError:           # a class this model does not have
                break
            m.update({"class": cls, "precision": b})
            res["classes"].append(m)
    log("  the converter's mixes (--bits 4):")
    for label, tb in MIXES.items():
        res["mixes"].append(run(label, 4, tb))
    if llamacpp:
        res["llamacpp"] = llamacpp_rows(hf, seqs, ref_lp, targets, tmp, log, ref["ppl"])
    log(f"  ({time.time() - t0:.0f} s)")
    return res


def choose(res: dict, share: float) -> dict:
    """Per class, the fewest bits whose KL (that class alone quantized) is at most `share`
    of the KL of the converter's default mix: a class whose error is a small part of the
    whole model's can take fewer bits without changing the model's fidelity."""
    budget = share * res["mixes"][0]["kl"]
    out = {}
    for m in sorted(res["classes"], key=lambda m: m["precision"]):
        if m["class"] not in out and m["kl"] <= budget:
            out[m["class"]] = m["precision"]
    for m in res["classes"]:
        out.setdefault(m["class"], 16)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builtin-hf", default=str(ROOT / "build" / "builtin_hf"))
    ap.add_argument("--fraud-hf", default=str(ROOT / "build" / "fraud" / "hf_model"))
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--fraud-rows", type=int, default=1500)
    ap.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=None,
                    help="also score llama.cpp's Q4_0 / Q8_0 of the same checkpoints (default: "
                         "when llama-cpp-python and gguf are installed)")
    ap.add_argument("--classes", action=argparse.BooleanOptionalAction, default=True,
                    help="the one-class-at-a-time sweep (--no-classes: the mixes only)")
    ap.add_argument("--models", default="builtin,fraud", help="which of builtin,fraud")
    ap.add_argument("--json", default=str(OUT / "precision_sensitivity.json"))
    a = ap.parse_args()
    log = lambda *x: print(*x, flush=True)   # noqa: E731
    if a.llamacpp is None:
        import importlib.util
        a.llamacpp = all(importlib.util.find_spec(m) for m in ("llama_cpp", "gguf"))
    out = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        models = {m.strip() for m in a.models.split(",") if m.strip()}
        if models - {"builtin", "fraud"}:
            raise SystemExit(f"--models: {a.models!r}; choose from builtin,fraud")
        if "builtin" in models:
            hf = Path(a.builtin_hf)
            log(f"built-in model checkpoint {hf}: {check_builtin_source(hf, tmp)}")
            out.append(sweep("builtin", hf, builtin_data(hf, a.seqs, a.seq_len), tmp, log,
                             a.classes, a.llamacpp))
        fh = Path(a.fraud_hf)
        if "fraud" not in models:
            pass
        elif (fh / "config.json").exists():
            out.append(sweep("fraud", fh, fraud_data(a.fraud_rows), tmp, log, a.classes,
                             a.llamacpp))
        else:
            log(f"\nfraud: {fh} not found (python examples/fraud/train_base.py writes it)")
    log("\nllama.cpp at the nearest bits per weight: " +
        ", ".join(f"{b}-bit ~ {n} {bpw}" for b, (n, bpw) in LLAMA_CPP_BPW.items()))
    for r in out if a.classes else ():
        r["choice_5pct"] = choose(r, 0.05)
        log(f"{r['model']}: fewest bits whose KL alone is <= 5% of the default mix's: "
            f"{r['choice_5pct']}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
