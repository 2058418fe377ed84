"""Tiny random Hugging Face MoE models built locally (no hub), and the way back:
writing Colibri's dequantized weights into a transformers model, so kernel/layout bugs
are separated from quantization loss."""
from __future__ import annotations

from pathlib import Path

import numpy as np

torch = None
transformers = None


def _imports():
    global torch, transformers
    if torch is None:
        import torch as _t
        import transformers as _tr
        torch, transformers = _t, _tr
    return torch, transformers


def make_hf_model(family: str, seed: int = 0, **over):
    """A small random-weight model of `family` with init scales near 1/sqrt(hidden), so
    router logits are not all near zero. Returns the (eval-mode, float32) model."""
    torch, tr = _imports()
    common = dict(vocab_size=300, hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family == "qwen2_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=160,
                  shared_expert_intermediate_size=224, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[0], norm_topk_prob=False)
        kw.update(over)
        cfg, cls = tr.Qwen2MoeConfig(**kw), tr.Qwen2MoeForCausalLM
    elif family == "mixtral":
        kw = dict(common, intermediate_size=200, num_local_experts=4, num_experts_per_tok=2)
        kw.update(over)
        cfg, cls = tr.MixtralConfig(**kw), tr.MixtralForCausalLM
    elif family == "qwen3_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=160, num_experts=6,
                  num_experts_per_tok=2, head_dim=48, norm_topk_prob=True)
        kw.update(over)
        cfg, cls = tr.Qwen3MoeConfig(**kw), tr.Qwen3MoeForCausalLM
    elif family == "olmoe":
        kw = dict(common, intermediate_size=160, num_experts=8, num_experts_per_tok=4)
        kw.update(over)
        cfg, cls = tr.OlmoeConfig(**kw), tr.OlmoeForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    H = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                fan_in = p.shape[-1]
                p.normal_(0.0, 1.0 / np.sqrt(fan_in))
    return model


def save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_dequantized_into(model, colibri_dir: Path):
    """Copy Colibri's dequantized weights back into the Hugging Face `model` (in place)."""
    torch, _ = _imports()
    from colibri_core.quant import Q4Tensor, Q8Tensor, dequantize_q4, dequantize_q8
    from colibri_core.weights import load_model

    def deq(t):
        if isinstance(t, Q4Tensor):
            return dequantize_q4(t)
        if isinstance(t, Q8Tensor):
            return dequantize_q8(t)
        return np.asarray(t, np.float64)

    w = load_model(colibri_dir)
    sd = model.state_dict()

    def put(name, arr):
        sd[name].copy_(torch.from_numpy(np.asarray(arr, np.float32).reshape(sd[name].shape)))

    put("model.embed_tokens.weight", deq(w.embed))
    put("lm_head.weight", deq(w.lm_head))
    for lw in w.layers:
        q = f"model.layers.{lw.index}."
        for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            put(q + f"self_attn.{n}.weight", deq(getattr(lw.attn, s)))
        if lw.kind == "dense":
            for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                put(q + f"mlp.{n}.weight", deq(getattr(lw.dense, s)))
        else:
            gu = sd[q + "mlp.experts.gate_up_proj"]
            dn = sd[q + "mlp.experts.down_proj"]
            for ex in lw.experts:
                g = np.concatenate([deq(ex.ffn.w1), deq(ex.ffn.w3)], axis=0)
                gu[ex.index].copy_(torch.from_numpy(g.astype(np.float32)))
                dn[ex.index].copy_(torch.from_numpy(deq(ex.ffn.w2).astype(np.float32)))
            if lw.shared is not None:
                for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    put(q + f"mlp.shared_expert.{n}.weight", deq(getattr(lw.shared, s)))
    w.close()
    return model


def hf_logits(model, ids) -> np.ndarray:
    torch, _ = _imports()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double().numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    torch, _ = _imports()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0][len(ids):].tolist()


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())
