"""Train the base fraud model (old patterns only) with PyTorch, convert it to Colibri.

    python examples/fraud/train_base.py                # 800 steps: ~6-10 min on 2 cores
    python examples/fraud/train_base.py --steps 200    # quicker, weaker

Steps: generate a training stream (old fraud patterns oversampled to ~8 % so the model sees
enough of them; card testing absent) and a validation stream at a realistic base rate
(1 % old fraud); train a transformers Qwen2MoeForCausalLM (layer 0 dense, layers 1-3 MoE,
8 experts top-2) as a language model of transactions (next-field loss) plus the label
loss at the LABEL position. The next-field loss matters for what comes later: a model
trained on the label alone keeps only what separates the old patterns, and a new expert
then has too little to work with (a probe on layer 3's input separates card testing from
legit traffic with F1 0.71 after label-only training, 0.85 with the next-field loss);
convert it with `colibri_core.convert.convert` into examples/fraud/model/ (INT4, the
converter's defaults: the committed model predates format 1.1 and has its lm_head at 8
bits, a rerun gets q6); choose the decision threshold (best F1 on the validation stream, with the
converted weights; checked against Colibri itself on a subsample) and write it with the
training summary to examples/fraud/scoring.json.

Needs the `convert` extra (torch, transformers). The HF checkpoint is kept in
build/fraud/hf_model/ (not committed). Deterministic for a seed up to torch's CPU kernels.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import (BUILD, HF_CONFIG, MODEL_DIR, SCORING_JSON,  # noqa: E402
                          best_f1_threshold, dequantized_hf_model, encode, fraud_prob,
                          labels, roc_auc, torch_fraud_prob)
from fraud_stream import (FRAUD, OK, SEQ_LEN, StreamConfig, generate, summary,  # noqa: E402
                          write_tokenizer)

TRAIN = StreamConfig(n_cards=5000, days=14, old_fraud_rate=0.08, new_fraud_rate=0.0, seed=101)
VALID = StreamConfig(n_cards=1500, days=14, old_fraud_rate=0.01, new_fraud_rate=0.0, seed=202)


def train(ids: np.ndarray, y: np.ndarray, steps: int, seed: int, batch: int = 256,
          lr: float = 3e-3, log_every: int = 100, lm_weight: float = 1.0):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**HF_CONFIG))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    X = torch.from_numpy(ids)
    target = torch.from_numpy(np.where(y, FRAUD, OK)).long()
    rng = np.random.default_rng(seed)
    t0 = time.time()
    losses = []
    for step in range(steps):                       # warm-up, then cosine decay
        el = time.time() - t0
        frac = step / steps
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 100) * (0.05 + 0.475 * (1 + math.cos(math.pi * frac)))
        idx = torch.from_numpy(rng.integers(0, len(X), batch))
        x = X[idx]
        out = model(input_ids=x, output_router_logits=True,
                    logits_to_keep=0 if lm_weight > 0 else 1)
        loss = torch.nn.functional.cross_entropy(out.logits[:, -1, :], target[idx])
        if lm_weight > 0:        # language-model loss on the fields: a model of transactions
            lm = torch.nn.functional.cross_entropy(
                out.logits[:, :-2, :].reshape(-1, out.logits.shape[-1]), x[:, 1:-1].reshape(-1))
            loss = loss + lm_weight * lm
        if out.aux_loss is not None:
            loss = loss + HF_CONFIG["router_aux_loss_coef"] * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0:
            print(f"  step {step + 1:5d}  {el:5.0f}s  loss {np.mean(losses[-log_every:]):.4f}",
                  flush=True)
    model.eval()
    return model, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800, help="training steps (batches of 256)")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lm-weight", type=float, default=1.0,
                    help="weight of the next-field language-model loss (0: label only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is fastest on a busy 2-core machine)")
    ap.add_argument("--out", default=str(MODEL_DIR))
    ap.add_argument("--scoring", default=str(SCORING_JSON), help="where to write the threshold")
    a = ap.parse_args()

    import torch
    torch.set_num_threads(a.threads)
    t0 = time.time()
    tr, va = generate(TRAIN), generate(VALID)
    print(f"train stream: {summary(tr)['transactions']} txns, fraud {summary(tr)['fraud_rate']:.2%}"
          f"; valid: {len(va)} txns, fraud {summary(va)['fraud_rate']:.2%}"
          f" ({time.time() - t0:.0f}s)", flush=True)
    Xtr, ytr = encode(tr), labels(tr)
    Xva, yva = encode(va), labels(va)

    model, steps = train(Xtr, ytr, a.steps, a.seed, lm_weight=a.lm_weight)
    auc_t = roc_auc(torch_fraud_prob(model, Xva), yva)
    print(f"torch: {steps} steps; valid AUC {auc_t:.4f} (float weights)", flush=True)

    out = Path(a.out)
    hf_dir = BUILD / "hf_model" if out.resolve() == MODEL_DIR else out.parent / f"{out.name}_hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    write_tokenizer(hf_dir / "tokenizer.json")
    from colibri_core.convert import convert
    convert(hf_dir, a.out, bits=a.bits, overwrite=True)
    print(f"converted to {a.out} ({a.bits}-bit): "
          f"{sum(f.stat().st_size for f in Path(a.out).iterdir()) / 1e6:.2f} MB", flush=True)

    # The threshold is chosen on the weights that ship: the converted model, dequantized
    # back into torch (fast on the whole validation stream) ...
    p = torch_fraud_prob(dequantized_hf_model(Path(a.out)), Xva)
    auc_q = roc_auc(p, yva)
    thr, f1 = best_f1_threshold(p, yva)
    # ... and checked against Colibri itself on a subsample (all fraud + 3000 legit).
    rng = np.random.default_rng(0)
    sub = np.sort(np.concatenate([np.flatnonzero(yva), rng.choice(np.flatnonzero(~yva), 3000,
                                                                   replace=False)]))
    from colibri_core.engine import Engine
    with Engine.from_model_dir(a.out) as eng:
        Xs = Xva[sub]
        p_c = np.concatenate([
            fraud_prob(np.stack(eng.score_batch([list(r) for r in Xs[i:i + 512]])))
            for i in range(0, len(Xs), 512)])
    diff = float(np.abs(p_c - p[sub]).max())
    flips = int(((p_c >= thr) != (p[sub] >= thr)).sum())
    flag = p >= thr
    tp, fp = int((flag & yva).sum()), int((flag & ~yva).sum())
    info = {
        "threshold": thr,
        "label_tokens": {"ok": OK, "fraud": FRAUD},
        "seq_len": SEQ_LEN,
        "valid": {"auc_float": auc_t, "auc_quantized": auc_q, "f1": f1,
                  "recall": tp / max(int(yva.sum()), 1), "precision": tp / max(tp + fp, 1),
                  "colibri_check": {"n": int(len(sub)), "max_abs_prob_diff": diff,
                                    "decision_flips": flips},
                  "stream": VALID.__dict__, "counts": summary(va)},
        "train": {"steps": steps, "seed": a.seed, "bits": a.bits,
                  "lm_weight": a.lm_weight,
                  "stream": TRAIN.__dict__, "hf_config": HF_CONFIG},
    }
    Path(a.scoring).write_text(json.dumps(info, indent=1, default=str) + "\n")
    print(f"{a.bits}-bit: valid AUC {auc_q:.4f}, threshold {thr:.4f} (best F1 {f1:.3f}: "
          f"recall {info['valid']['recall']:.3f}, precision {info['valid']['precision']:.3f});"
          f" Colibri vs dequantized torch on {len(sub)}: max |dp| {diff:.4f}, {flips} flips")
    print(f"wrote {a.scoring} ({time.time() - t0:.0f}s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
