"""Shared pieces of the fraud example: paths, the model's shape, encoding, scoring, metrics.

Needs numpy and colibri only; torch / transformers are imported inside the functions that
train (train_base.py, train_new_expert.py), never by the demo's scoring path.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from fraud_stream import FRAUD, LABEL, SEQ_LEN, VOCAB, Txn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MODEL_DIR = HERE / "model"                        # the committed Colibri model (INT4)
SCORING_JSON = HERE / "scoring.json"              # threshold + training summary
EXPERT_NPZ = HERE / "new_expert" / "card_testing.npz"   # the trained new expert (float)
EXPERT_JSON = HERE / "new_expert" / "card_testing.json"
CONFIG = REPO / "configs" / "fraud.yaml"
BUILD = REPO / "build" / "fraud"

VOCAB_SIZE = 128                                  # vocabulary (106 tokens) padded

# The base model: Qwen2-MoE layout, layer 0 dense, layers 1-3 MoE (8 experts, top-2, a
# gated shared expert). Hidden 128 = one INT4 group per row.
HF_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], norm_topk_prob=False, max_position_embeddings=32,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    router_aux_loss_coef=0.01, bos_token_id=1, eos_token_id=None, pad_token_id=0,
)
NEW_EXPERT_LAYER = 3                              # the MoE layer that gets the new expert
PLOT_INSTALL = "pip install -e '.[plot]'"         # the plotting extra (matplotlib)


def encode(txns: Sequence[Txn]) -> np.ndarray:
    """[N, SEQ_LEN] int64 token ids (<bos>, fields, LABEL)."""
    return np.array([tx.token_ids() for tx in txns], dtype=np.int64).reshape(-1, SEQ_LEN)


def labels(txns: Sequence[Txn]) -> np.ndarray:
    return np.array([tx.is_fraud for tx in txns], dtype=bool)


def fraud_prob(logits: np.ndarray) -> np.ndarray:
    """P(FRAUD) from next-token logits at the LABEL position ([V] or [N, V]): full softmax."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e[..., FRAUD] / e.sum(axis=-1)


def load_scoring() -> dict:
    return json.loads(SCORING_JSON.read_text())


def expert_q4_clip() -> str:
    """The q4 rounding the committed expert was trained and validated with (recorded by
    train_new_expert.py in card_testing.json); the demo builds the .so with the same one."""
    return json.loads(EXPERT_JSON.read_text())["q4_clip"]


# ----------------------------------------------------------------------------- statistics
def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float, float]:
    """Proportion k/n with its Wilson score 95 % interval: (p, low, high); nan for n = 0."""
    if n <= 0:
        return float("nan"), float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return p, max(0.0, c - h), min(1.0, c + h)


def newcombe_diff(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float, float]:
    """p2 - p1 with Newcombe's hybrid score 95 % interval (from the two Wilson intervals)."""
    p1, l1, u1 = wilson(k1, n1)
    p2, l2, u2 = wilson(k2, n2)
    d = p2 - p1
    lo = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    hi = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return d, lo, hi


def fmt_ci(p: float, lo: float, hi: float, pct: bool = True) -> str:
    if math.isnan(p):
        return "n/a"
    if pct:
        return f"{100 * p:5.1f}% [{100 * lo:5.1f}, {100 * hi:5.1f}]"
    return f"{p:.3f} [{lo:.3f}, {hi:.3f}]"


def group_metrics(flag: np.ndarray, pattern: np.ndarray, group: Sequence[str]) -> dict:
    """Recall on `group`'s transactions and one-vs-legit precision: among the flagged
    transactions that are legit or of `group`, the share of `group` (other fraud patterns
    are left out, so each group's precision is not helped by the other's detections)."""
    flag = np.asarray(flag, bool)
    pattern = np.asarray(pattern)
    in_g = np.isin(pattern, list(group))
    legit = pattern == "legit"
    tp = int((flag & in_g).sum())
    n_pos = int(in_g.sum())
    fp = int((flag & legit).sum())
    return {"tp": tp, "positives": n_pos, "fp": fp, "legit": int(legit.sum()),
            "recall": wilson(tp, n_pos), "precision": wilson(tp, tp + fp),
            "fp_rate": wilson(fp, int(legit.sum()))}


def episode_bootstrap(flag: np.ndarray, pattern: np.ndarray, episode: np.ndarray,
                      group: Sequence[str], split: int, n_boot: int = 2000,
                      seed: int = 0) -> dict:
    """95 % percentile intervals of recall and precision (after - before, and each phase)
    when fraud transactions are resampled by episode: a fraud episode is a burst of
    correlated transactions on one card, so the transactions are not independent draws
    and Wilson intervals on them are too narrow. Legit transactions are resampled one by
    one (their flagged count as a binomial draw)."""
    rng = np.random.default_rng(seed)
    flag, pattern, episode = np.asarray(flag, bool), np.asarray(pattern), np.asarray(episode)
    in_g = np.isin(pattern, list(group))
    legit = pattern == "legit"
    phases = []
    for sl in (slice(0, split), slice(split, len(flag))):
        g, e, f = in_g[sl], episode[sl], flag[sl]
        eps, inv = np.unique(e[g], return_inverse=True)
        pos = np.bincount(inv, minlength=len(eps)).astype(float)        # txns per episode
        hit = np.bincount(inv, weights=f[g].astype(float), minlength=len(eps))
        n_legit, fp = int(legit[sl].sum()), int((f & legit[sl]).sum())
        rec, prec = np.full(n_boot, np.nan), np.full(n_boot, np.nan)
        if len(eps):
            idx = rng.integers(0, len(eps), (n_boot, len(eps)))
            tp_b, pos_b = hit[idx].sum(1), pos[idx].sum(1)
            fp_b = rng.binomial(n_legit, fp / max(n_legit, 1), n_boot)
            rec = tp_b / pos_b
            with np.errstate(invalid="ignore", divide="ignore"):
                prec = tp_b / (tp_b + fp_b)
        phases.append({"episodes": int(len(eps)), "recall": rec, "precision": prec})

    def ci(x):
        x = x[np.isfinite(x)]
        if not len(x):
            return (float("nan"), float("nan"))
        return (float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5)))
    out = {"episodes": [phases[0]["episodes"], phases[1]["episodes"]]}
    for m in ("recall", "precision"):
        out[m] = [ci(phases[0][m]), ci(phases[1][m])]
        out[f"{m}_change"] = ci(phases[1][m] - phases[0][m])
    return out


