"""A Qwen2-MoE Hugging Face checkpoint's tensors as llama.cpp's `qwen2moe` graph reads them
(GGUF names and layout): what benchmarks/peers/_qwen2moe_gguf.py writes as an F32 GGUF for
the fidelity comparisons on the trained models (precision_sensitivity.py), and what
tests/test_qwen2moe_gguf.py checks against the transformers module.

llama.cpp's qwen2moe builds every layer as MoE (routed experts of one width, softmax
weights not renormalized, plus a shared expert behind a sigmoid gate); our trained models
have a dense first layer. That layer is written as an MoE layer that computes exactly the
dense FFN:

- every routed expert is the dense FFN itself, its down projection scaled by E / k, and
  the router is zero: softmax gives each expert 1/E, any k of them sum to 1/E * k * E/k = 1
  (E / k is a power of two for both models, so the scaling is exact in F32, and Q4_0's
  per-block scale absorbs it exactly);
- the shared expert's weights are zero (its gate vector a tiny constant: llama.cpp's
  sigmoid is silu(x) / x, which a zero vector would make 0 / 0).

The routed experts' width is the larger of the dense and the MoE widths; narrower experts
are padded with zero rows (gate, up) and zero columns (down). A zero row gives silu(0) * 0
= 0 and the padded columns are whole 32-value blocks of zeros (both widths are multiples
of 32), so the padding adds nothing to any sum and Q4_0 quantizes every real block as it
would unpadded. The result is llama.cpp running *this* model, at the cost of larger
tensors; it is for fidelity only, never for timing.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class Checkpoint:
    """The checkpoint's tensors by name (one or several safetensors files), as float32."""

    def __init__(self, hf: Path):
        from safetensors import safe_open
        files = sorted(hf.glob("*.safetensors"))
        if not files:
            raise SystemExit(f"{hf}: no *.safetensors files")
        self._where = {}
        self._open = [safe_open(str(f), "np") for f in files]
        for h in self._open:
            for k in h.keys():
                self._where[k] = h

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self._where[name].get_tensor(name), np.float32)


def _experts(ck: Checkpoint, L: int, E: int):
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of layer L's routed experts."""
    p = f"model.layers.{L}.mlp.experts"
    if f"{p}.gate_up_proj" in ck:                 # transformers 5's fused layout
        gu, down = ck[f"{p}.gate_up_proj"], ck[f"{p}.down_proj"]
        I = gu.shape[1] // 2
        return gu[:, :I], gu[:, I:], down
    st = lambda n: np.stack([ck[f"{p}.{e}.{n}.weight"] for e in range(E)])  # noqa: E731
    return st("gate_proj"), st("up_proj"), st("down_proj")


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:          # [..., I, H] -> [..., n, H]
    pad = [(0, 0)] * a.ndim
    pad[-2] = (0, n - a.shape[-2])
    return np.pad(a, pad)


def _pad_cols(a: np.ndarray, n: int) -> np.ndarray:          # [..., H, I] -> [..., H, n]
    pad = [(0, 0)] * a.ndim
    pad[-1] = (0, n - a.shape[-1])
    return np.pad(a, pad)


