"""Train one new expert (+ its router row) for card testing, everything else frozen.

    python examples/fraud/train_new_expert.py          # ~2-3 min on 2 cores

The base model (examples/fraud/model, dequantized back into a transformers
Qwen2MoeForCausalLM, so the expert learns beside exactly the weights it will run with)
never saw card testing. We add a 9th expert to MoE layer 3 (the last layer) and one row
to that layer's router, and train only those on a mix of card-testing, old-pattern and
legitimate transactions:

1. One frozen forward pass records, at the LABEL position of every training sequence, the
   residual stream entering layer 3's MoE block and its normalised input xn. Layer 3 is
   the last layer, so the label logits depend on the MoE output at that position only:
   label logits = lm_head(final_norm(h + shared(xn) + sum over the top-2 of 9 experts)).
   Training the new expert is then exact and cheap on those [N, H] vectors.
2. The router row (and a logit bias) is first fitted as a linear classifier: the new
   expert's logit must beat the second-best old logit (enter the top 2) on card-testing
   transactions and stay below it elsewhere.
3. Then the expert's weights and the row are trained end to end through the real routing
   (softmax over 9 logits, hard top-2, no renormalisation), with the label cross-entropy
   plus the routing term of step 2.

Writes examples/fraud/new_expert/card_testing.npz (w1 [I,H], w3 [I,H], w2 [H,I],
router_row [H], router_bias) and card_testing.json (metrics, before/after, on a
validation stream, with the expert's weights INT4-rounded as the builder will store them).
Build it into a hot-pluggable .so with
`colibri expert build examples/fraud/new_expert/card_testing.npz -o X.so --layer 3
--config fraud ...` (the fraud model's fingerprint recorded: other models refuse it)
(run_demo.py does that itself).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fraud_common import (BUILD, EXPERT_JSON, EXPERT_NPZ, HF_CONFIG, MODEL_DIR,  # noqa: E402
                          NEW_EXPERT_LAYER, dequantized_hf_model, encode, group_metrics,
                          load_scoring)
from fraud_stream import FRAUD, OK, OLD_PATTERNS, StreamConfig, generate, summary  # noqa: E402

MIX = StreamConfig(n_cards=1600, days=14, old_fraud_rate=0.04, new_fraud_rate=0.12, seed=303)
VALID = StreamConfig(n_cards=900, days=14, old_fraud_rate=0.01, new_fraud_rate=0.01, seed=404)


def capture(model, ids: np.ndarray, layer: int, batch: int = 1024):
    """Per sequence at the LABEL position: (h entering layer's MoE, its normalised input)."""
    import torch
    lay = model.model.layers[layer]
    got = {}

    def hook_norm(mod, inp, out):
        got["h"] = inp[0][:, -1, :].detach().clone()
        got["xn"] = out[:, -1, :].detach().clone()

    handle = lay.post_attention_layernorm.register_forward_hook(hook_norm)
    hs, xs = [], []
    try:
        with torch.no_grad():
            for i in range(0, len(ids), batch):
                model(input_ids=torch.from_numpy(ids[i:i + batch]), logits_to_keep=1)
                hs.append(got["h"])
                xs.append(got["xn"])
    finally:
        handle.remove()
    return torch.cat(hs), torch.cat(xs)


class Head:
    """Layer-3 MoE block + final norm + lm_head at the LABEL position, with an optional
    extra expert. Frozen parts come from the model; the new expert's tensors are given."""

    def __init__(self, model, layer: int):
        import torch
        self.torch = torch
        blk = model.model.layers[layer].mlp
        self.gate = blk.gate.weight.detach()                       # [E, H]
        self.gate_up = blk.experts.gate_up_proj.detach()           # [E, 2I, H]
        self.down = blk.experts.down_proj.detach()                 # [E, H, I]
        self.shared = blk.shared_expert
        self.shared_gate = blk.shared_expert_gate
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.k = model.config.num_experts_per_tok
        self.norm_topk = model.config.norm_topk_prob

    def old_logits(self, xn):
        return xn @ self.gate.T

    def experts_out(self, xn):
        """[N, E, H] every old expert on every row (cheap: N x 8 small matmuls)."""
        F = self.torch.nn.functional
        I = self.down.shape[2]
        gu = self.torch.einsum("nh,eih->nei", xn, self.gate_up)
        h = F.silu(gu[..., :I]) * gu[..., I:]
        return self.torch.einsum("nei,ehi->neh", h, self.down)

    def shared_out(self, xn):
        return self.shared(xn) * self.torch.sigmoid(self.shared_gate(xn))

    def logits(self, h, xn, old_logits, old_out, shared_out, new=None):
        """Label logits [N, V]. new = (w_gate_up [2I,H], w_down [H,I], row [H], bias)."""
        torch = self.torch
        F = torch.nn.functional
        lg = old_logits
        outs = old_out
        if new is not None:
            wgu, wd, row, bias = new
            I = wd.shape[1]
            gu = xn @ wgu.T
            y = (F.silu(gu[:, :I]) * gu[:, I:]) @ wd.T
            lg = torch.cat([old_logits, (xn @ row + bias)[:, None]], 1)
            outs = torch.cat([old_out, y[:, None, :]], 1)
        probs = torch.softmax(lg, dim=-1)
        top_v, top_i = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk:
            top_v = top_v / top_v.sum(-1, keepdim=True)
        sel = torch.gather(outs, 1, top_i[:, :, None].expand(-1, -1, outs.shape[2]))
        moe = (sel * top_v[:, :, None]).sum(1) + shared_out
        return self.lm_head(self.norm(h + moe))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500, help="end-to-end steps (stage 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layer", type=int, default=NEW_EXPERT_LAYER)
    ap.add_argument("--out", default=str(EXPERT_NPZ.parent),
                    help="folder for card_testing.npz / .json")
    ap.add_argument("--q4-clip", choices=["minmax", "mse"], default="minmax", dest="q4_clip",
                    help="the INT4 rounding the expert is validated with and recorded for the "
                         "builder (default minmax: the committed expert's)")
    ap.add_argument("--ct-weight", type=float, default=0.7,
                    help="loss weight of card-testing examples (prior correction)")
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from colibri_core.format.quant import dequantize_q4, quantize_q4
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.time()
    thr = load_scoring()["threshold"]
    mix, va = generate(MIX), generate(VALID)
    sm = summary(mix)
    counts = {p: sm[p]["n"] for p in ["legit", "card_testing"] + OLD_PATTERNS}
    print(f"mix: {len(mix)} txns {json.dumps(counts)}"
          f"; valid: {len(va)} ({time.time() - t0:.0f}s)", flush=True)

    model = dequantized_hf_model(MODEL_DIR)
    for p in model.parameters():
        p.requires_grad_(False)
    L = a.layer
    head = Head(model, L)

    def features(txns):
        ids = encode(txns)
        h, xn = capture(model, ids, L)
        with torch.no_grad():
            return dict(h=h, xn=xn, lg=head.old_logits(xn), so=head.shared_out(xn))

    cache = BUILD / f"new_expert_features_L{L}.pt"
    key = hashlib.sha256((MODEL_DIR / "config.json").read_bytes()
                         + repr((MIX, VALID)).encode()).hexdigest()
    got = torch.load(cache) if cache.exists() else None
    if got is not None and got.get("key") == key:
        fm, fv = got["mix"], got["valid"]
    else:
        fm, fv = features(mix), features(va)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": key, "mix": fm, "valid": fv}, cache)
    print(f"captured layer-{L} inputs ({time.time() - t0:.0f}s)", flush=True)
    y_mix = torch.tensor([tx.is_fraud for tx in mix]).long()
    ct_mix = torch.tensor([tx.pattern == "card_testing" for tx in mix]).float()
    target = torch.where(y_mix.bool(), FRAUD, OK)
    pat_v = np.array([tx.pattern for tx in va])

    H = HF_CONFIG["hidden_size"]
    I = HF_CONFIG["moe_intermediate_size"]
    k = HF_CONFIG["num_experts_per_tok"]

    def route_margin(row, bias, f):
        """new logit minus the k-th best old logit (> 0: the new expert is in the top k)."""
        kth = torch.topk(f["lg"], k, dim=-1).values[:, -1]
        return f["xn"] @ row + bias - kth

    # -- stage 2: the router row as a classifier of card testing
    row = torch.zeros(H, requires_grad=True)
    bias = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([row, bias], lr=0.05)
    pos_w = float((1 - ct_mix).sum() / ct_mix.sum())
    for _ in range(400):
        m = route_margin(row, bias, fm)
        loss = F.binary_cross_entropy_with_logits(m, ct_mix, pos_weight=torch.tensor(pos_w / 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        sel = route_margin(row, bias, fm) > 0
        print(f"router row: selects {sel[ct_mix.bool()].float().mean():.1%} of card testing, "
              f"{sel[~ct_mix.bool()].float().mean():.2%} of the rest", flush=True)

    # -- stage 3: expert + row end to end through the real routing. Card testing is ~10 %
    # of the mix (to have enough of it) but ~1 % of live traffic: its examples are
    # down-weighted so that P(FRAUD) stays calibrated for the live base rate and the
    # base model's threshold keeps its meaning.
    w_ex = torch.where(ct_mix.bool(), torch.tensor(a.ct_weight), torch.tensor(1.0))
    wgu = (torch.randn(2 * I, H) / H ** 0.5).requires_grad_(True)
    wd = torch.zeros(H, I, requires_grad=True)
    params = [wgu, wd, row, bias]
    opt = torch.optim.Adam(params, lr=3e-3)
    N = len(mix)
    rng = np.random.default_rng(a.seed)
    for step in range(a.steps):
        idx = torch.from_numpy(rng.integers(0, N, 2048))
        f = {kk: v[idx] for kk, v in fm.items()}
        with torch.no_grad():
            f["eo"] = head.experts_out(f["xn"])
        logits = head.logits(f["h"], f["xn"], f["lg"], f["eo"], f["so"], (wgu, wd, row, bias))
        ce = (F.cross_entropy(logits, target[idx], reduction="none") * w_ex[idx]).sum() \
            / w_ex[idx].sum()
        rl = F.binary_cross_entropy_with_logits(route_margin(row, bias, f), ct_mix[idx],
                                                pos_weight=torch.tensor(pos_w / 4))
        loss = ce + 0.1 * rl + 1e-4 * (wgu.pow(2).mean() + wd.pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            print(f"  step {step + 1:5d}  ce {ce.item():.4f}  route {rl.item():.4f}", flush=True)

    # -- the weights as the builder will store them (INT4, group 128), then evaluate
    w1 = wgu[:I].detach().numpy().astype(np.float32)
    w3 = wgu[I:].detach().numpy().astype(np.float32)
    w2 = wd.detach().numpy().astype(np.float32)
    # explicit clip: the builder must round the same way (run_demo reads it from the json)
    rq = lambda w: dequantize_q4(quantize_q4(w, clip=a.q4_clip)).astype(np.float32)  # noqa: E731
    new_q = (torch.from_numpy(np.concatenate([rq(w1), rq(w3)])), torch.from_numpy(rq(w2)),
             row.detach(), bias.detach())

    def evaluate(new):
        with torch.no_grad():
            lg = head.logits(fv["h"], fv["xn"], fv["lg"], head.experts_out(fv["xn"]), fv["so"],
                             new)
            p = torch.softmax(lg.double(), -1)[:, FRAUD].numpy()
        flag = p >= thr
        out = {}
        for name, group in (("new", ["card_testing"]), ("old", OLD_PATTERNS)):
            g = group_metrics(flag, pat_v, group)
            out[name] = {"recall": g["recall"], "precision": g["precision"], "tp": g["tp"],
                         "positives": g["positives"], "fp": g["fp"]}
        out["fp_rate"] = group_metrics(flag, pat_v, ["card_testing"])["fp_rate"]
        return out, p

    before, p0 = evaluate(None)
    after, p1 = evaluate(new_q)
    old_mask = np.isin(pat_v, OLD_PATTERNS)
    flips_old = int(((p0 >= thr) != (p1 >= thr))[old_mask].sum())
    flips_legit = int(((p0 >= thr) != (p1 >= thr))[pat_v == "legit"].sum())
    for name in ("new", "old"):
        b, c = before[name], after[name]
        print(f"{name:>4}: recall {b['recall'][0]:.3f} -> {c['recall'][0]:.3f}  "
              f"precision {b['precision'][0]:.3f} -> {c['precision'][0]:.3f}  "
              f"(n={b['positives']})")
    print(f"legit FP rate {before['fp_rate'][0]:.4%} -> {after['fp_rate'][0]:.4%}; decisions "
          f"flipped on old-pattern txns: {flips_old}, on legit: {flips_legit}")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    npz_path, json_path = out / EXPERT_NPZ.name, out / EXPERT_JSON.name
    np.savez(npz_path, w1=w1, w3=w3, w2=w2, router_row=row.detach().numpy().astype(np.float32),
             router_bias=np.float32(bias.item()))
    json_path.write_text(json.dumps({
        "name": "card_testing", "layer": L, "hidden": H, "intermediate": I,
        "group_size": 128, "q4_clip": a.q4_clip,
        "threshold": thr, "router_bias": float(bias.item()),
        "valid_before": before, "valid_after_int4": after,
        "decision_flips": {"old_patterns": flips_old, "legit": flips_legit},
        "mix_stream": MIX.__dict__, "valid_stream": VALID.__dict__,
        "steps": a.steps, "seed": a.seed, "ct_weight": a.ct_weight,
    }, indent=1) + "\n")
    print(f"wrote {npz_path} and {json_path.name} ({time.time() - t0:.0f}s total)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
