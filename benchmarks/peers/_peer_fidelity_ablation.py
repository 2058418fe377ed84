"""Where the 4-bit logit error comes from, per tensor role, for Colibri q4 and llama.cpp
Q4_0, on bench_vs_llamacpp.py's cached benchmark model (run that first).

    python -m benchmarks.peers._peer_fidelity_ablation [--prompts 2] [--threads 2]

For each format and each role (embed, attn_q, attn_k, attn_v, attn_o, router, experts,
lm_head, all), the float32 transformers model of the fp16 checkpoint gets that role's
weights replaced by the format's dequantized weights (Colibri: colibri_core.format.quant
dequantize of the converted files, AWQ/act scales none here; llama.cpp: gguf.quants
dequantize of the Q4_0 GGUF, Q/K rows un-permuted), and the logits of the same prompts as
the benchmark's fidelity check are compared to the unmodified model's (rel. RMS). Also the
weight-level relative RMS error of each role. Writes benchmarks/out/vs_llamacpp_ablation.json.
Engine arithmetic (int8 activations, fixed-point routing, f16 activations in llama.cpp) is
not included: only the stored weights.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.peers.bench_vs_llamacpp import OUT, WORK, logit_errors

ROLE_HF = {"attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
           "attn_v": "self_attn.v_proj.weight", "attn_o": "self_attn.o_proj.weight",
           "router": "mlp.gate.weight"}


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of _permute_qk: (head, pair, 2) rows back to (head, 2, half)
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class Colibri:
    name = "colibri q4"

    def __init__(self, path: Path):
        from colibri_core.model.weights import load_model
        self.w = load_model(path)

    @staticmethod
    def deq(t) -> np.ndarray:
        from colibri_core.model.ops import float_matrix     # q4, q6, q8, bf16 or float -> float32
        return float_matrix(t)

    def get(self, role: str, layer: int | None = None, expert: int | None = None, which=None):
        if role == "embed":
            return self.deq(self.w.embed)
        if role == "lm_head":
            return self.deq(self.w.lm_head)
        lw = self.w.layers[layer]
        if role == "router":
            return np.asarray(lw.router, np.float32)
        if role.startswith("attn_"):
            return self.deq(getattr(lw.attn, {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
                                              "attn_o": "wo"}[role]))
        return self.deq(getattr(lw.experts[expert].ffn, which))


class Q40:
    name = "llama.cpp Q4_0"

    def __init__(self, path: Path, nh: int, nkv: int):
        import gguf
        self.r = gguf.GGUFReader(str(path))
        self.t = {t.name: t for t in self.r.tensors}
        self.nh, self.nkv = nh, nkv
        self._cache = {}

    def _deq(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize
        if name not in self._cache:
            t = self.t[name]
            self._cache = {name: dequantize(t.data, t.tensor_type).astype(np.float32)}
        return self._cache[name]

    def get(self, role: str, layer: int | None = None, expert: int | None = None, which=None):
        if role == "embed":
            return self._deq("token_embd.weight")
        if role == "lm_head":
            return self._deq("output.weight")
        b = f"blk.{layer}."
        if role == "router":
            return self._deq(b + "ffn_gate_inp.weight")
        if role == "attn_q":
            return _unpermute_qk(self._deq(b + "attn_q.weight"), self.nh)
        if role == "attn_k":
            return _unpermute_qk(self._deq(b + "attn_k.weight"), self.nkv)
        if role == "attn_v":
            return self._deq(b + "attn_v.weight")
        if role == "attn_o":
            return self._deq(b + "attn_output.weight")
        name = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}[which]
        return self._deq(b + name + ".weight")[expert]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch
    import transformers as tr
    torch.set_num_threads(a.threads)
    hf = WORK / "hf_f16"
    model = tr.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    cfg = model.config
    L, E = cfg.num_hidden_layers, cfg.num_local_experts
    sd = model.state_dict()
    orig = {k: v.clone() for k, v in sd.items()}
    rng = np.random.default_rng(1)          # the benchmark's fidelity prompts (first ones)
    prompts = [rng.integers(3, cfg.vocab_size, a.prompt).tolist() for _ in range(a.prompts)]

    def logits():
        with torch.inference_mode():
            return np.stack([model(torch.tensor([p])).logits[0].numpy() for p in prompts])

    ref = logits()
    fmts = [Colibri(WORK / "colibri_q4"), Q40(WORK / "model-q4_0.gguf", cfg.num_attention_heads,
                                              cfg.num_key_value_heads)]
    roles = ["embed", "attn_q", "attn_k", "attn_v", "attn_o", "router", "experts", "lm_head"]
    res = {"prompts": a.prompts, "weights": {}, "logits": {}}

    def targets(role):
        """(state-dict key, index or None, getter kwargs) for every tensor of a role."""
        if role == "embed":
            return [("model.embed_tokens.weight", None, dict(role="embed"))]
        if role == "lm_head":
            return [("lm_head.weight", None, dict(role="lm_head"))]
        out = []
        for i in range(L):
            p = f"model.layers.{i}.mlp.experts."
            if role == "experts":
                for e in range(E):
                    out.append((p + "gate_up_proj", (e, "gate"), dict(role="experts", layer=i, expert=e, which="w1")))
                    out.append((p + "gate_up_proj", (e, "up"), dict(role="experts", layer=i, expert=e, which="w3")))
                    out.append((p + "down_proj", (e, None), dict(role="experts", layer=i, expert=e, which="w2")))
            else:
                out.append((f"model.layers.{i}.{ROLE_HF[role]}", None, dict(role=role, layer=i)))
        return out

    def put(key, idx, w):
        t = sd[key]
        if idx is None:
            t.copy_(torch.from_numpy(w.reshape(t.shape)))
            return
        e, half = idx
        inter = cfg.intermediate_size
        if half == "gate":
            t[e, :inter].copy_(torch.from_numpy(w))
        elif half == "up":
            t[e, inter:].copy_(torch.from_numpy(w))
        else:
            t[e].copy_(torch.from_numpy(w))

    def restore():
        for k, v in orig.items():
            sd[k].copy_(v)

    def ref_of(key, idx):
        t = orig[key]
        if idx is None:
            return t.numpy()
        e, half = idx
        inter = cfg.intermediate_size
        return (t[e, :inter] if half == "gate" else t[e, inter:] if half == "up" else t[e]).numpy()

    for f in fmts:
        res["weights"][f.name], res["logits"][f.name] = {}, {}
        for role in roles:                   # one role quantized at a time
            num = den = 0.0
            for key, idx, kw in targets(role):
                w = f.get(**kw)
                r = ref_of(key, idx)
                num += float(((w - r) ** 2).sum())
                den += float((r ** 2).sum())
                put(key, idx, w)
            res["weights"][f.name][role] = (num / den) ** 0.5
            res["logits"][f.name][role] = logit_errors(logits(), ref)["rel_rms"]
            print(f"{f.name:15s} {role:8s} weight rel RMS {res['weights'][f.name][role]:.4f}  "
                  f"logit rel RMS with only this role quantized {res['logits'][f.name][role]:.4f}",
                  flush=True)
            restore()
        for role in roles:                   # every role quantized
            for key, idx, kw in targets(role):
                put(key, idx, f.get(**kw))
        res["logits"][f.name]["all"] = logit_errors(logits(), ref)["rel_rms"]
        print(f"{f.name:15s} all roles: logit rel RMS {res['logits'][f.name]['all']:.4f}", flush=True)
        restore()
    (OUT / "vs_llamacpp_ablation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
