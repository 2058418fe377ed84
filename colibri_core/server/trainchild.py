"""The training job's child process (server/training.py starts it at `nice 10`):

    python -m colibri_core.server.trainchild SPEC.json

SPEC names the model folder, the examples (JSON lines of {prompt, target, route}), the
expert's name, version and layer, the recipe's settings, and where to write the .so and a
result JSON. The child captures each example's features at its last position with the
reference forward (forward/reference.py: the model's experts, frozen), trains the expert
with authoring/recipe.py (the fraud example's recipe), builds it for this model
(authoring/builder.py, the model's fingerprint recorded) and writes the result. Any failure
is one line on stderr (the job's reason) and exit status 1.

It lives in server/ because it needs the forward pass, which sits above experts/.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..config import EngineConfig
from ..experts.hotplug.authoring import recipe
from ..experts.hotplug.authoring.builder import build_expert
from ..format.quant import dequantize_q4, quantize_q4
from ..forward.reference import ReferenceModel
from ..model import ops
from ..model.fingerprint import fingerprint_of_dir
from ..model.weights import load_model


class TrainError(Exception):
    """A job that cannot run: its one-line reason."""


class _Capture(ReferenceModel):
    """The reference forward, keeping layer L's MoE input (h) and normalised input (xn)."""

    def __init__(self, weights, layer: int):
        # float activations, as the example's recipe (transformers on the dequantized
        # weights): the expert is trained beside the weights it runs with
        super().__init__(weights, EngineConfig(activations="float"))
        self._cap_w, self._cap_layer = weights.layers[layer].ffn_norm, layer
        self._floats: dict = {}
        self.got = None

    def _moe(self, lw, xn, k_tok, es):
        if lw.index == self._cap_layer:       # captured already; its output is not used
            return np.zeros_like(xn)
        return super()._moe(lw, xn, k_tok, es)

    def linear(self, w, x, act_scale=None):
        """x @ w^T in float32, each matrix dequantized once (not once per batch)."""
        if act_scale is not None:
            x = x / act_scale
        got = self._floats.get(id(w))
        if got is None:
            got = self._floats[id(w)] = (w, np.ascontiguousarray(ops.float_matrix(w).T))
        return np.asarray(x, np.float32) @ got[1]

    def _attention(self, lw, xn, pos, spans):
        """Every span the same length from an empty cache, plain causal attention: one
        batched product instead of a Python loop over spans (the reference's, fallback)."""
        cfg, a = self.cfg, lw.attn
        n = spans[0][1] - spans[0][0]
        if cfg.attention == "mla" or a.sinks is not None or any(cfg.attention_span(lw.index)) \
                or any(t1 - t0 != n or c.length for t0, t1, c in spans) \
                or lw.index in cfg.nope_layers or cfg.qk_norm == "l2":
            return super()._attention(lw, xn, pos, spans)
        T, D, NH, NKV = xn.shape[0], cfg.head_size, cfg.num_heads, cfg.num_kv_heads
        acts = a.act_scales
        q, k, v = (self.linear(a.wq, xn, acts.get("wq")), self.linear(a.wk, xn, acts.get("wk")),
                   self.linear(a.wv, xn, acts.get("wv")))
        if a.bq is not None:
            q, k, v = q + a.bq, k + a.bk, v + a.bv
        if cfg.qk_norm == "full":
            q, k = self._rmsnorm(q, a.q_norm), self._rmsnorm(k, a.k_norm)
        q, k, v = q.reshape(T, NH, D), k.reshape(T, NKV, D), v.reshape(T, NKV, D)
        if cfg.qk_norm == "per_head":
            q, k = self._rmsnorm(q, a.q_norm), self._rmsnorm(k, a.k_norm)
        q = ops.apply_rope(q, pos, self._inv_freq, self._rope_factor)
        k = ops.apply_rope(k, pos, self._inv_freq, self._rope_factor)
        B, G = T // n, NH // NKV
        qs = q.reshape(B, n, NKV, G, D)
        sc = np.einsum("btkgd,bskd->bkgts", qs, k.reshape(B, n, NKV, D)) * np.float32(
            cfg.attention_multiplier or 1.0 / np.sqrt(D))
        sc = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, sc)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
        out = np.einsum("bkgts,bskd->btkgd", p, v.reshape(B, n, NKV, D)).reshape(T, NH * D)
        o = self.linear(a.wo, out, acts.get("wo"))
        if a.bo is not None:
            o += a.bo
        return o * np.float32(cfg.residual_multiplier)

    def _rmsnorm(self, x, w):
        out = super()._rmsnorm(x, w)
        if w is self._cap_w:
            self.got = (x.copy(), out.copy())
        return out


def check_model(cfg, layer: int) -> None:
    """The recipe's assumptions about the model, each a one-line reason."""
    if layer != cfg.num_layers - 1 or layer not in cfg.moe_layers:
        raise TrainError(f"layer {layer}: the recipe trains an expert in the last layer, which "
                         f"must be a MoE layer (this model's last is {cfg.num_layers - 1}, MoE "
                         f"layers {cfg.moe_layers})")
    if cfg.scoring_func != "softmax" or cfg.routing_scales_input or cfg.n_group > 1:
        raise TrainError("the recipe needs plain softmax top-k routing; this model routes "
                         f"with {cfg.scoring_func} (groups {cfg.n_group})")


