"""GGUF metadata and tensor names -> a Hugging Face config.json dict and HF tensor names
(issue 33), so that families.py maps a GGUF as it maps a checkpoint folder.

Architectures (GGUF `general.architecture` -> transformers class):
  llama with experts (Mixtral) -> MixtralForCausalLM (q/k rows un-permuted, below)
  qwen2moe -> Qwen2MoeForCausalLM      qwen3moe -> Qwen3MoeForCausalLM
  olmoe -> OlmoeForCausalLM             deepseek2 -> DeepseekV3ForCausalLM when the file
  has the selection bias (`exp_probs_b`) or sigmoid gating, else DeepseekV2ForCausalLM
  granitemoe -> GraniteMoe(Shared)ForCausalLM   glm4moe -> Glm4MoeForCausalLM
  ernie4_5-moe -> Ernie4_5_MoeForCausalLM   gpt-oss -> GptOssForCausalLM (its MXFP4 experts
  kept as they are stored: gguf_reader's raw, gptoss.expert_ffn)
  phimoe -> PhimoeForCausalLM (LongRoPE's factors from the rope_factors_* tensors)
  llama4 -> Llama4ForCausalLM (the text model; llama3 rope scaling recovered from the
  rope_freqs factors: llama3_from_factors)
What a GGUF does not record is what llama.cpp itself assumes for the architecture (e.g.
Qwen3-MoE's renormalised top-k, Qwen2-MoE's and OLMoE's not renormalised), so the model
runs as llama.cpp runs the same file.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError

# the GGML tensor types read (dequantized by the gguf package)
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
              "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_NL", "IQ4_XS")
# GGML bits per weight of each type (block bytes * 8 / block size)
TYPE_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0,
             "Q5_0": 5.5, "Q5_1": 6.0, "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5,
             "Q5_K": 5.5, "Q6_K": 6.5625, "MXFP4": 4.25, "IQ4_NL": 4.5, "IQ4_XS": 4.25}

ARCHS = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
         "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
         "deepseek2": "DeepseekV2ForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
         "glm4moe": "Glm4MoeForCausalLM", "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
         "gpt-oss": "GptOssForCausalLM", "phimoe": "PhimoeForCausalLM",
         "llama4": "Llama4ForCausalLM"}


class Meta:
    """GGUF key/values (`get(key)`; `a(key)` = `get(arch + "." + key)`)."""

    def __init__(self, fields: dict):
        self.fields = fields
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ConfigError("GGUF: no general.architecture in the file's metadata")

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def a(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        v = self.a(key)
        if v is None:
            raise ConfigError(f"GGUF: metadata {self.arch}.{key} is missing")
        return v


def hf_config(m: Meta, shapes: dict, where: str, vectors: Optional[dict] = None) -> dict:
    """A config.json dict (transformers names) for the GGUF's metadata (`vectors`: the
    file's rope_factors_* tensors as arrays)."""
    arch = m.arch
    if arch not in ARCHS:
        raise ConfigError(f"{where}: GGUF architecture {arch!r} is not supported (supported: "
                          f"{', '.join(sorted(ARCHS))}; llama only with experts, i.e. Mixtral)")
    L = int(m.need("block_count"))
    H, nh = int(m.need("embedding_length")), int(m.need("attention.head_count"))
    nkv = m.a("attention.head_count_kv")
    nkv = int(nkv if not isinstance(nkv, list) else max(nkv)) if nkv is not None else nh
    vocab = m.a("vocab_size") or shapes["token_embd.weight"][0]
    hf: dict[str, Any] = dict(
        architectures=[ARCHS[arch]], vocab_size=int(vocab), hidden_size=H, num_hidden_layers=L,
        num_attention_heads=nh, num_key_value_heads=nkv,
        max_position_embeddings=int(m.a("context_length") or 4096),
        rope_theta=float(m.a("rope.freq_base") or 10000.0),
        rms_norm_eps=float(m.need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in shapes, hidden_act="silu",
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=m.get("tokenizer.ggml.eos_token_id"))
    ff = m.a("feed_forward_length")
    if isinstance(ff, list):
        ff = max(ff)
    if ff is not None:
        hf["intermediate_size"] = int(ff)
    E, k = int(m.a("expert_count") or 0), int(m.a("expert_used_count") or 0)
    eff = m.a("expert_feed_forward_length")
    hf.update(_rope_scaling(m, where))
    moe = [i for i in range(L) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if arch == "llama":
        if E == 0:
            raise ConfigError(f"{where}: GGUF architecture 'llama' without experts (a dense "
                              f"Llama) is not supported; Colibri runs MoE models (Mixtral is "
                              f"'llama' with llama.expert_count)")
        hf.update(num_local_experts=E, num_experts_per_tok=k, sliding_window=None,
                  head_dim=int(m.a("attention.key_length") or H // nh))
    elif arch in ("qwen2moe", "qwen3moe"):
        hf.update(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=int(eff or ff),
                  mlp_only_layers=[i for i in range(L) if i not in moe],
                  norm_topk_prob=bool(m.a("expert_weights_norm", arch == "qwen3moe")))
        if arch == "qwen2moe":
            hf.update(shared_expert_intermediate_size=int(m.a("expert_shared_feed_forward_length") or 0),
                      qkv_bias="blk.0.attn_q.bias" in shapes)
        else:
            hf.update(head_dim=int(m.a("attention.key_length") or H // nh),
                      attention_bias="blk.0.attn_q.bias" in shapes)
    elif arch == "olmoe":
        hf.update(num_experts=E, num_experts_per_tok=k,
                  norm_topk_prob=bool(m.a("expert_weights_norm", False)))
        if eff:
            hf["intermediate_size"] = int(eff)
    elif arch == "deepseek2":
        _deepseek(m, hf, shapes, E, k, int(eff or 0), where)
    elif arch == "granitemoe":
        S = int(m.a("expert_shared_feed_forward_length") or 0)
        if S:
            hf["architectures"] = ["GraniteMoeSharedForCausalLM"]
            hf["shared_intermediate_size"] = S
        hf.update(num_local_experts=E, num_experts_per_tok=k,
                  embedding_multiplier=float(m.a("embedding_scale") or 1.0),
                  attention_multiplier=float(m.a("attention.scale") or 1.0),
                  residual_multiplier=float(m.a("residual_scale") or 1.0),
                  logits_scaling=float(m.a("logit_scale") or 1.0))
        if eff:
            hf["intermediate_size"] = int(eff)
    elif arch == "glm4moe":
        D = int(m.a("attention.key_length") or H // nh)
        rot = int(m.a("rope.dimension_count") or D)
        hf.update(head_dim=D, partial_rotary_factor=rot / D, n_routed_experts=E,
                  num_experts_per_tok=k, moe_intermediate_size=int(eff),
                  n_shared_experts=int(m.a("expert_shared_count") or 0),
                  first_k_dense_replace=int(m.a("leading_dense_block_count") or 0),
                  routed_scaling_factor=float(m.a("expert_weights_scale") or 1.0),
                  norm_topk_prob=bool(m.a("expert_weights_norm", True)),
                  n_group=int(m.a("expert_group_count") or 1),
                  topk_group=int(m.a("expert_group_used_count") or 1),
                  attention_bias="blk.0.attn_q.bias" in shapes,
                  use_qk_norm="blk.0.attn_q_norm.weight" in shapes,
                  num_nextn_predict_layers=int(m.a("nextn_predict_layers") or 0))
        hf["num_hidden_layers"] = L - hf["num_nextn_predict_layers"]
    elif arch == "ernie4_5-moe":
        step = int(m.a("interleave_moe_layer_step") or 1)
        lo = min(moe) if moe else 0
        hi = max(moe) if moe else L - 1
        hf.update(moe_num_experts=E, moe_k=k, moe_intermediate_size=int(eff),
                  moe_num_shared_experts=int(m.a("expert_shared_count") or 0),
                  moe_layer_start_index=lo, moe_layer_end_index=hi, moe_layer_interval=step,
                  head_dim=int(m.a("attention.key_length") or H // nh), use_bias=False)
    elif arch == "gpt-oss":
        # llama.cpp's gpt-oss graph fixes what the file does not say: sliding-window layers
        # the even ones (transformers' default layer_types), the clamped SwiGLU's limit 7 and
        # alpha 1.702; YaRN without truncated correction dims, as gpt-oss's config.json
        hf.update(num_local_experts=E, num_experts_per_tok=k, intermediate_size=int(eff or ff),
                  head_dim=int(m.a("attention.key_length") or H // nh),
                  sliding_window=int(m.need("attention.sliding_window")),
                  attention_bias="blk.0.attn_q.bias" in shapes, swiglu_limit=7.0,
                  swiglu_alpha=1.702, layer_types=None)
        # rope_parameters, not rope_scaling: gpt-oss's defaults carry rope_parameters (YaRN
        # x32), which would win over a rope_scaling key
        rp = hf.pop("rope_scaling", None) or {"rope_type": "default"}
        hf["rope_parameters"] = dict(rp, rope_theta=hf["rope_theta"], truncate=False)
    elif arch == "phimoe":
        _phimoe(m, hf, shapes, vectors or {}, E, k)
    elif arch == "llama4":
        _llama4(m, hf, shapes, vectors or {}, E, k, eff, ff, where)
    return hf


def _llama4(m: Meta, hf: dict, shapes: dict, vectors: dict, E: int, k: int, eff, ff,
            where: str) -> None:
    # llama.cpp's llama4 graph fixes what the file does not say (transformers' defaults
    # too): chunks of 8192, floor_scale 8192, attn_scale 0.1, every fourth layer NoPE and
    # unchunked, the q/k L2 norm unless 128 experts (Maverick); attention.sliding_window 0
    # turns chunking and NoPE off (MobileLLM). q/k rows are stored unpermuted
    hd = int(m.a("attention.key_length") or hf["hidden_size"] // hf["num_attention_heads"])
    if "rope_freqs.weight" in shapes:                   # llama3 scaling (Llama 4 Scout)
        f = np.asarray(vectors.get("rope_freqs.weight", []), np.float64).ravel()
        if 2 * f.size != hd:
            raise ConfigError(f"{where}: GGUF rope_freqs.weight has {f.size} factors, expected "
                              f"{hd // 2} (head_dim / 2)")
        rs = llama3_from_factors(f, hf["rope_theta"], m.a("rope.scaling.original_context_length"),
                                 where)
        if rs is not None:
            hf["rope_scaling"] = rs
    hf.update(num_local_experts=E, num_experts_per_tok=k, intermediate_size=int(eff or ff),
              intermediate_size_mlp=int(ff), use_qk_norm=E != 128,
              interleave_moe_layer_step=int(m.a("interleave_moe_layer_step") or 1),
              head_dim=hd,
              attention_bias="blk.0.attn_q.bias" in shapes)
    sw = m.a("attention.sliding_window")
    if sw is not None and int(sw) == 0:
        hf.update(attention_chunk_size=None, no_rope_layers=[1] * hf["num_hidden_layers"])


def llama3_from_factors(f: np.ndarray, theta: float, ctx_meta, where: str) -> Optional[dict]:
    """The llama3 rope parameters whose per-frequency factors (llama.cpp's rope_freqs: 1 for
    short wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) in the blend band,
    s linear in 1 / wavelength) are `f`; only the band's edges (context / low_freq_factor,
    context / high_freq_factor) are in the factors, so the context is the file's
    original_context_length, else low_freq_factor 1. Verified: Colibri's own llama3 code must
    give back `f` to float32 rounding, else one line refuses the file."""
    from ..model.ops import _llama3_inv_freq
    from ..modelconfig import RopeScaling
    F = float(f.max())
    if F == 1.0 and f.min() == 1.0:
        return None                                        # no scaling at all
    dim = 2 * f.size
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wl = 2 * np.pi / inv
    tol = 1e-6
    band = (f > 1 + tol) & (f < F * (1 - tol))
    long_ = ~band & (f >= F * (1 - tol))
    try:
        if band.sum() >= 2:                                # s = a / wavelength + b
            s = (1 / f[band] - 1 / F) / (1 - 1 / F)
            a, b = np.polyfit(1 / wl[band], s, 1)
            lo_wl, hi_wl = -a / b, 1 / (1 / (-a / b) + 1 / a)
        else:                                              # an edge between two neighbours:
            below, above = wl[~long_].max(), wl[long_].min()   # a power of two if one fits
            p2 = 2.0 ** np.floor(np.log2(above))
            lo_wl = p2 if below < p2 < above else float(np.sqrt(below * above))
            hi_wl = lo_wl
            if band.any():                                 # one band point fixes the other
                s = (1 / f[band][0] - 1 / F) / (1 - 1 / F)
                hi_wl = 1 / (1 / lo_wl + (1 / wl[band][0] - 1 / lo_wl) / s)
        ctx = int(ctx_meta) if ctx_meta else int(round(lo_wl))
        ulp = np.spacing(f.astype(np.float32))
        for digits in (4, None):                           # the published round values first
            rs = dict(rope_type="llama3", factor=F, original_max_position_embeddings=ctx,
                      low_freq_factor=float(round(ctx / lo_wl, digits) if digits else ctx / lo_wl),
                      high_freq_factor=float(round(ctx / hi_wl, digits) if digits else ctx / hi_wl))
            back = inv / _llama3_inv_freq(inv, RopeScaling(type="llama3", **{
                k: v for k, v in rs.items() if k != "rope_type"}))
            if np.all(np.abs(back.astype(np.float32) - f) <= 8 * ulp):
                return rs
    except (ValueError, ZeroDivisionError, FloatingPointError):
        pass
    raise ConfigError(f"{where}: GGUF rope_freqs.weight ({f.size} factors, largest {F:g}) fits "
                      f"no llama3 rope parameters (expected 1 for short wavelengths, the "
                      f"largest for long ones, llama3's blend between)")


def _phimoe(m: Meta, hf: dict, shapes: dict, vectors: dict, E: int, k: int) -> None:
    # llama.cpp stores LongRoPE's factors as tensors and the two equal mscales as one
    # attn_factor; the sparse-mixer's jitter epsilon is not in the file: the published 0.01.
    # The model runs as transformers runs it (LayerNorms with biases from the file, the
    # sparse-mixer routing), not as llama.cpp's phimoe graph does
    W = int(m.a("attention.sliding_window") or 0)
    hf.update(num_local_experts=E, num_experts_per_tok=k, router_jitter_noise=0.01,
              attention_bias="blk.0.attn_q.bias" in shapes, lm_head_bias="output.bias" in shapes,
              sliding_window=W or None)
    if "rope_factors_short.weight" in vectors:
        ms = float(m.a("rope.scaling.attn_factor") or 1.0)
        hf["rope_scaling"] = dict(
            rope_type="longrope", short_mscale=ms, long_mscale=ms,
            original_max_position_embeddings=int(m.need("rope.scaling.original_context_length")),
            short_factor=[float(v) for v in vectors["rope_factors_short.weight"]],
            long_factor=[float(v) for v in vectors.get("rope_factors_long.weight", [])])


def _rope_scaling(m: Meta, where: str) -> dict:
    kind = m.a("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind != "yarn":
        raise ConfigError(f"{where}: GGUF {m.arch}.rope.scaling.type={kind!r} is not supported "
                          f"(supported: none, yarn)")
    d = dict(rope_type="yarn", factor=float(m.a("rope.scaling.factor") or 1.0),
             original_max_position_embeddings=int(m.a("rope.scaling.original_context_length")))
    lm = m.a("rope.scaling.yarn_log_multiplier")
    if lm:                                # llama.cpp: 0.1 * mscale_all_dim (DeepSeek)
        d.update(mscale=float(lm) / 0.1, mscale_all_dim=float(lm) / 0.1)
    for key, hk in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                    ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if m.a(key) is not None:
            d[hk] = float(m.a(key))
    return {"rope_scaling": d}


def _deepseek(m: Meta, hf: dict, shapes: dict, E: int, k: int, eff: int, where: str) -> None:
    R = int(m.need("rope.dimension_count"))
    kl = int(m.a("attention.key_length_mla") or m.need("attention.key_length"))
    vl = int(m.a("attention.value_length_mla") or m.need("attention.value_length"))
    gating = m.a("expert_gating_func")      # 1 softmax, 2 sigmoid
    v3 = gating == 2 or (gating is None and "blk.%d.exp_probs_b.bias" % (hf["num_hidden_layers"] - 1) in shapes)
    ql = m.a("attention.q_lora_rank")
    hf.update(num_key_value_heads=hf["num_attention_heads"], q_lora_rank=int(ql) if ql else None,
              kv_lora_rank=int(m.need("attention.kv_lora_rank")), qk_rope_head_dim=R,
              qk_nope_head_dim=kl - R, v_head_dim=vl, n_routed_experts=E,
              num_experts_per_tok=k, moe_intermediate_size=eff,
              n_shared_experts=int(m.a("expert_shared_count") or 0),
              first_k_dense_replace=int(m.a("leading_dense_block_count") or 0),
              routed_scaling_factor=float(m.a("expert_weights_scale") or 1.0),
              norm_topk_prob=bool(m.a("expert_weights_norm", False)))
    ng, tg = m.a("expert_group_count"), m.a("expert_group_used_count")
    if v3:
        hf["architectures"] = ["DeepseekV3ForCausalLM"]
        hf.update(scoring_func="sigmoid", topk_method="noaux_tc", n_group=int(ng or 1),
                  topk_group=int(tg or 1), rope_interleave=True)
    else:
        if gating not in (None, 1):
            raise ConfigError(f"{where}: GGUF deepseek2.expert_gating_func={gating} without a "
                              f"selection bias is not supported")
        hf.update(scoring_func="softmax", topk_method="group_limited_greedy" if (ng or 1) > 1 else "greedy",
                  n_group=int(ng) if ng else None, topk_group=int(tg) if tg else None)


# ----------------------------------------------------------------------------- names

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "attn_q_a": "self_attn.q_a_proj",
         "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
         "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj",
         "ffn_down_shexp": "mlp.shared_experts.down_proj",
         "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_EXPS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def tensor_names(m: Meta, hf: dict, names: list[str], shapes: dict) -> dict:
    """{HF name: (GGUF name, expert index or None, row op)}; row op "q"/"k" = llama's rope
    permutation to undo, "kv_b" = MLA's attn_k_b + attn_v_b put back together."""
    out: dict[str, tuple] = {}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight", "output_norm.bias": "model.norm.bias",
           "output.bias": "lm_head.bias"}
    L = hf["num_hidden_layers"]
    for g in names:
        if g in top:
            out[top[g]] = (g, None, None)
            continue
        mt = _BLK.match(g)
        if not mt:
            continue                       # rope_freqs etc.: not weights of the causal LM
        i, base, kind = int(mt[1]), mt[2], mt[3]
        if i >= L:
            continue                       # GLM's MTP layers
        p = f"model.layers.{i}."
        if base in _EXPS:                  # gpt-oss's experts have biases too
            for e in range(shapes[g][0]):
                out[f"{p}mlp.experts.{e}.{_EXPS[base]}.{kind}"] = (g, e, None)
        elif base == "ffn_gate_up_exps":
            for e in range(shapes[g][0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = (g, e, "gate")
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = (g, e, "up")
        elif base == "attn_sinks":                     # gpt-oss: a logit per head
            out[f"{p}self_attn.sinks"] = (g, None, None)
        elif base == "ffn_gate_inp" and m.arch == "gpt-oss":     # its router has a bias
            out[f"{p}mlp.router.{kind}"] = (g, None, None)
        elif base == "exp_probs_b":
            out[f"{p}mlp.gate.e_score_correction_bias"] = (g, None, None)
        elif base in ("attn_k_b", "attn_v_b"):
            out[f"{p}self_attn.kv_b_proj.weight"] = (f"blk.{i}.attn_k_b.weight", None, "kv_b")
        elif base in _ATTN:
            op = None
            if m.arch in ("llama", "granitemoe") and base in ("attn_q", "attn_k") and kind == "weight":
                op = base[-1]
            out[f"{p}{_ATTN[base]}.{kind}"] = (g, None, op)
        elif base == "post_attention_norm":            # GLM / ERNIE name variants
            out[f"{p}post_attention_layernorm.weight"] = (g, None, None)
        else:
            raise ConfigError(f"GGUF: tensor {g} ({m.arch}) has no place in Colibri's model "
                              f"(unknown tensor name)")
    return out


def gguf_name_hint(hf_name: str) -> str:
    for g, h in _ATTN.items():
        if h in hf_name:
            return f"blk.N.{g}"
    return "the tensor"


def unpermute(a: np.ndarray, op: Optional[str], meta: Meta) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute on q ("q") / k ("k") rows (per head, rows
    (0, D/2, 1, D/2+1, ..) back to (0, 1, .., D-1)); "gate"/"up" halves of a fused
    gate_up expert tensor."""
    if op is None:
        return a
    if op in ("gate", "up"):
        h = a.shape[0] // 2
        return np.ascontiguousarray(a[:h] if op == "gate" else a[h:])
    n = int(meta.a("attention.head_count"))
    if op == "k":
        kv = meta.a("attention.head_count_kv")
        n = int(kv) if kv else n
    rows = a.shape[0]
    return np.ascontiguousarray(a.reshape(n, rows // n // 2, 2, *a.shape[1:]).swapaxes(1, 2)
                                .reshape(a.shape))
