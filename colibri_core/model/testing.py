"""Helpers for tests and benchmarks: random models written straight into Colibri's
format (no torch needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..format.quant import quantize_q4, quantize_q6, quantize_q8
from .weights import FFNWeights, write_model_dir


def write_random_model(out: Path, *, seed: int = 0, vocab: int = 256, hidden: int = 128,
                       layers: tuple[str, ...] = ("dense", "moe", "moe"), experts: int = 4,
                       top_k: int = 2, inter: int = 192, moe_inter: int = 128, shared: int = 96,
                       heads: int = 4, kv_heads: int = 2, context: int = 128,
                       group: int = 128, tokenizer: Path | None = None, head: str = "q8",
                       attn: str = "q4", out_bias: bool = False, **cfg_over) -> ModelConfig:
    """head: the lm_head's format ("q8" or "q6"); attn: the attention projections'
    ("q4" or "q6"). The random draws do not depend on either. out_bias: an output
    projection bias per layer; cfg_over attention_sinks=True: sinks per layer."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    quantizers = {"q4": quantize_q4, "q6": quantize_q6, "q8": quantize_q8}
    if head not in ("q6", "q8") or attn not in ("q4", "q6"):
        raise ValueError(f"head {head!r} / attn {attn!r}: expected q6|q8 / q4|q6")

    def mat(r, c, kind="q4"):
        return quantizers[kind](rng.standard_normal((r, c)) / np.sqrt(c), group)

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      moe_intermediate_size=moe_inter, num_layers=len(layers), num_heads=heads,
                      num_kv_heads=kv_heads, max_position_embeddings=context,
                      num_experts=experts if "moe" in layers else 0,
                      top_k=top_k if "moe" in layers else 0, layer_types=list(layers),
                      shared_expert_intermediate_size=shared if "moe" in layers else 0,
                      shared_expert_gate=bool(shared) and "moe" in layers,
                      eos_token_ids=[vocab - 1], **cfg_over)

    def main():
        yield "embed", quantize_q4(rng.standard_normal((vocab, hidden)), group)
        for L, kind in enumerate(layers):
            p = f"layer.{L}."
            yield p + "attn_norm", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
            yield p + "ffn_norm", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
            yield p + "wq", mat(heads * hd, hidden, attn)
            yield p + "wk", mat(kv_heads * hd, hidden, attn)
            yield p + "wv", mat(kv_heads * hd, hidden, attn)
            yield p + "wo", mat(hidden, heads * hd, attn)
            if out_bias:
                yield p + "bo", (0.1 * rng.standard_normal(hidden)).astype(np.float32)
            if cfg.attention_sinks:
                yield p + "sinks", rng.standard_normal(heads).astype(np.float32)
            if kind == "dense":
                yield p + "w1", mat(inter, hidden)
                yield p + "w3", mat(inter, hidden)
                yield p + "w2", mat(hidden, inter)
            elif shared:
                yield p + "shared_w1", mat(shared, hidden)
                yield p + "shared_w3", mat(shared, hidden)
                yield p + "shared_w2", mat(hidden, shared)
                yield p + "shared_gate", (rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
        yield "final_norm", np.ones(hidden, np.float32)
        yield "lm_head", quantizers[head](rng.standard_normal((vocab, hidden)) / np.sqrt(hidden), group)

    routing = [(f"layer.{L}.router", (rng.standard_normal((experts, hidden)) / np.sqrt(hidden) * 3)
                .astype(np.float32)) for L, k in enumerate(layers) if k == "moe"]
    exps = [(L, e, FFNWeights(mat(moe_inter, hidden), mat(moe_inter, hidden), mat(hidden, moe_inter)))
            for L, k in enumerate(layers) if k == "moe" for e in range(experts)]
    return write_model_dir(out, cfg, main(), routing, exps,
                           extra_files=[tokenizer] if tokenizer else [])
