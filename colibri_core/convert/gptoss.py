"""gpt-oss (`GptOssForCausalLM`, issue 32): its config fields and its experts.

Attention: q/k/v and output biases, a learned sink logit per head, sliding-window layers
(`layer_types` "sliding_attention": the last `sliding_window` positions) between full ones,
YaRN rope (families._rope) -- config fields of the one pipeline (attention_window,
attention_sinks; sections bq/bk/bv/bo/sinks). The MoE block (transformers'
GptOssTopKRouter / GptOssExperts): router logits with a bias, top-k, softmax over the k
chosen logits (= Colibri's softmax with norm_topk_prob); each expert's fused gate_up
projection with interleaved rows (gate = even, up = odd), biases on gate/up and down, and
the clamped SwiGLU (ffn_act "swiglu_clamped", swiglu_limit, swiglu_alpha).

Experts come in two layouts. A released checkpoint holds them as MXFP4
(`experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16], `_scales` [E, 2I, H/32],
`down_proj_blocks` [E, H, I/32, 16], `_scales`): at the default precision (experts at 4
bits) they are kept byte for byte (format/mxfp4.py), other precisions dequantize them
first. A model built by transformers holds floats, `experts.gate_up_proj` [E, H, 2I] and
`down_proj` [E, I, H] (x @ W): at 4 bits they are quantized to MXFP4, at 8 to q8, at 16
to bf16, at 32 kept in f32. A GGUF (llama.cpp's `gpt-oss`) holds gate, up and down apart
(`ffn_gate_exps` ...), MXFP4 or another type: MXFP4 blocks are kept at 4 bits (lossless
nibble reorder), anything else is dequantized. Biases stay f32.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from ..format.mxfp4 import (MX_BLOCK, MXFP4Tensor, dequantize_mxfp4, from_blocks,
                            from_gguf_blocks, quantize_mxfp4)
from ..format.quant import quantize_q8
from ..model.weights import FFNWeights
from .safetensors_reader import f32_to_bf16

FAMILY = "gpt_oss"
ARCHITECTURES = {"GptOssForCausalLM": FAMILY}
DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, layer_types=None,
    attention_bias=True, bos_token_id=None, eos_token_id=None, rope_theta=150000.0,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096})
_LAYER_TYPES = ("sliding_attention", "full_attention")


def fields(c, d: dict, refuse: Callable) -> None:
    """Fill ModelConfig fields `d` (the common ones set) from HFConfig `c`."""
    n, H, nh = d["num_layers"], d["hidden_size"], d["num_heads"]
    types = c("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(n)]
    if len(types) != n or set(types) - set(_LAYER_TYPES):
        refuse(f"layer_types {types!r:.80}", f"one of {', '.join(_LAYER_TYPES)} per layer "
               f"({n})")
    W = c("sliding_window")
    if "sliding_attention" in types and not W:
        refuse(f"sliding_window={W!r} with sliding_attention layers")
    E, I = c.int("num_local_experts"), c.int("intermediate_size")
    if H % MX_BLOCK or I % MX_BLOCK:
        refuse(f"hidden_size={H} / intermediate_size={I}", f"multiples of {MX_BLOCK} (the "
               f"experts' MXFP4 blocks)")
    d.update(head_dim=int(c("head_dim", None) or H // nh), attention_bias=bool(c("attention_bias")),
             layer_types=["moe"] * n, num_experts=E, top_k=c.int("num_experts_per_tok"),
             intermediate_size=I, moe_intermediate_size=I, norm_topk_prob=True,
             ffn_act="swiglu_clamped", swiglu_limit=float(c("swiglu_limit")),
             swiglu_alpha=float(c("swiglu_alpha")), attention_sinks=True,
             attention_window=[int(W) if t == "sliding_attention" else 0 for t in types])


def quantization_ok(q) -> bool:
    """A released gpt-oss checkpoint's quantization_config (its MXFP4 experts)."""
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def _prefix(L: int) -> str:
    return f"model.layers.{L}.mlp."


def router_logit_bias(ck, L: int):
    name = _prefix(L) + "router.bias"
    return np.ascontiguousarray(ck.get(name), np.float32) if name in ck else None


def _mx(ck, name: str, e: int):
    return from_blocks(ck.raw(name + "_blocks", e), ck.raw(name + "_scales", e))


def expert_ffn(ck, L: int, e: int, bits: int, group: int) -> FFNWeights:
    """Expert e of layer L: gate, up [I, H] and down [H, I] stored at `bits` (4: MXFP4),
    with its three biases."""
    p = _prefix(L) + "experts."
    if f"{p}{e}.gate_proj.weight" in ck:                         # a GGUF (gguf_reader)
        return _gguf_expert(ck, f"{p}{e}.", bits, group)
    gub = np.asarray(ck.get(p + "gate_up_proj_bias", e), np.float32)
    biases = {"w1": np.ascontiguousarray(gub[0::2]), "w3": np.ascontiguousarray(gub[1::2]),
              "w2": np.ascontiguousarray(ck.get(p + "down_proj_bias", e), np.float32)}
    if p + "gate_up_proj_blocks" in ck:                          # MXFP4 checkpoint
        gu, down = _mx(ck, p + "gate_up_proj", e), _mx(ck, p + "down_proj", e)
        gate, up = (MXFP4Tensor(np.ascontiguousarray(gu.data[k::2]),
                                np.ascontiguousarray(gu.exps[k::2]), gu.rows // 2, gu.cols)
                    for k in (0, 1))                             # interleaved rows
        if bits == 4:                                            # the checkpoint's bytes
            return FFNWeights(gate, up, down, biases=biases)
        mats = [dequantize_mxfp4(m) for m in (gate, up, down)]
    elif p + "gate_up_proj" in ck:                               # floats: x @ W layout
        gu = ck.get(p + "gate_up_proj", e)                       # [H, 2I]
        mats = [gu[:, 0::2].T, gu[:, 1::2].T, ck.get(p + "down_proj", e).T]
    else:
        raise ConfigError(f"checkpoint: no experts for layer {L} ({p}gate_up_proj or "
                          f"{p}gate_up_proj_blocks)")
    return FFNWeights(*(_store(np.ascontiguousarray(m), bits, group) for m in mats),
                      biases=biases)


def _gguf_expert(ck, p: str, bits: int, group: int) -> FFNWeights:
    """llama.cpp's gpt-oss layout: gate / up [I, H] and down [H, I] apart, each with a bias;
    an MXFP4 matrix at 4 bits keeps its blocks (the codes and exponents unchanged), any other
    type or precision is dequantized and stored at `bits`."""
    mats, biases = [], {}
    for m, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        w = p + name + ".weight"
        biases[m] = np.ascontiguousarray(ck.get(p + name + ".bias"), np.float32)
        if bits == 4 and ck.dtype(w) == "MXFP4":
            mats.append(from_gguf_blocks(ck.raw(w), *ck.shape(w)))
        else:
            mats.append(_store(np.ascontiguousarray(ck.get(w)), bits, group))
    return FFNWeights(*mats, biases=biases)


def _store(w: np.ndarray, bits: int, group: int):
    if bits == 4:
        return quantize_mxfp4(w)
    if bits == 8:
        return quantize_q8(w, group)
    if bits == 16:
        return f32_to_bf16(np.asarray(w, np.float32))
    return np.ascontiguousarray(w, np.float32)