def qwen2moe_tensors(hf: Path):
    """(hparams, summary, tensors) of the checkpoint in `hf` as llama.cpp's qwen2moe graph
    reads it: hparams the GGUF keys' values, tensors an iterator of (GGUF name, float32
    array in row-major [.., rows, cols] order) with the dense layers rewritten (above)."""
    c = json.loads((hf / "config.json").read_text())
    if c.get("model_type") != "qwen2_moe":
        raise SystemExit(f"{hf}: model_type {c.get('model_type')!r}, expected 'qwen2_moe'")
    if c.get("norm_topk_prob"):
        raise SystemExit(f"{hf}: norm_topk_prob is true; llama.cpp's qwen2moe never renormalizes")
    H, L = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv, V = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    E, K = c["num_experts"], c["num_experts_per_tok"]
    I_moe, S = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    D = c["intermediate_size"]
    if H % nh or (c.get("head_dim") or H // nh) != H // nh:
        raise SystemExit(f"{hf}: head_dim must be hidden_size / num_attention_heads for qwen2moe")
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    ck = Checkpoint(hf)
    dense = [i for i in range(L) if f"model.layers.{i}.mlp.gate_proj.weight" in ck]
    width = max([I_moe] + [D] * bool(dense))
    for n in {width, I_moe, D, S}:
        if n % 32:
            raise SystemExit(f"{hf}: FFN width {n} is not a multiple of 32 (Q4_0's block)")
    scale = E / K
    if scale != 2.0 ** round(np.log2(scale)):
        raise SystemExit(f"{hf}: num_experts / num_experts_per_tok = {scale}: not a power of two, "
                         "so the dense layer's rewrite would not be exact")
    hp = dict(context_length=c["max_position_embeddings"], embedding_length=H, block_count=L,
              feed_forward_length=D, head_count=nh, head_count_kv=nkv,
              layer_norm_rms_eps=c["rms_norm_eps"], rope_freq_base=float(theta),
              expert_count=E, expert_used_count=K, expert_feed_forward_length=width,
              expert_shared_feed_forward_length=S, vocab_size=V)
    summary = {"dense_layers": dense, "expert_width": width, "moe_width": I_moe, "dense_width": D}

    def tensors():
        yield "token_embd.weight", ck["model.embed_tokens.weight"]
        yield "output_norm.weight", ck["model.norm.weight"]
        head = "lm_head.weight" if "lm_head.weight" in ck else "model.embed_tokens.weight"
        yield "output.weight", ck[head]
        for i in range(L):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            yield b + "attn_norm.weight", ck[p + "input_layernorm.weight"]
            for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                yield b + f"attn_{ours}.weight", ck[p + f"self_attn.{theirs}.weight"]
                if p + f"self_attn.{theirs}.bias" in ck:
                    yield b + f"attn_{ours}.bias", ck[p + f"self_attn.{theirs}.bias"]
            yield b + "attn_output.weight", ck[p + "self_attn.o_proj.weight"]
            yield b + "ffn_norm.weight", ck[p + "post_attention_layernorm.weight"]
            if i in dense:
                g, u, d = (ck[p + f"mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
                gate = np.broadcast_to(_pad_rows(g, width), (E, width, H))
                up = np.broadcast_to(_pad_rows(u, width), (E, width, H))
                down = np.broadcast_to(_pad_cols(d * np.float32(scale), width), (E, H, width))
                router = np.zeros((E, H), np.float32)
                s_gate = s_up = np.zeros((S, H), np.float32)
                s_down = np.zeros((H, S), np.float32)
                s_inp = np.full(H, 1e-20, np.float32)
            else:
                gate, up, down = _experts(ck, i, E)
                gate, up, down = _pad_rows(gate, width), _pad_rows(up, width), _pad_cols(down, width)
                router = ck[p + "mlp.gate.weight"]
                s_gate, s_up, s_down = (ck[p + f"mlp.shared_expert.{n}.weight"]
                                        for n in ("gate_proj", "up_proj", "down_proj"))
                s_inp = ck[p + "mlp.shared_expert_gate.weight"].reshape(H)
            yield b + "ffn_gate_inp.weight", router
            yield b + "ffn_gate_exps.weight", np.ascontiguousarray(gate)
            yield b + "ffn_up_exps.weight", np.ascontiguousarray(up)
            yield b + "ffn_down_exps.weight", np.ascontiguousarray(down)
            yield b + "ffn_gate_inp_shexp.weight", s_inp
            yield b + "ffn_gate_shexp.weight", s_gate
            yield b + "ffn_up_shexp.weight", s_up
            yield b + "ffn_down_shexp.weight", s_down
    return hp, summary, tensors()
