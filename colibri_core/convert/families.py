"""Per-architecture knowledge: which Hugging Face config keys and tensor names map to
Colibri's config and sections.

A key missing from config.json falls back to the default of the transformers config class
(listed per family below, as of transformers 5); `null` means None as it does there,
except for the fields transformers itself fills in (num_key_value_heads, head_dim).
Anything the engine cannot run exactly is refused with one line naming the option.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError
from . import families_more as more
from . import gptoss, phimoe
from .safetensors_reader import Checkpoint

_MISSING = object()

_COMMON_DEFAULTS = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                        rope_scaling=None, rope_parameters=None, attention_dropout=0.0)

DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                    rope_theta=1e6, sliding_window=None, num_experts_per_tok=2,
                    num_local_experts=8, bos_token_id=1, eos_token_id=2,
                    router_jitter_noise=0.0),
    "qwen2_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                      use_sliding_window=False, decoder_sparse_step=1,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_experts_per_tok=4, num_experts=60, norm_topk_prob=False,
                      mlp_only_layers=None, qkv_bias=True, bos_token_id=None, eos_token_id=None),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                      use_sliding_window=False, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
                      norm_topk_prob=False, mlp_only_layers=None, bos_token_id=None,
                      eos_token_id=None),
    "olmoe": dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  clip_qkv=None, num_experts_per_tok=8, num_experts=64, norm_topk_prob=False,
                  bos_token_id=None, eos_token_id=50279),
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                        qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                        rope_interleave=True, bos_token_id=0, eos_token_id=1,
                        moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc"),
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                        first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                        n_group=None, n_routed_experts=64, n_shared_experts=2,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0,
                        topk_group=None, topk_method="greedy", norm_topk_prob=False,
                        v_head_dim=128, num_experts_per_tok=None, moe_intermediate_size=1407,
                        mlp_bias=False, bos_token_id=1, eos_token_id=2, moe_layer_freq=1,
                        scoring_func="softmax"),
    **more.DEFAULTS,
    gptoss.FAMILY: gptoss.DEFAULTS,
    phimoe.FAMILY: phimoe.DEFAULTS,
}

ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    **more.ARCHITECTURES,
    **gptoss.ARCHITECTURES,
    **phimoe.ARCHITECTURES,
}


_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")
_ALIASES = {k: tuple(a for a in _EXPERT_COUNT if a != k) for k in _EXPERT_COUNT}
_ALIASES["num_nextn_predict_layers"] = ("num_mtp_layers",)


class HFConfig:
    """config.json with the family's transformers defaults behind it."""

    def __init__(self, hf: dict, family: str):
        self.raw, self.family = hf, family
        self.defaults = {**_COMMON_DEFAULTS, **DEFAULTS[family]}

    def __call__(self, key: str, default=_MISSING):
        if key in self.raw:
            return self.raw[key]
        for alias in _ALIASES.get(key, ()):             # transformers' attribute_map
            if alias in self.raw:
                return self.raw[alias]
        if key in self.defaults:
            return self.defaults[key]
        if default is not _MISSING:
            return default
        raise ConfigError(f"config.json: required field '{key}' is missing")

    def int(self, key: str) -> int:
        v = self(key)
        if v is None:
            raise ConfigError(f"config.json: field '{key}' is null; an integer is required "
                              f"for {self.family}")
        return int(v)


def family_of(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf.get("model_type") in DEFAULTS:   # as AutoModelForCausalLM would
        return hf["model_type"]
    raise ConfigError(f"config.json: architecture {archs or hf.get('model_type')!r} is not "
                      f"supported (supported: {', '.join(sorted(ARCHITECTURES))})")


def _refuse(what: str, hint: str = "") -> None:
    raise ConfigError(f"config.json: {what} is not supported by Colibri" + (f"; {hint}" if hint else ""))


def _rope(c: HFConfig) -> tuple[float, Optional[dict], float]:
    """(rope_theta, yarn parameters or None, partial_rotary_factor). Only default and YaRN
    rope are supported; a partial rotary factor only where the family has one."""
    rp = c("rope_parameters") or {}
    rs = c("rope_scaling") or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        _refuse("per-layer-type rope_parameters")
    params = {**rs, **rp}
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta")
    if theta is None:
        theta = c("rope_theta")
    theta = float(theta)
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = c("partial_rotary_factor", None)
    partial = 1.0 if partial is None else float(partial)
    if partial != 1.0 and c.family not in more.PARTIAL_ROTARY:
        _refuse(f"partial_rotary_factor={partial}")
    if kind == "default":
        return theta, None, partial
    if kind == "llama3":                                    # Llama 4 Scout
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(params.get(k) is None for k in need):
            _refuse(f"llama3 rope parameters {params}", f"{', '.join(need)} are required")
        return theta, dict(type="llama3", **{k: float(params[k]) for k in need[:3]},
                           original_max_position_embeddings=int(params[need[3]])), partial
    if kind == "longrope" and c.family == phimoe.FAMILY:
        return theta, phimoe.longrope(c, params, _refuse), partial
    if kind != "yarn":
        _refuse(f"rope type {kind!r}", "supported: default, yarn, llama3 (longrope: PhiMoE's)")
    orig = params.get("original_max_position_embeddings") or c("original_max_position_embeddings", None) \
        or c("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = c("max_position_embeddings") / orig
    y = dict(type="yarn", factor=float(factor), original_max_position_embeddings=int(orig),
             beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
             mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
             attention_factor=params.get("attention_factor"),
             truncate=bool(params.get("truncate", True)))
    return theta, y, partial


def _eos(c: HFConfig) -> list[int]:
    e = c("eos_token_id", None)
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, list) else [e])]