def best_f1_threshold(p: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Threshold maximising F1 of (p >= t) vs y; returns (threshold, f1)."""
    order = np.argsort(-p)
    ps, ys = p[order], y[order].astype(np.int64)
    tp = np.cumsum(ys)
    fp = np.cumsum(1 - ys)
    f1 = 2 * tp / (tp + fp + ys.sum())
    i = int(np.argmax(f1))
    t = float(ps[i]) if i + 1 >= len(ps) else float(0.5 * (ps[i] + ps[i + 1]))
    return t, float(f1[i])


def roc_auc(p: np.ndarray, y: np.ndarray) -> float:
    y = np.asarray(y, bool)
    r = np.argsort(np.argsort(p, kind="stable"), kind="stable") + 1.0
    n1, n0 = y.sum(), (~y).sum()
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / max(n1 * n0, 1))


# ----------------------------------------------------------------------------- torch side
def dequantized_hf_model(model_dir: Path = MODEL_DIR):
    """A transformers Qwen2MoeForCausalLM holding the Colibri model's dequantized weights
    (so the new expert is trained against exactly the weights it will run beside)."""
    import torch
    import transformers
    from colibri_core.model.ops import float_matrix as deq     # any stored format, as float32
    from colibri_core.model.weights import load_model

    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**HF_CONFIG)).eval()
    sd = model.state_dict()

    def put(name, arr):
        sd[name].copy_(torch.from_numpy(np.array(arr, np.float32).reshape(sd[name].shape)))

    w = load_model(model_dir)
    try:
        put("model.embed_tokens.weight", deq(w.embed))
        put("lm_head.weight", deq(w.lm_head))
        put("model.norm.weight", w.final_norm)
        for lw in w.layers:
            q = f"model.layers.{lw.index}."
            put(q + "input_layernorm.weight", lw.attn_norm)
            put(q + "post_attention_layernorm.weight", lw.ffn_norm)
            for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
                put(q + f"self_attn.{n}.weight", deq(getattr(lw.attn, s)))
            for s, n in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                if getattr(lw.attn, s) is not None and q + f"self_attn.{n}.bias" in sd:
                    put(q + f"self_attn.{n}.bias", getattr(lw.attn, s))
            if lw.kind == "dense":
                for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    put(q + f"mlp.{n}.weight", deq(getattr(lw.dense, s)))
                continue
            put(q + "mlp.gate.weight", lw.router)
            gu, dn = sd[q + "mlp.experts.gate_up_proj"], sd[q + "mlp.experts.down_proj"]
            for ex in lw.experts:
                g = np.concatenate([deq(ex.ffn.w1), deq(ex.ffn.w3)], axis=0)
                gu[ex.index].copy_(torch.from_numpy(g.astype(np.float32)))
                dn[ex.index].copy_(torch.from_numpy(deq(ex.ffn.w2).astype(np.float32)))
            for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                put(q + f"mlp.shared_expert.{n}.weight", deq(getattr(lw.shared, s)))
            put(q + "mlp.shared_expert_gate.weight", lw.shared_gate)
    finally:
        w.close()
    return model


def torch_fraud_prob(model, ids: np.ndarray, batch: int = 2048) -> np.ndarray:
    """P(FRAUD) at the LABEL position for [N, SEQ_LEN] ids with a transformers model."""
    import torch
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.from_numpy(ids[i:i + batch])
            logits = model(input_ids=x).logits[:, -1, :].double()
            out.append(torch.softmax(logits, -1)[:, FRAUD].numpy())
    return np.concatenate(out) if out else np.zeros(0)


assert VOCAB.index("LABEL") == LABEL and len(VOCAB) <= VOCAB_SIZE


def serve(args: Sequence[str], timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """`colibri serve --config CONFIG --port 0 ARGS` started here: (the process, its URL),
    read from its 'serving http://...' line; the process is killed if that never comes."""
    proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--config",
                             str(CONFIG), "--port", "0", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found, url = threading.Event(), {}

    def read():
        for line in proc.stdout:
            m = re.search(r"serving (http://\S+)", line)
            if m:
                url["url"] = m.group(1)
                found.set()
        found.set()
    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout) or "url" not in url:
        proc.kill()
        raise SystemExit("colibri serve did not start")
    return proc, url["url"]
