"""The families added after the first six (issue 32): Granite MoE (`granitemoe`,
`granitemoeshared`), GLM-4.5 (`glm4_moe`), ERNIE-4.5-MoE (`ernie4_5_moe`) and Llama 4's text
model (`llama4`). families.py
dispatches here for them; the defaults are those of the transformers 5 config classes, as
there.

What they need beyond the first six, each a config field the one pipeline applies:
Granite's four scalars (`embedding_multiplier`, `attention_multiplier`,
`residual_multiplier`, `logits_scaling`), GLM's partial rotary (`rotary_dim`), ERNIE's
selection bias on the softmax probabilities (`select_bias_on_probs`). ERNIE's interleaved
rope pairs need no field: the converter reorders each head's q and k rows
(families.Src.deinterleave) so the pipeline's rotate-half rotates the same pairs; q and k
alike, so the scores are the same.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError

DEFAULTS: dict[str, dict[str, Any]] = {
    "granitemoe": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2, embedding_multiplier=1.0,
                       logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                       num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=0),
    "glm4_moe": dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                     num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                     head_dim=None, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     rope_theta=10000.0, partial_rotary_factor=0.5, moe_intermediate_size=1408,
                     num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1,
                     first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                     bos_token_id=None, eos_token_id=None),
}
DEFAULTS["granitemoeshared"] = DEFAULTS["granitemoe"]
DEFAULTS["ernie4_5_moe"] = dict(
    vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28,
    num_attention_heads=20, num_key_value_heads=4, head_dim=None, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, use_bias=False,
    moe_intermediate_size=1536, moe_k=6, moe_num_experts=64, moe_num_shared_experts=2,
    moe_layer_start_index=1, moe_layer_end_index=27, moe_layer_interval=1, moe_norm_min=1e-12,
    bos_token_id=1, eos_token_id=2)

DEFAULTS["llama4"] = dict(
    vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1,
    eos_token_id=2, num_experts_per_tok=1, num_local_experts=16, moe_layers=None,
    interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layers=None, no_rope_layer_interval=4,
    attention_chunk_size=8192, layer_types=None, attn_temperature_tuning=True, floor_scale=8192,
    attn_scale=0.1, router_jitter_noise=0.0)

ARCHITECTURES = {
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "Llama4ForCausalLM": "llama4",
}
INTERLEAVED_ROPE = ("ernie4_5_moe", "llama4")   # q/k rows reordered at conversion (Src)
# multimodal checkpoints whose text model is converted: its config, its tensors' prefix
MULTIMODAL = {"Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "language_model.")}


def text_model(hf: dict) -> tuple[dict, str]:
    """(the config.json of the causal LM inside `hf`, its tensors' name prefix): a
    multimodal checkpoint's text_config (the token ids the top level names, where the text
    config has none), or `hf` itself and no prefix."""
    for a in hf.get("architectures") or []:
        if a in MULTIMODAL:
            if not isinstance(hf.get("text_config"), dict):
                raise ConfigError(f"config.json: {a} without a text_config mapping")
            arch, prefix = MULTIMODAL[a]
            top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
            return {**top, **hf["text_config"], "architectures": [arch]}, prefix
    return hf, ""

PARTIAL_ROTARY = ("glm4_moe",)        # the families whose partial_rotary_factor is run


def fields(fam: str, c, d: dict, refuse: Callable) -> None:
    """Fill ModelConfig fields `d` (the common ones set) for family `fam` from HFConfig `c`."""
    H, nh, n = d["hidden_size"], d["num_heads"], d["num_layers"]
    if fam in ("granitemoe", "granitemoeshared"):
        if c("attention_bias"):             # q/k/v and o biases; an o bias has no place here
            refuse("attention_bias=true for Granite", "its output projection bias is not run")
        S = int(c("shared_intermediate_size") or 0)
        I = c.int("intermediate_size")
        # the router softmaxes its top-k logits: Mixtral's renormalised softmax top-k
        d.update(head_dim=H // nh, layer_types=["moe"] * n, num_experts=c.int("num_local_experts"),
                 top_k=c.int("num_experts_per_tok"), intermediate_size=I, moe_intermediate_size=I,
                 norm_topk_prob=True, shared_expert_intermediate_size=S,
                 embedding_multiplier=float(c("embedding_multiplier")),
                 attention_multiplier=float(c("attention_multiplier")),
                 residual_multiplier=float(c("residual_multiplier")),
                 logits_scaling=float(c("logits_scaling")))
        return
    if fam == "ernie4_5_moe":
        _ernie(c, d, refuse)
        return
    if fam == "llama4":
        _llama4(c, d, refuse)
        return
    # glm4_moe: DeepSeek-V3's routing and layer stack on grouped-query attention
    D = int(c("head_dim", None) or H // nh)
    k = c("first_k_dense_replace") or 0
    d.update(head_dim=D, attention_bias=bool(c("attention_bias")),
             qk_norm="per_head" if c("use_qk_norm") else "none",
             rotary_dim=int(D * d.pop("partial_rotary_factor")),
             layer_types=["dense" if i < k else "moe" for i in range(n)],
             num_experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
             intermediate_size=c.int("intermediate_size"),
             moe_intermediate_size=c.int("moe_intermediate_size"),
             shared_expert_intermediate_size=(c.int("moe_intermediate_size")
                                              * int(c("n_shared_experts") or 0)),
             scoring_func="sigmoid", norm_topk_prob=bool(c("norm_topk_prob")),
             routed_scaling_factor=float(c("routed_scaling_factor")),
             n_group=c.int("n_group"), topk_group=c.int("topk_group"))
    if "moe" not in d["layer_types"]:
        d.update(num_experts=0, top_k=0, shared_expert_intermediate_size=0)


def _ernie(c, d: dict, refuse: Callable) -> None:
    if c("use_bias"):
        refuse("use_bias=true for ERNIE-4.5", "biases on every linear (the output projection's "
               "and the FFNs') are not run")
    if c("quantization_config", None):
        refuse("quantization_config for ERNIE-4.5", "its q/k rows are reordered at conversion; "
               "convert an unquantized checkpoint")
    n, step = d["num_layers"], c("moe_layer_interval") or 1
    lo, hi = c("moe_layer_start_index"), c("moe_layer_end_index")
    if not all(isinstance(v, int) for v in (lo, hi, step)):
        refuse(f"moe_layer_start_index={lo!r} / moe_layer_end_index={hi!r} / "
               f"moe_layer_interval={step!r}", "integers only (lists are the VL models')")
    E = int(c("moe_num_experts") or 0)
    kinds = ["moe" if E and (i + 1) % step == 0 and lo <= i <= hi else "dense" for i in range(n)]
    I = c.int("moe_intermediate_size")
    # softmax top-k chosen on the probabilities plus the correction bias, weights the chosen
    # probabilities renormalised (transformers clamps the sum at moe_norm_min, 1e-12; 1e-20 here)
    d.update(head_dim=int(c("head_dim", None) or d["hidden_size"] // d["num_heads"]),
             layer_types=kinds, num_experts=E, top_k=int(c("moe_k") or 0),
             intermediate_size=c.int("intermediate_size"), moe_intermediate_size=I,
             norm_topk_prob=True, select_bias_on_probs=True,
             shared_expert_intermediate_size=I * int(c("moe_num_shared_experts") or 0))
    if "moe" not in kinds:
        d.update(num_experts=0, top_k=0, shared_expert_intermediate_size=0)


def _llama4(c, d: dict, refuse: Callable) -> None:
    """Llama 4's text model (Llama4ForCausalLM): MoE layers at moe_layers (or every
    interleave_moe_layer_step-th), the others dense (intermediate_size_mlp); top-k by the
    router's logits, sigmoid weights multiplying the expert's input; an unconditioned
    shared expert; chunked attention on the layers layer_types names, no rope on
    no_rope_layers' zeros (q temperature-tuned there), the weightless q/k norm after rope."""
    n = d["num_layers"]
    step = int(c("interleave_moe_layer_step") or 1)
    moe = c("moe_layers")
    moe = set(range(step - 1, n, step)) if moe is None else set(moe)
    rope = c("no_rope_layers") or [int((i + 1) % int(c("no_rope_layer_interval") or 4) != 0)
                                   for i in range(n)]
    chunk = c("attention_chunk_size")
    types = c("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                 for r in rope]
    if len(rope) != n or len(types) != n:
        refuse(f"no_rope_layers / layer_types of {len(rope)} / {len(types)} entries for "
               f"num_hidden_layers={n}")
    if set(types) - {"chunked_attention", "full_attention"}:
        refuse(f"layer_types {sorted(set(types))}", "supported: chunked_attention, full_attention")
    if "chunked_attention" in types and not chunk:
        refuse(f"attention_chunk_size={chunk!r} with chunked_attention layers")
    I, E = c.int("intermediate_size"), c.int("num_local_experts")
    d.update(head_dim=int(c("head_dim", None) or d["hidden_size"] // d["num_heads"]),
             layer_types=["moe" if i in moe and E else "dense" for i in range(n)],
             num_experts=E, top_k=c.int("num_experts_per_tok"),
             intermediate_size=c.int("intermediate_size_mlp"), moe_intermediate_size=I,
             shared_expert_intermediate_size=I, scoring_func="sigmoid", norm_topk_prob=False,
             routing_scales_input=True, attention_bias=bool(c("attention_bias")),
             qk_norm="l2" if c("use_qk_norm") else "none",
             attention_chunk=[int(chunk) if t == "chunked_attention" else 0 for t in types],
             nope_layers=[i for i, r in enumerate(rope) if not r])
    if c("attn_temperature_tuning"):
        d.update(attn_temperature_floor=int(c("floor_scale")),
                 attn_temperature_scale=float(c("attn_scale")))
    if "moe" not in d["layer_types"]:
        d.update(num_experts=0, top_k=0, shared_expert_intermediate_size=0)