def _qwen_layers(c: HFConfig) -> list[str]:
    n = c.int("num_hidden_layers")
    only = set(c("mlp_only_layers") or [])
    step = c("decoder_sparse_step") or 1
    E = c("num_experts") or 0
    return ["moe" if (i not in only and E > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n)]


def _deepseek_layers(c: HFConfig) -> list[str]:
    n, k = c.int("num_hidden_layers"), c("first_k_dense_replace") or 0
    return ["dense" if i < k else "moe" for i in range(n)]


def model_config_fields(hf: dict, add_bos: Optional[bool] = None) -> dict:
    """ModelConfig fields for a Hugging Face config.json; refuses what cannot be run."""
    hf = more.text_model(hf)[0]
    fam = family_of(hf)
    c = HFConfig(hf, fam)
    if c("hidden_act") != "silu":
        _refuse(f"hidden_act={c('hidden_act')!r}", "only silu")
    if c("quantization_config", None):
        q = c("quantization_config")
        method = q.get("quant_method") if isinstance(q, dict) else q
        if method != "awq" and not (fam == gptoss.FAMILY and gptoss.quantization_ok(q)):
            _refuse(f"quantization_config with quant_method={method!r}",
                    "supported: unquantized checkpoints and AutoAWQ 4-bit GEMM checkpoints")
    nh = c.int("num_attention_heads")
    H = c.int("hidden_size")
    theta, yarn, partial = _rope(c)
    d: dict[str, Any] = dict(
        architecture=fam, vocab_size=c.int("vocab_size"), hidden_size=H,
        num_layers=c.int("num_hidden_layers"), num_heads=nh,
        num_kv_heads=int(c("num_key_value_heads") or nh),
        max_position_embeddings=int(c("max_position_embeddings")),
        rope_theta=theta, rope_scaling=yarn, rms_norm_eps=float(c("rms_norm_eps")),
        tie_word_embeddings=bool(c("tie_word_embeddings")),
        bos_token_id=None, eos_token_ids=_eos(c))
    if fam in more.PARTIAL_ROTARY:
        d["partial_rotary_factor"] = partial               # more.fields turns it into rotary_dim
    bos = c("bos_token_id", None)
    if bos is not None and (add_bos or (add_bos is None and fam == "mixtral")):
        d["bos_token_id"] = int(bos)      # Llama-style tokenizers prepend BOS

    if fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        d["head_dim"] = int(c("head_dim", None) or H // nh)
        sw = c("sliding_window", None)
        if fam == "mixtral" and sw is not None and sw < d["max_position_embeddings"]:
            _refuse(f"sliding_window={sw}", f"Colibri attends over the whole context (set it to "
                    f"null or >= max_position_embeddings={d['max_position_embeddings']})")
        if fam in ("qwen2_moe", "qwen3_moe") and c("use_sliding_window"):
            _refuse("use_sliding_window=true")
        if fam == "mixtral" and c("router_jitter_noise"):
            pass  # training-only noise: inference ignores it, as transformers does in eval
    if fam == gptoss.FAMILY:
        gptoss.fields(c, d, _refuse)
    elif fam == phimoe.FAMILY:
        phimoe.fields(c, d, _refuse)
    elif fam in more.ARCHITECTURES.values():
        more.fields(fam, c, d, _refuse)
    elif fam == "mixtral":
        E = c.int("num_local_experts")
        d.update(layer_types=["moe"] * d["num_layers"], num_experts=E,
                 top_k=c.int("num_experts_per_tok"), intermediate_size=c.int("intermediate_size"),
                 moe_intermediate_size=c.int("intermediate_size"), norm_topk_prob=True)
    elif fam in ("qwen2_moe", "qwen3_moe"):
        d.update(layer_types=_qwen_layers(c), num_experts=int(c("num_experts") or 0),
                 top_k=int(c("num_experts_per_tok") or 0),
                 intermediate_size=c.int("intermediate_size"),
                 moe_intermediate_size=c.int("moe_intermediate_size"),
                 norm_topk_prob=bool(c("norm_topk_prob")))
        if fam == "qwen2_moe":
            S = int(c("shared_expert_intermediate_size") or 0)
            d.update(attention_bias=bool(c("qkv_bias")), shared_expert_intermediate_size=S,
                     shared_expert_gate=S > 0)
        else:
            d.update(attention_bias=bool(c("attention_bias")), qk_norm="per_head")
        if "moe" not in d["layer_types"]:
            d.update(num_experts=0, top_k=0)
    elif fam == "olmoe":
        if c("clip_qkv") is not None:
            _refuse(f"clip_qkv={c('clip_qkv')}")
        d.update(layer_types=["moe"] * d["num_layers"], num_experts=c.int("num_experts"),
                 top_k=c.int("num_experts_per_tok"), intermediate_size=c.int("intermediate_size"),
                 moe_intermediate_size=c.int("intermediate_size"),
                 norm_topk_prob=bool(c("norm_topk_prob")),
                 attention_bias=bool(c("attention_bias")), qk_norm="full")
    else:                                                   # deepseek_v2 / deepseek_v3
        if c("attention_bias"):
            _refuse("attention_bias=true with MLA attention")
        if c("mlp_bias", False):
            _refuse("mlp_bias=true")
        if (c("moe_layer_freq") or 1) != 1:
            _refuse(f"moe_layer_freq={c('moe_layer_freq')}", "transformers ignores it; only 1 is "
                    "unambiguous")
        N, R, V = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
        E = c.int("n_routed_experts")
        ql = c("q_lora_rank")
        d.update(attention="mla", num_kv_heads=nh, head_dim=N + R, q_lora_rank=int(ql) if ql else None,
                 kv_lora_rank=c.int("kv_lora_rank"), qk_nope_head_dim=N, qk_rope_head_dim=R,
                 v_head_dim=V, layer_types=_deepseek_layers(c), num_experts=E,
                 top_k=c.int("num_experts_per_tok"), intermediate_size=c.int("intermediate_size"),
                 moe_intermediate_size=c.int("moe_intermediate_size"),
                 routed_scaling_factor=float(c("routed_scaling_factor")),
                 shared_expert_intermediate_size=c.int("moe_intermediate_size") * int(c("n_shared_experts") or 0))
        if fam == "deepseek_v3":
            if c("scoring_func") != "sigmoid":
                _refuse(f"scoring_func={c('scoring_func')!r} for DeepSeek-V3", "transformers uses sigmoid")
            d.update(scoring_func="sigmoid", norm_topk_prob=bool(c("norm_topk_prob")),
                     n_group=c.int("n_group"), topk_group=c.int("topk_group"),
                     rope_interleave=bool(c("rope_interleave")))
        else:
            method = c("topk_method")
            if method not in ("greedy", "group_limited_greedy"):
                _refuse(f"topk_method={method!r} for DeepSeek-V2",
                        "supported: greedy, group_limited_greedy")
            # transformers' DeepseekV2 router never renormalises (norm_topk_prob is unused)
            d.update(scoring_func="softmax", norm_topk_prob=False, rope_interleave=True)
            if method == "group_limited_greedy":
                d.update(n_group=c.int("n_group"), topk_group=c.int("topk_group"))
        if "moe" not in d["layer_types"]:
            d.update(num_experts=0, top_k=0, shared_expert_intermediate_size=0)
    return d


# ----------------------------------------------------------------------------- tensors

@dataclass(frozen=True)
class Src:
    """Where one tensor comes from: a checkpoint tensor, optionally one slice along axis 0
    (fused experts) and a row range (fused gate/up). `awq`: AutoAWQ packed linear prefix."""
    name: str
    index: Optional[int] = None
    rows: Optional[tuple[int, int]] = None
    awq: bool = False
    deinterleave: int = 0     # head dim D: each head's rows 0, 2, .., D-2 first, then 1, 3, ..
    transpose: bool = False   # the slice stored [in, out] (Llama 4's fused experts)

    def raw(self, ck: Checkpoint) -> np.ndarray:
        a = ck.raw(self.name, self.index)
        a = np.ascontiguousarray(a.T) if self.transpose else a
        return self._order(a if self.rows is None else a[self.rows[0]:self.rows[1]])

    def f32(self, ck: Checkpoint) -> np.ndarray:
        a = ck.get(self.name, self.index)
        a = np.ascontiguousarray(a.T) if self.transpose else a
        if self.rows is not None:
            a = np.ascontiguousarray(a[self.rows[0]:self.rows[1]])
        return self._order(a)

    def _order(self, a: np.ndarray) -> np.ndarray:
        """Interleaved rope pairs (2i, 2i+1) of each head moved to (i, i + D/2), the
        rotate-half layout (ERNIE-4.5); the same order on q and k leaves q . k unchanged."""
        D = self.deinterleave
        if not D:
            return a
        h = a.reshape(-1, D // 2, 2, *a.shape[1:])
        return np.ascontiguousarray(np.swapaxes(h, 1, 2).reshape(a.shape))

    def dtype(self, ck: Checkpoint) -> str:
        return ck.dtype(self.name)


def linear(ck: Checkpoint, prefix: str) -> Src:
    """A linear layer's weight: `prefix.weight`, or AutoAWQ's packed `prefix.qweight`."""
    if prefix + ".weight" in ck:
        return Src(prefix + ".weight")
    if prefix + ".qweight" in ck:
        return Src(prefix, awq=True)
    raise ConfigError(f"checkpoint: no tensor {prefix}.weight (nor an AWQ {prefix}.qweight)")


def _block(ck: Checkpoint, L: int) -> str:
    for blk in ("mlp", "block_sparse_moe", "feed_forward"):
        p = f"model.layers.{L}.{blk}"
        if any(f"{p}.{x}" in ck for x in ("gate.weight", "experts.gate_up_proj", "experts.0.w1.weight",
                                          "input_linear.weight", "router.layer.weight",
                                          "experts.0.gate_proj.weight", "experts.0.w1.qweight",
                                          "experts.0.gate_proj.qweight", "router.weight")):
            return p
    return f"model.layers.{L}.mlp"


def attention_sections(ck: Checkpoint, cfg, L: int) -> list[tuple[str, Src, str]]:
    """[(colibri section name, source, "matrix" | "vector")] of layer L's attention."""
    q = f"model.layers.{L}.self_attn."
    p = f"layer.{L}."
    out = []
    if cfg.attention == "mla":
        if cfg.q_lora_rank is None:
            out.append((p + "wq", linear(ck, q + "q_proj"), "matrix"))
        else:
            out += [(p + "wq_a", linear(ck, q + "q_a_proj"), "matrix"),
                    (p + "q_a_norm", Src(q + "q_a_layernorm.weight"), "vector"),
                    (p + "wq_b", linear(ck, q + "q_b_proj"), "matrix")]
        out += [(p + "wkv_a", linear(ck, q + "kv_a_proj_with_mqa"), "matrix"),
                (p + "kv_a_norm", Src(q + "kv_a_layernorm.weight"), "vector"),
                (p + "wkv_b", linear(ck, q + "kv_b_proj"), "matrix"),
                (p + "wo", linear(ck, q + "o_proj"), "matrix")]
        return out
    for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        src = linear(ck, q + n)
        if cfg.architecture in more.INTERLEAVED_ROPE and s in ("wq", "wk"):
            src = Src(src.name, deinterleave=cfg.head_size)
        out.append((p + s, src, "matrix"))
    if cfg.attention_bias:
        for s, n in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            d = cfg.head_size if cfg.architecture in more.INTERLEAVED_ROPE and s != "bv" else 0
            out.append((p + s, Src(q + f"{n}.bias", deinterleave=d), "vector"))
    if q + "o_proj.bias" in ck:                             # gpt-oss, Phi-3.5-MoE
        out.append((p + "bo", Src(q + "o_proj.bias"), "vector"))
    if cfg.norm_type == "layer":                            # Phi-3.5-MoE's LayerNorm biases
        out += [(p + "attn_norm_bias", Src(f"model.layers.{L}.input_layernorm.bias"), "vector"),
                (p + "ffn_norm_bias", Src(f"model.layers.{L}.post_attention_layernorm.bias"),
                 "vector")]
    if cfg.attention_sinks:                                 # gpt-oss: [num_heads]
        out.append((p + "sinks", Src(q + "sinks"), "vector"))
    if cfg.qk_norm not in ("none", "l2"):                  # l2 has no weights
        out += [(p + "q_norm", Src(q + "q_norm.weight"), "vector"),
                (p + "k_norm", Src(q + "k_norm.weight"), "vector")]
    return out


def dense_sources(ck: Checkpoint, L: int) -> tuple[Src, Src, Src]:
    m = f"model.layers.{L}.mlp."
    if f"model.layers.{L}.feed_forward.gate_proj.weight" in ck:       # Llama 4
        m = f"model.layers.{L}.feed_forward."
    return linear(ck, m + "gate_proj"), linear(ck, m + "up_proj"), linear(ck, m + "down_proj")


def shared_sources(ck: Checkpoint, L: int) -> tuple[Src, Src, Src]:
    for n in ("mlp.shared_expert", "mlp.shared_experts", "feed_forward.shared_expert"):
        m = f"model.layers.{L}.{n}."
        if m + "gate_proj.weight" in ck or m + "gate_proj.qweight" in ck:
            return linear(ck, m + "gate_proj"), linear(ck, m + "up_proj"), linear(ck, m + "down_proj")
    m = f"model.layers.{L}.shared_mlp."                     # Granite: gate and up rows fused
    if m + "input_linear.weight" in ck:
        S = ck.shape(m + "input_linear.weight")[0] // 2
        return (Src(m + "input_linear.weight", None, (0, S)),
                Src(m + "input_linear.weight", None, (S, 2 * S)), linear(ck, m + "output_linear"))
    raise ConfigError(f"checkpoint: no shared expert weights for layer {L} "
                      f"(looked for mlp.shared_expert(s).gate_proj, shared_mlp.input_linear)")


def shared_gate_source(ck: Checkpoint, L: int) -> Src:
    return Src(f"model.layers.{L}.mlp.shared_expert_gate.weight")


def expert_sources(ck: Checkpoint, L: int, e: int, I: int) -> tuple[Src, Src, Src]:
    """(gate [I,H], up [I,H], down [H,I]) of expert e in layer L, from fused
    `experts.gate_up_proj` / `down_proj` tensors or per-expert tensors (either naming)."""
    p = _block(ck, L) + ".experts"
    if p[:-8] + ".input_linear.weight" in ck:             # Granite's names of the fused tensors
        p = p[:-8]
        gu = f"{p}.input_linear.weight"
        return Src(gu, e, (0, I)), Src(gu, e, (I, 2 * I)), Src(f"{p}.output_linear.weight", e)
    if f"{p}.gate_up_proj" in ck and p.endswith("feed_forward.experts"):   # Llama 4: [E, H, 2I]
        shape = ck.shape(f"{p}.gate_up_proj")
        if shape[2] != 2 * I:
            raise ConfigError(f"checkpoint: {p}.gate_up_proj has shape {list(shape)}, expected "
                              f"[E, hidden, {2 * I}] (gate columns then up columns)")
        gu = f"{p}.gate_up_proj"
        return (Src(gu, e, (0, I), transpose=True), Src(gu, e, (I, 2 * I), transpose=True),
                Src(f"{p}.down_proj", e, transpose=True))
    if f"{p}.gate_up_proj" in ck:
        shape = ck.shape(f"{p}.gate_up_proj")
        if shape[1] != 2 * I:
            raise ConfigError(f"checkpoint: {p}.gate_up_proj has shape {list(shape)}, expected "
                              f"[E, {2 * I}, hidden] (gate rows then up rows)")
        return (Src(f"{p}.gate_up_proj", e, (0, I)), Src(f"{p}.gate_up_proj", e, (I, 2 * I)),
                Src(f"{p}.down_proj", e))
    for g, u, d in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if f"{p}.{e}.{g}.weight" in ck or f"{p}.{e}.{g}.qweight" in ck:
            return (linear(ck, f"{p}.{e}.{g}"), linear(ck, f"{p}.{e}.{u}"),
                    linear(ck, f"{p}.{e}.{d}"))
    raise ConfigError(f"checkpoint: no weights found for expert {e} of layer {L}")


def router_source(ck: Checkpoint, L: int) -> Src:
    n = _block(ck, L) + ".gate.weight"
    for name in (n, n[:-12] + ".router.layer.weight", n[:-12] + ".router.weight"):  # Granite's too
        if name in ck:
            return Src(name)
    raise ConfigError(f"checkpoint: no router weight for layer {L} ({n})")


def router_bias_source(ck: Checkpoint, L: int) -> Optional[Src]:
    b = _block(ck, L)
    for n in (b + ".gate.e_score_correction_bias", b + ".moe_statics.e_score_correction_bias",
              b + ".gate.moe_statics.e_score_correction_bias"):      # ERNIE's [1, E]
        if n in ck:
            return Src(n)
    return None
