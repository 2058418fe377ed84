"""What a converted model *is*: `ModelConfig`, the config.json of a model directory (sizes,
layer kinds, attention and routing rules), and the parts it holds (FileInfo, FormatVersion,
RopeScaling). Pydantic models, frozen and refusing unknown keys; config.py re-exports them
beside the engine's settings and the file loaders."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ExpertIndexError

# allow_inf_nan=False: a NaN or infinite float in a config file (YAML `.nan`, `.inf`, JSON
# `NaN`, `Infinity`) is refused with the field's name instead of poisoning the arithmetic.
_STRICT = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class FileInfo(BaseModel):
    model_config = _STRICT
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class FormatVersion(BaseModel):
    model_config = _STRICT
    major: int = Field(ge=0)
    minor: int = Field(ge=0)


class RopeScaling(BaseModel):
    """Rotary scaling as transformers computes it (modeling_rope_utils): YaRN (DeepSeek, GLM,
    gpt-oss), llama3 (Llama 4) or longrope (Phi-3.5-MoE: ops.rope_frequencies says how)."""
    model_config = _STRICT
    type: Literal["yarn", "llama3", "longrope"] = "yarn"
    short_factor: list[float] = []              # longrope: a divisor per frequency
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    low_freq_factor: float = 1.0                # llama3
    high_freq_factor: float = 4.0


class ModelConfig(BaseModel):
    """Hyperparameters of a converted model (config.json of a model directory)."""

    model_config = _STRICT

    architecture: str = "qwen2_moe"          # family the checkpoint came from (informational)
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(ge=0)     # dense FFN width (dense layers)
    moe_intermediate_size: int = Field(default=0, ge=0)  # routed expert width
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: Optional[int] = Field(default=None, gt=0)  # None -> hidden_size // num_heads
    max_position_embeddings: int = Field(default=2048, gt=0)  # the context length
    rope_theta: float = Field(default=10000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)   # the eps of either norm_type
    norm_type: Literal["rms", "layer"] = "rms"  # "layer": LayerNorm, sections *norm_bias too
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    qk_norm: Literal["none", "per_head", "full", "l2"] = "none"  # RMSNorm on q/k: per head
                         # (Qwen3), over the projection (OLMoE), or "l2": weightless, per head,
                         # after rope, on the rope layers only (Llama 4)
    # per layer ([] or 0: the whole context): attention_window[i] > 0: positions
    # pos-window+1..pos (gpt-oss); attention_chunk[i] > 0: pos - pos % chunk..pos (Llama 4)
    attention_window: list[int] = []
    attention_chunk: list[int] = []
    attention_sinks: bool = False   # gpt-oss: a logit per head in the softmax denominator
    nope_layers: list[int] = []     # no rope (Llama 4); there q *= 1 + attn_temperature_scale
    # * log1p(floor((pos + 1) / attn_temperature_floor)) when that floor > 0
    attn_temperature_floor: int = Field(default=0, ge=0)
    attn_temperature_scale: float = 0.0

    num_experts: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    layer_types: list[Literal["dense", "moe"]]    # one entry per global layer index
    norm_topk_prob: bool = True
    scoring_func: Literal["softmax", "sigmoid", "sparsemixer"] = "softmax"  # routing.route
    router_jitter_eps: float = Field(default=0.0, ge=0)    # sparsemixer's mask width
    routed_scaling_factor: float = 1.0
    n_group: int = Field(default=1, ge=1)       # group-limited routing (DeepSeek)
    topk_group: int = Field(default=1, ge=1)
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    shared_expert_gate: bool = False            # Qwen2-MoE: sigmoid gate on the shared expert
    select_bias_on_probs: bool = False          # softmax routing: the selection bias added to
                                                # the probabilities, not the logits (ERNIE-4.5)
    routing_scales_input: bool = False          # Llama 4: weight x the expert's input, not output
    # Granite's scalars, where its model applies them: the embedding rows x embedding_multiplier;
    # the softmax scale attention_multiplier (None: 1/sqrt(head_dim)); the attention and FFN
    # outputs x residual_multiplier before each residual add; the logits / logits_scaling
    embedding_multiplier: float = 1.0
    attention_multiplier: Optional[float] = Field(default=None, gt=0)
    residual_multiplier: float = 1.0
    # every FFN's gated activation: "silu" silu(gate) * up; "swiglu_clamped" (gpt-oss) gate
    # clamped above at swiglu_limit, up to +-swiglu_limit, gate * sigmoid(swiglu_alpha *
    # gate) * (up + 1) (ops.gated_act); expert biases: sections w1.bias, w3.bias, w2.bias
    ffn_act: Literal["silu", "swiglu_clamped"] = "silu"
    swiglu_limit: float = Field(default=7.0, gt=0)
    swiglu_alpha: float = 1.702
    logits_scaling: float = Field(default=1.0, gt=0)
    rotary_dim: Optional[int] = Field(default=None, gt=0)   # partial rotary; None: all dims

    # Attention variant. "mla": DeepSeek multi-head latent attention (colibri_core/model/mla.py);
    # head_dim is then qk_nope_head_dim + qk_rope_head_dim and num_kv_heads == num_heads.
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: Optional[int] = Field(default=None, gt=0)   # None: plain wq
    kv_lora_rank: int = Field(default=0, ge=0)
    qk_nope_head_dim: int = Field(default=0, ge=0)
    qk_rope_head_dim: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)
    rope_interleave: bool = False               # rotary pairs (x0,x1),(x2,x3).. (DeepSeek)
    rope_scaling: Optional[RopeScaling] = None
    # Converter provenance (bits, group size, method, ...); never read by the engine
    quantization: dict[str, Any] = {}

    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = []

    format: Optional[FormatVersion] = None
    files: dict[str, FileInfo] = {}

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def expert_intermediate(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def attention_span(self, layer: int) -> tuple[int, int]:
        """(window, chunk) of a layer: 0 where it attends to the whole context."""
        return (self.attention_window[layer] if self.attention_window else 0,
                self.attention_chunk[layer] if self.attention_chunk else 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "moe"]

    @model_validator(mode="after")
    def _consistent(self) -> "ModelConfig":
        problems = []
        if len(self.layer_types) != self.num_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries, "
                            f"num_layers is {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size={self.hidden_size} is not divisible by "
                            f"num_heads={self.num_heads}; set head_dim")
        if self.attention == "mla":
            if not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
                problems.append("attention 'mla' needs kv_lora_rank, qk_rope_head_dim and "
                                "v_head_dim > 0")
            if self.qk_rope_head_dim % 2:
                problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
            if self.head_size != self.qk_nope_head_dim + self.qk_rope_head_dim:
                problems.append(f"head_dim={self.head_size} must equal qk_nope_head_dim + "
                                f"qk_rope_head_dim for attention 'mla'")
            if self.num_kv_heads != self.num_heads:
                problems.append("attention 'mla' needs num_kv_heads == num_heads")
        elif self.head_size % 2:
            problems.append(f"head_dim={self.head_size} must be even for rotary embeddings")
        if self.attention == "mla" and (self.residual_multiplier != 1 or self.attention_multiplier):
            problems.append("residual_multiplier / attention_multiplier are not supported with "
                            "attention 'mla'")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or self.rotary_dim > self.head_size
                                            or self.attention == "mla"):
            problems.append(f"rotary_dim={self.rotary_dim} must be even, at most head_dim="
                            f"{self.head_size}, and without attention 'mla'")
        for name in ("attention_window", "attention_chunk"):
            v = getattr(self, name)
            if v and (len(v) != self.num_layers or min(v) < 0):
                problems.append(f"{name} needs one entry >= 0 per layer ({self.num_layers})")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            problems.append(f"nope_layers {self.nope_layers} names a layer outside "
                            f"0..{self.num_layers - 1}")
        if self.attention == "mla" and (self.attention_window or self.attention_chunk
                                        or self.attention_sinks or self.nope_layers):
            problems.append("attention_window/_chunk/_sinks, nope_layers: not with attention 'mla'")
        if "moe" in self.layer_types and self.num_experts == 0:
            problems.append("layer_types has 'moe' layers but num_experts is 0")
        if "dense" in self.layer_types and self.intermediate_size == 0:
            problems.append("layer_types has 'dense' layers but intermediate_size is 0")
        if self.num_experts and self.num_experts % self.n_group:
            problems.append(f"num_experts={self.num_experts} is not a multiple of "
                            f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            problems.append(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            problems.append(f"bos_token_id={self.bos_token_id} is outside the vocabulary "
                            f"(0..{self.vocab_size - 1}): every text prompt would start with "
                            f"an invalid token")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def check_experts(self) -> None:
        """Reference-design check at load: top_k must fit the experts."""
        if self.moe_layers and not 1 <= self.top_k <= self.num_experts:
            raise ExpertIndexError(
                f"top_k={self.top_k} but the model has {self.num_experts} experts per layer; "
                f"check the 'top_k' field of config.json (allowed 1..{self.num_experts})")