def features(w, examples: list[dict], layer: int, batch: int = 512) -> recipe.Features:
    m = _Capture(w, layer)
    hs, xs = [], []
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["prompt"]))
    for i in range(0, len(order), batch):
        part = [np.asarray(examples[j]["prompt"], np.int64) for j in order[i:i + batch]]
        caches = [m.new_cache(len(p), "f32") for p in part]
        m.got = None
        m.forward(part, caches)
        if m.got is None:
            raise TrainError(f"layer {layer}: its FFN norm is not an RMSNorm; the recipe "
                             f"captures the input of one")
        ends = np.cumsum([len(p) for p in part]) - 1
        hs.append(m.got[0][ends])
        xs.append(m.got[1][ends])
    back = np.argsort(order)                    # the examples' own order again
    h, xn = np.concatenate(hs)[back], np.concatenate(xs)[back]
    lw = w.layers[layer]
    old = np.zeros((len(xn), len(lw.experts), xn.shape[1]), np.float32)
    for e in lw.experts:
        if e.ffn is None:
            raise TrainError(f"expert {e.index} of layer {layer} has no stored weights")
        buf = np.zeros_like(xn)
        m._ffn(e.ffn, xn, buf)
        old[:, e.index] = buf
    shared = np.zeros_like(xn)
    if lw.shared is not None:
        m._ffn(lw.shared, xn, shared)
        if lw.shared_gate is not None:
            shared *= ops.sigmoid(xn @ np.asarray(lw.shared_gate, np.float32).T)
    logits = ops.router_logits(xn, np.asarray(lw.router, np.float32))
    return recipe.Features(h=h, xn=xn, old_logits=logits, old_out=old, shared_out=shared)


def head_of(w) -> recipe.Head:
    cfg = w.cfg
    return recipe.Head(final_norm=np.asarray(w.final_norm, np.float32),
                       lm_head=ops.float_matrix(w.lm_head), eps=cfg.rms_norm_eps,
                       k=cfg.top_k, norm_topk=cfg.norm_topk_prob,
                       residual_multiplier=cfg.residual_multiplier,
                       logits_scaling=cfg.logits_scaling)


def run(spec: dict, log=print) -> dict:
    t0 = time.time()
    model_dir = Path(spec["model_dir"])
    examples = [json.loads(line) for line in Path(spec["examples"]).read_text().splitlines()
                if line.strip()]
    w = load_model(model_dir)
    try:
        cfg = w.cfg
        layer = spec.get("layer")
        layer = cfg.num_layers - 1 if layer is None else int(layer)
        check_model(cfg, layer)
        f = features(w, examples, layer)
        head = head_of(w)
    finally:
        w.close()
    t_feat = time.time() - t0
    log(f"captured layer-{layer} features of {len(examples)} examples ({t_feat:.1f}s)")
    clip = spec.get("q4_clip", "minmax")
    got = recipe.train(
        f, head, np.array([e["target"] for e in examples]),
        np.array([bool(e["route"]) for e in examples]),
        intermediate=cfg.expert_intermediate, steps=int(spec.get("steps", 1500)),
        seed=int(spec.get("seed", 0)), routed_weight=float(spec.get("routed_weight", 0.7)),
        q4_round=lambda a: dequantize_q4(quantize_q4(a, clip=clip)).astype(np.float32),
        log=log)
    t_train = time.time() - t0 - t_feat
    out = Path(spec["out_so"])
    npz = out.with_suffix(".npz")
    np.savez(npz, **{k: got[k] for k in ("w1", "w3", "w2", "router_row", "router_bias")})
    build_expert(npz, out, layer, spec["name"], spec["version"], q4_clip=clip,
                 base_model=fingerprint_of_dir(model_dir))
    os.unlink(npz)
    result = {"path": str(out), "sha256": _sha256(out),
              "layer": layer, "examples": len(examples),
              "routed_examples": int(sum(bool(e["route"]) for e in examples)),
              "accuracy_before": got["accuracy_before"], "accuracy_after": got["accuracy_after"],
              "features_s": round(t_feat, 2), "train_s": round(t_train, 2),
              "total_s": round(time.time() - t0, 2)}
    log(f"built {out.name}: accuracy on the examples {got['accuracy_before']:.3f} -> "
        f"{got['accuracy_after']:.3f} ({result['total_s']:.1f}s)")
    return result


def _sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        spec = json.loads(Path(argv[0]).read_text())
        result = run(spec, log=lambda s: print(s, flush=True))
        Path(spec["result"]).write_text(json.dumps(result) + "\n")
        return 0
    except Exception as e:  # noqa: BLE001 - the parent reports the reason, one line
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{type(e).__name__}: {msg}"[:400], file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
