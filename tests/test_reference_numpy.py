"""An independent float64 numpy reference of the whole forward pass.

It imports nothing from the engine but the file reader (ContainerFile), and unpacks the
INT4/INT8 layout itself from docs/FORMAT.md, so a packing bug cannot hide in a shared
helper. It covers what transformers cannot check alone: the INT4 packing as read from disk
and the fixed-point router.
"""
import json

import numpy as np
import pytest

from colibri_core.format.modelfile import ContainerFile


def _unpack(data):                                    # FORMAT.md nibble order, written anew
    rows, half = data.shape
    out = np.empty((rows, half * 2), np.int64)
    for b in range(half // 32):
        chunk = data[:, 32 * b:32 * b + 32].astype(np.int64)
        out[:, 64 * b:64 * b + 32] = chunk & 15
        out[:, 64 * b + 32:64 * b + 64] = chunk >> 4
    return out


def _deq(f, name):
    s = f.sections[name]
    if s.dtype == "f32":
        return np.asarray(f.tensor(name), np.float64)
    rows, cols = s.shape
    G = s.group_size
    cp = -(-cols // G) * G
    raw = f.buf
    o, n = s.parts["data"]
    so, sn = s.parts["scales"]
    scales = np.frombuffer(raw[so:so + sn].tobytes(), np.float32).reshape(rows, cp // G).astype(np.float64)
    if s.dtype == "q8":
        q = np.frombuffer(raw[o:o + n].tobytes(), np.int8).reshape(rows, cp).astype(np.float64)
        return (q * np.repeat(scales, G, 1))[:, :cols]
    zo, zn = s.parts["zeros"]
    zeros = np.frombuffer(raw[zo:zo + zn].tobytes(), np.uint8).reshape(rows, cp // G).astype(np.float64)
    q = _unpack(np.frombuffer(raw[o:o + n].tobytes(), np.uint8).reshape(rows, cp // 2))
    return ((q - np.repeat(zeros, G, 1)) * np.repeat(scales, G, 1))[:, :cols]


def reference_forward(model_dir, ids, k=None):
    """float64 logits [n, V] and per-MoE-layer router logits of the last token."""
    cfg = json.loads((model_dir / "config.json").read_text())
    main = ContainerFile(model_dir / "model.bin")
    routing = ContainerFile(model_dir / "routing.bin")
    H, nh, nkv = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"]
    D = cfg["head_dim"] or H // nh
    k = k or cfg["top_k"]
    eps = cfg["rms_norm_eps"]
    n = len(ids)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def ffn(x, w1, w3, w2):
        g, u = x @ w1.T, x @ w3.T
        return (g / (1 + np.exp(-g)) * u) @ w2.T

    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, D, 2) / D)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], 1)), np.sin(np.concatenate([ang, ang], 1))

    def rope(x):                                          # x [n, heads, D]
        rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = _deq(main, "embed")[ids]
    router_logits = []
    for L, kind in enumerate(cfg["layer_types"]):
        p = f"layer.{L}."
        h = norm(x, _deq(main, p + "attn_norm"))
        q = rope((h @ _deq(main, p + "wq").T).reshape(n, nh, D))
        kk = rope((h @ _deq(main, p + "wk").T).reshape(n, nkv, D))
        v = (h @ _deq(main, p + "wv").T).reshape(n, nkv, D)
        att = np.zeros((n, nh, D))
        for hh in range(nh):
            kv = hh // (nh // nkv)
            s = q[:, hh] @ kk[:, kv].T / np.sqrt(D)
            s[np.triu_indices(n, 1)] = -np.inf
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, hh] = (s / s.sum(1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(n, nh * D) @ _deq(main, p + "wo").T
        h = norm(x, _deq(main, p + "ffn_norm"))
        if kind == "dense":
            x = x + ffn(h, _deq(main, p + "w1"), _deq(main, p + "w3"), _deq(main, p + "w2"))
            continue
        logits = h @ _deq(routing, p + "router").T
        router_logits.append(logits[-1])
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(n):
            top = np.argsort(-logits[t], kind="stable")[:k]
            w = probs[t, top]
            if cfg["norm_topk_prob"]:
                w = w / w.sum()
            for e, we in zip(top, w):
                f = ContainerFile(model_dir / f"expert_{L}_{e}.bin")
                out[t] += we * ffn(h[t:t + 1], _deq(f, "w1"), _deq(f, "w3"), _deq(f, "w2"))[0]
                f.close()
        if cfg["shared_expert_intermediate_size"]:
            sh = ffn(h, _deq(main, p + "shared_w1"), _deq(main, p + "shared_w3"), _deq(main, p + "shared_w2"))
            if cfg["shared_expert_gate"]:
                sh = sh / (1 + np.exp(-(h @ _deq(main, p + "shared_gate").T)))
            out += sh
        x = x + out
    x = norm(x, _deq(main, "final_norm"))
    return x @ _deq(main, "lm_head").T, router_logits


@pytest.mark.parametrize("k", [1, 2, 4])
def test_engine_float_path_matches_float64_reference(tiny_model_dir, k):
    from colibri_core.engine import Engine
    ids = [3, 14, 15, 92, 65, 35]
    ref, _ = reference_forward(tiny_model_dir, ids, k)
    with Engine.from_model_dir(tiny_model_dir, routing="float", activations="float") as eng:
        got = eng.next_token_logits(ids, experts_per_token=k, all_positions=True)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, err


def test_fixed_point_router_weights_against_float64(tiny_model_dir):
    from colibri_core.engine import Engine
    ids = [7, 1, 200, 45]
    _, router_logits = reference_forward(tiny_model_dir, ids)
    with Engine.from_model_dir(tiny_model_dir, routing="fixed", activations="float") as eng:
        eng.next_token_logits(ids)
        traces = eng.model.last_routing
    for tr, ref_logits in zip(traces, router_logits):
        p = np.exp(ref_logits - ref_logits.max())
        p /= p.sum()
        ids_ = tr.routing.ids[-1]
        w = p[ids_] / p[ids_].sum()                     # norm_topk_prob
        assert list(ids_) == list(np.argsort(-ref_logits, kind="stable")[:2])
        assert np.abs(tr.routing.weights[-1] - w).max() <= 0.003


def test_default_fast_path_close_to_reference(tiny_model_dir):
    from colibri_core.engine import Engine
    ids = [3, 14, 15, 92, 65, 35]
    ref, _ = reference_forward(tiny_model_dir, ids)
    with Engine.from_model_dir(tiny_model_dir) as eng:
        got = eng.next_token_logits(ids, all_positions=True)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 0.05, err      # int8 activations + fixed-point routing; measured ~1e-2
