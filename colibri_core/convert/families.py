"""Per-architecture knowledge: which Hugging Face config keys and tensor names map to
Colibri's config and sections. One entry per family; shared helpers below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..errors import ConfigError
from .safetensors_reader import Checkpoint


def _rope_theta(hf: dict) -> float:
    rp = hf.get("rope_parameters") or {}
    rs = hf.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rs.get("rope_type") or rs.get("type") or "default"
    if kind not in ("default", None):
        raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported yet "
                          f"(supported: default)")
    return float(hf.get("rope_theta") or rp.get("rope_theta") or 10000.0)


def _eos(hf: dict) -> list[int]:
    e = hf.get("eos_token_id")
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, list) else [e])]


@dataclass(frozen=True)
class Family:
    name: str
    layer_types: Callable[[dict], list[str]]
    extra: Callable[[dict], dict]          # family-specific ModelConfig fields


def _qwen2_layers(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step") or 1
    E = hf.get("num_experts") or 0
    return ["moe" if (i not in only and E > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n)]


FAMILIES: dict[str, Family] = {
    "MixtralForCausalLM": Family(
        "mixtral",
        lambda hf: ["moe"] * hf["num_hidden_layers"],
        lambda hf: dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                        moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                        intermediate_size=hf["intermediate_size"])),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe", _qwen2_layers,
        lambda hf: dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                        moe_intermediate_size=hf["moe_intermediate_size"],
                        intermediate_size=hf["intermediate_size"],
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
                        shared_expert_gate=bool(hf.get("shared_expert_intermediate_size")),
                        attention_bias=True)),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe", _qwen2_layers,
        lambda hf: dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                        moe_intermediate_size=hf["moe_intermediate_size"],
                        intermediate_size=hf["intermediate_size"],
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        attention_bias=bool(hf.get("attention_bias", False)), qk_norm="per_head")),
    "OlmoeForCausalLM": Family(
        "olmoe",
        lambda hf: ["moe"] * hf["num_hidden_layers"],
        lambda hf: dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                        moe_intermediate_size=hf["intermediate_size"],
                        intermediate_size=hf["intermediate_size"],
                        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                        attention_bias=bool(hf.get("attention_bias", False)), qk_norm="full")),
}


def family_of(hf: dict) -> Family:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in FAMILIES:
            return FAMILIES[a]
    raise ConfigError(f"config.json: architecture {archs or hf.get('model_type')!r} is not "
                      f"supported (supported: {', '.join(sorted(FAMILIES))})")


def model_config_fields(hf: dict) -> dict:
    fam = family_of(hf)
    nh = hf["num_attention_heads"]
    d = dict(
        architecture=fam.name,
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=nh,
        num_kv_heads=hf.get("num_key_value_heads") or nh,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // nh,
        max_position_embeddings=hf.get("max_position_embeddings") or 2048,
        rope_theta=_rope_theta(hf), rms_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_types=fam.layer_types(hf),
        bos_token_id=None, eos_token_ids=_eos(hf),
    )
    d.update(fam.extra(hf))
    if fam.name == "mixtral" and hf.get("bos_token_id") is not None:
        d["bos_token_id"] = int(hf["bos_token_id"])   # Llama-style tokenizers prepend BOS
    return d


# ----------------------------------------------------------------------------- tensors

def expert_weights(ck: Checkpoint, L: int, e: int, I: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w1 gate [I,H], w3 up [I,H], w2 down [H,I]) of expert e in layer L, from fused
    `experts.gate_up_proj` / `down_proj` tensors or per-expert tensors."""
    for blk in ("mlp", "block_sparse_moe"):
        p = f"model.layers.{L}.{blk}.experts"
        if f"{p}.gate_up_proj" in ck:
            a = ck.get(f"{p}.gate_up_proj", e)                # [2I, H]
            down = ck.get(f"{p}.down_proj", e)                 # [H, I]
            return a[:I], a[I:], down
        if f"{p}.{e}.gate_proj.weight" in ck:
            return (ck.get(f"{p}.{e}.gate_proj.weight"), ck.get(f"{p}.{e}.up_proj.weight"),
                    ck.get(f"{p}.{e}.down_proj.weight"))
        if f"{p}.{e}.w1.weight" in ck:                       # Mixtral naming
            return ck.get(f"{p}.{e}.w1.weight"), ck.get(f"{p}.{e}.w3.weight"), ck.get(f"{p}.{e}.w2.weight")
    raise ConfigError(f"checkpoint: no weights found for expert {e} of layer {L}")


def router_weight(ck: Checkpoint, L: int) -> np.ndarray:
    for n in (f"model.layers.{L}.mlp.gate.weight", f"model.layers.{L}.block_sparse_moe.gate.weight"):
        if n in ck:
            return ck.get(n)
    raise ConfigError(f"checkpoint: no router weight for layer {L}")
