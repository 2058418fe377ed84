"""The families added after the first six (issue 32): Granite MoE (`granitemoe`,
`granitemoeshared`) and GLM-4.5 (`glm4_moe`). families.py dispatches here for them; the
defaults are those of the transformers 5 config classes, as there.

What they need beyond the first six, each a config field the one pipeline applies:
Granite's four scalars (`embedding_multiplier`, `attention_multiplier`,
`residual_multiplier`, `logits_scaling`) and GLM's partial rotary (`rotary_dim`).
"""
from __future__ import annotations

from typing import Any, Callable

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

ARCHITECTURES = {
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "Glm4MoeForCausalLM": "glm4_moe",
}

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
             shared_expert_intermediate_size=c.int("moe_intermediate_size") * int(c("n_shared_experts") or 0),
             scoring_func="sigmoid", norm_topk_prob=bool(c("norm_topk_prob")),
             routed_scaling_factor=float(c("routed_scaling_factor")),
             n_group=c.int("n_group"), topk_group=c.int("topk_group"))
    if "moe" not in d["layer_types"]:
        d.update(num_experts=0, top_k=0, shared_expert_intermediate_size=0)
