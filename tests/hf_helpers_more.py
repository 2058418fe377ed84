"""Tiny random models of the families added by issue 32 (Granite MoE, GLM-4.5, ERNIE-4.5), built
locally as hf_helpers.make_hf_model builds the first six, and Colibri's dequantized weights
written back into them (Granite's tensor names differ from the others'). Also what the
family conversion tests share beyond hf_helpers: the norms and head written back, q/k rows
back in a checkpoint's interleaved rope order, a patched config refused at convert time."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import hf_helpers
from colibri_core.convert import convert
from colibri_core.errors import ConfigError
from hf_helpers import _deq, effective, load_dequantized_into

MORE_FAMILIES = ("granitemoe", "granitemoeshared", "glm4_moe", "ernie4_5_moe")


def make_more_model(family: str, seed: int = 0, **over):
    """A small random-weight model of `family` (init as hf_helpers.make_hf_model), every
    feature of the family on: Granite's four multipliers away from 1 and its shared
    expert; GLM's partial rotary, q/k/v biases, q/k norms, expert groups with the
    correction bias, a shared expert and a dense first layer; ERNIE's interleaved rope,
    the correction bias on the softmax probabilities, shared experts, a dense first layer
    and tied embeddings."""
    torch, tr = hf_helpers._imports()
    common = dict(vocab_size=300, hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family in ("granitemoe", "granitemoeshared"):
        kw = dict(common, intermediate_size=160, num_local_experts=6, num_experts_per_tok=2,
                  embedding_multiplier=12.0, attention_multiplier=0.03, residual_multiplier=0.22,
                  logits_scaling=6.0)
        if family == "granitemoeshared":
            kw["shared_intermediate_size"] = 224
        kw.update(over)
        shared = family == "granitemoeshared"
        cfg = (tr.GraniteMoeSharedConfig if shared else tr.GraniteMoeConfig)(**kw)
        cls = tr.GraniteMoeSharedForCausalLM if shared else tr.GraniteMoeForCausalLM
    elif family == "glm4_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=96, n_routed_experts=8,
                  num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, head_dim=64)
        kw.update(over)
        cfg, cls = tr.Glm4MoeConfig(**kw), tr.Glm4MoeForCausalLM
    elif family == "ernie4_5_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=96, moe_num_experts=8,
                  moe_k=3, moe_num_shared_experts=1, moe_layer_start_index=1,
                  moe_layer_end_index=2, tie_word_embeddings=True)
        kw.update(over)
        cfg, cls = tr.Ernie4_5_MoeConfig(**kw), tr.Ernie4_5_MoeForCausalLM
    else:
        raise ValueError(family)
    return hf_helpers.random_model(cfg, cls, seed)


def load_dequantized_more(model, colibri_dir: Path):
    """hf_helpers.load_dequantized_into for these families (Granite's names: the router
    `block_sparse_moe.router.weight`, the shared expert's fused `shared_mlp.input_linear`)."""
    if "glm4" in type(model).__name__.lower():
        return load_dequantized_into(model, colibri_dir)
    if "ernie" in type(model).__name__.lower():
        return _load_ernie(model, colibri_dir)
    torch, _ = hf_helpers._imports()
    from colibri_core.model.weights import load_model
    w = load_model(colibri_dir)
    sd = model.state_dict()

    def put(name, arr):
        sd[name].copy_(torch.from_numpy(np.array(arr, np.float32).reshape(sd[name].shape)))

    put_head_and_norms(put, w, "lm_head.weight" in sd and not w.cfg.tie_word_embeddings)
    for lw in w.layers:
        q, a = f"model.layers.{lw.index}.", lw.attn
        for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            put(q + f"self_attn.{n}.weight", effective(getattr(a, s), a.act_scales.get(s)))
        m = q + "block_sparse_moe."
        put(m + "router.weight", lw.router)
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        hf_helpers.put_fused_experts(gu, dn, lw.experts)
        if lw.shared is not None:
            f, s = lw.shared, lw.shared.act_scales
            put(q + "shared_mlp.input_linear.weight",
                np.concatenate([effective(f.w1, s.get("w1")), effective(f.w3, s.get("w3"))], axis=0))
            put(q + "shared_mlp.output_linear.weight", effective(f.w2, s.get("w2")))
    w.close()
    return model


def _load_ernie(model, colibri_dir: Path):
    """ERNIE: q/k rows back in the checkpoint's interleaved order, the correction bias
    under `gate.moe_statics`."""
    torch, _ = hf_helpers._imports()
    from colibri_core.config import load_model_config
    D = load_model_config(Path(colibri_dir) / "config.json").head_size
    state = model.state_dict()
    sd = {k.replace("mlp.gate.moe_statics.", "mlp.gate."): v for k, v in state.items()}

    class _Wrap:                           # load_dequantized_into writes through state_dict()
        def state_dict(self):
            return sd
    load_dequantized_into(_Wrap(), colibri_dir)
    for k, v in state.items():
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            v.copy_(torch.from_numpy(interleave(v.numpy(), D)))
    return model


def put_head_and_norms(put, w, lm_head: bool = True) -> None:
    """The embedding, the lm_head (unless told not to: tied), the final norm and each
    layer's two norms of Colibri's model `w`, by `put(name, array)` under Llama's names."""
    put("model.embed_tokens.weight", _deq(w.embed))
    if lm_head:
        put("lm_head.weight", _deq(w.lm_head))
    put("model.norm.weight", w.final_norm)
    for lw in w.layers:
        q = f"model.layers.{lw.index}."
        put(q + "input_layernorm.weight", lw.attn_norm)
        put(q + "post_attention_layernorm.weight", lw.ffn_norm)


def interleave(a, head_size: int) -> np.ndarray:
    """q/k rows (or biases) of heads of `head_size` back in a checkpoint's interleaved rope
    order: the inverse of families.Src.deinterleave."""
    h = np.asarray(a).reshape(-1, 2, head_size // 2, *np.shape(a)[1:])
    return np.swapaxes(h, 1, 2).reshape(np.shape(a))


def assert_refused_at_convert(hf: Path, tmp_path: Path, patch: dict, needle: str) -> Path:
    """A copy of checkpoint `hf` (at tmp_path/hf, returned) with `patch` in its config.json
    is refused by convert in one ConfigError line containing `needle`, writing nothing."""
    d = tmp_path / "hf"
    shutil.copytree(hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not supported") as e:
        convert(d, tmp_path / "out")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    return d
