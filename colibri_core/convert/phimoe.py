"""Phi-3.5-MoE (`PhimoeForCausalLM`, issue 32): its config fields, as transformers 5's
modeling_phimoe.py runs the model in eval mode.

What it needs beyond the other families, each a general config field of the one pipeline:
LayerNorms with weight and bias for the two layer norms and the final one (`norm_type:
layer`, sections `layer.L.attn_norm_bias`, `layer.L.ffn_norm_bias`, `final_norm_bias`); an
lm_head bias (section `lm_head_bias`, when `lm_head_bias` is true); the sparse-mixer routing
(`scoring_func: sparsemixer`, `router_jitter_eps` = `router_jitter_noise`: routing.sparsemixer);
LongRoPE (`rope_scaling.type: longrope`, ops.rope_frequencies). q/k/v biases are
`attention_bias`, the output projection's bias section `layer.L.bo` (both as for gpt-oss);
`sliding_window` is `attention_window` on every layer.

LongRoPE as transformers 5 runs PhiMoE: its rotary forward computes the frequencies from
`short_factor` at every length (it never passes the length that would select
`long_factor`), and multiplies cos/sin by `long_mscale` when the forward call's largest
position + 1 exceeds `original_max_position_embeddings`, else by `short_mscale`. That scale
depends on how the tokens are split into calls, not on the model, so Colibri runs the one
scale of a checkpoint whose two are equal (the published Phi-3.5-MoE's) and refuses others.
"""
from __future__ import annotations

from typing import Any, Callable

FAMILY = "phimoe"
# transformers' class, and the published checkpoint's config.json name (its remote code)
ARCHITECTURES = {"PhimoeForCausalLM": FAMILY, "PhiMoEForCausalLM": FAMILY}
DEFAULTS: dict[str, Any] = dict(
    vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=None,
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, sliding_window=None, num_experts_per_tok=2,
    num_local_experts=16, router_jitter_noise=0.01, input_jitter_noise=0.0,
    attention_bias=False, lm_head_bias=False)


def longrope(c, params: dict, refuse: Callable) -> dict:
    """The RopeScaling fields of a longrope `params` (rope_parameters / rope_scaling)."""
    need = ("short_factor", "long_factor", "short_mscale", "long_mscale",
            "original_max_position_embeddings")
    missing = [k for k in need if params.get(k) is None]
    if missing:
        refuse(f"longrope rope parameters without {', '.join(missing)}", f"{', '.join(need)} "
               "are required")
    short, long_ = float(params["short_mscale"]), float(params["long_mscale"])
    if short != long_:
        refuse(f"rope_scaling.long_mscale={long_} != short_mscale={short}", "transformers "
               "switches between them per forward call (on the call's largest position), which "
               "Colibri's cache cannot follow; equal scales (as published) are run")
    if params.get("attention_factor") is not None:
        refuse(f"rope_scaling.attention_factor={params['attention_factor']} for PhiMoE",
               "its forward uses short_mscale / long_mscale")
    orig = int(params["original_max_position_embeddings"])
    return dict(type="longrope", factor=float(c("max_position_embeddings")) / orig,
                original_max_position_embeddings=orig, attention_factor=short,
                short_factor=[float(v) for v in params["short_factor"]])


def fields(c, d: dict, refuse: Callable) -> None:
    """Fill ModelConfig fields `d` (the common ones set) from HFConfig `c`."""
    n, H, nh = d["num_layers"], d["hidden_size"], d["num_heads"]
    k = c.int("num_experts_per_tok")
    if k != 2:
        refuse(f"num_experts_per_tok={k} for PhiMoE", "its sparse-mixer router always picks two "
               "experts")
    D = int(c("head_dim", None) or H // nh)
    rs = d.get("rope_scaling")
    if rs is not None and len(rs.get("short_factor") or []) != D // 2:
        refuse(f"rope_scaling.short_factor of {len(rs.get('short_factor') or [])} entries",
               f"head_dim / 2 = {D // 2} expected")
    W = c("sliding_window")
    I = c.int("intermediate_size")
    d.update(head_dim=D, attention_bias=bool(c("attention_bias")), norm_type="layer",
             layer_types=["moe"] * n, num_experts=c.int("num_local_experts"), top_k=2,
             intermediate_size=I, moe_intermediate_size=I, norm_topk_prob=False,
             scoring_func="sparsemixer", router_jitter_eps=float(c("router_jitter_noise")),
             attention_window=[int(W)] * n if W is not None and W < d["max_position_embeddings"]
             else [])
