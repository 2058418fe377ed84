"""qwen2moe_helpers.py, the tensors precision_sensitivity.py gives llama.cpp: each
FFN computed the way llama.cpp's qwen2moe graph computes it (softmax router, the top-k
weights not renormalized, the shared expert behind silu(t) / t), in float64 from those
tensors, equals the transformers module's output -- the dense first layer's rewrite as an
MoE layer included, whichever k experts a tie picks."""
from __future__ import annotations

import numpy as np
import pytest

from hf_helpers import make_hf_model, save
from qwen2moe_helpers import qwen2moe_tensors


def silu(v):
    return v / (1.0 + np.exp(-v))


def llamacpp_ffn(T: dict, layer: int, x: np.ndarray, k: int, ties: str) -> np.ndarray:
    """llama.cpp's qwen2moe FFN of one token (build_moe_ffn + the shared expert branch).
    Equal router probabilities are broken toward the low (`ties="low"`) or high indices."""
    b = f"blk.{layer}."
    f = {n: np.asarray(a, np.float64) for n, a in T.items() if n.startswith(b)}
    logits = f[b + "ffn_gate_inp.weight"] @ x
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.lexsort((np.arange(len(p)) * (1 if ties == "low" else -1), -p))
    out = np.zeros_like(x)
    for e in order[:k]:
        h = silu(f[b + "ffn_gate_exps.weight"][e] @ x) * (f[b + "ffn_up_exps.weight"][e] @ x)
        out += p[e] * (f[b + "ffn_down_exps.weight"][e] @ h)
    t = f[b + "ffn_gate_inp_shexp.weight"] @ x
    h = silu(f[b + "ffn_gate_shexp.weight"] @ x) * (f[b + "ffn_up_shexp.weight"] @ x)
    return out + silu(t) / t * (f[b + "ffn_down_shexp.weight"] @ h)


@pytest.mark.parametrize("fused", [False, True])
def test_qwen2moe_tensors_compute_the_checkpoints_ffns(tmp_path, fused):
    import torch
    model = make_hf_model("qwen2_moe", num_experts=8)       # layer 0 dense, E / k = 4
    hf = save(model, tmp_path / "hf", fused=fused)
    hp, summary, tensors = qwen2moe_tensors(hf)
    T = dict(tensors)
    assert summary["dense_layers"] == [0]
    assert hp["expert_feed_forward_length"] == max(model.config.intermediate_size,
                                                   model.config.moe_intermediate_size)
    k = model.config.num_experts_per_tok
    x = np.random.default_rng(0).standard_normal((4, model.config.hidden_size)).astype(np.float32)
    for layer in range(model.config.num_hidden_layers):
        with torch.no_grad():
            ref = model.model.layers[layer].mlp(torch.from_numpy(x)[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0].double().numpy()
        for ties in ("low", "high"):
            got = np.stack([llamacpp_ffn(T, layer, row.astype(np.float64), k, ties) for row in x])
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err < 1e-5, (layer, ties, err)
