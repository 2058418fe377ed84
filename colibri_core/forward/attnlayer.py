"""One layer's grouped-query attention block as the C step runs it (ck.h, ck_attn_layer):
its matrices, norms, rope, and what the layer attends to -- the whole context, a sliding
window (gpt-oss) or its chunk (Llama 4) --, its attention sinks and output bias (gpt-oss),
and whether it has rope (Llama 4's NoPE layers and their temperature tuning).

The per-layer values come from ModelConfig (attention_span, nope_layers, ...), as in
reference.py's numpy attention."""
from __future__ import annotations

import numpy as np

from ..model import ops
from .steptables import set_mat

_QK_NORM = {"none": 0, "per_head": 1, "full": 2, "l2": 3}


def gqa_layer(keep, cfg, lw, eps: float, p_inv, factor: float):
    """The ck_attn_layer of layer `lw` (its arrays kept alive by `keep`)."""
    a = lw.attn
    al = keep.new("ck_attn_layer *")
    for n in ("wq", "wk", "wv", "wo"):
        set_mat(keep, getattr(al, n), getattr(a, n), a.act_scales.get(n), f"layer {lw.index} {n}")
    al.bq, al.bk, al.bv, al.bo = keep.f32(a.bq), keep.f32(a.bk), keep.f32(a.bv), keep.f32(a.bo)
    nope = lw.index in cfg.nope_layers
    # Llama 4's L2 norm is on its rope layers only
    al.qk_norm = 0 if cfg.qk_norm == "l2" and nope else _QK_NORM[cfg.qk_norm]
    al.q_norm, al.k_norm = keep.f32(a.q_norm), keep.f32(a.k_norm)
    al.norm, al.ffn_norm = keep.f32(lw.attn_norm), keep.f32(lw.ffn_norm)
    al.norm_b, al.ffn_norm_b = keep.f32(lw.attn_norm_bias), keep.f32(lw.ffn_norm_bias)  # LayerNorm
    al.hidden, al.nh, al.nkv, al.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    al.eps, al.scale = eps, float(cfg.attention_multiplier or 1.0 / np.sqrt(cfg.head_size))
    al.rot, al.out_scale = ops.rope_dim(cfg), cfg.residual_multiplier
    al.inv_freq, al.rope_factor = p_inv, float(factor)
    al.window, al.chunk = cfg.attention_span(lw.index)
    al.sinks = keep.f32(a.sinks)
    al.no_rope = int(nope)
    al.temp_floor, al.temp_scale = float(cfg.attn_temperature_floor), float(cfg.attn_temperature_scale)
    return al
