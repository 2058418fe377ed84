"""The fraud example's recipe for one new expert in the LAST MoE layer, on captured
features (examples/fraud/train_new_expert.py does the same on its own stream; the
server's training job, server/trainchild.py, on the examples posted to it).

At the last position of every example, the layer's input h and its normalised input xn
are captured once (the model frozen). The layer is the last one, so the next-token
logits there depend on the MoE output only:

    logits = lm_head(final_norm(h + m * (shared(xn) + sum over the top-k of E+1 experts)))

1. the router row (and a bias) is fitted as a classifier: the new expert's logit must
   beat the k-th best old logit on the examples marked `route` and stay below it
   elsewhere;
2. the expert's weights and the row are trained end to end through the real routing
   (softmax over E+1 logits, hard top-k), label cross-entropy plus the routing term.

Needs torch (imported here, never by the engine's runtime). Softmax routing only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Features:
    """Per example, at its last position: float32 arrays with N rows."""
    h: np.ndarray              # [N, H] the residual entering the layer's MoE block
    xn: np.ndarray             # [N, H] its normalised input
    old_logits: np.ndarray     # [N, E] the router's logits over the old experts
    old_out: np.ndarray        # [N, E, H] every old expert's output (unweighted)
    shared_out: np.ndarray     # [N, H] the shared expert (gated), zeros if none


@dataclass
class Head:
    """What follows the MoE block: final norm and lm_head (frozen)."""
    final_norm: np.ndarray     # [H]
    lm_head: np.ndarray        # [V, H] float
    eps: float
    k: int                     # experts per token
    norm_topk: bool
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def train(f: Features, head: Head, target: np.ndarray, route: np.ndarray, *,
          intermediate: int, steps: int = 1500, seed: int = 0, routed_weight: float = 0.7,
          q4_round=None, threads: int = 1, log=print) -> dict:
    """Train the expert; returns w1 [I,H], w3 [I,H], w2 [H,I], router_row [H],
    router_bias, and accuracy of the target token before/after (q4-rounded weights when
    `q4_round` (a float array -> float array) is given)."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    T = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32))
         for k, v in vars(f).items()}
    norm_w = torch.from_numpy(np.asarray(head.final_norm, np.float32))
    lm = torch.from_numpy(np.asarray(head.lm_head, np.float32))
    y = torch.from_numpy(np.asarray(target, np.int64))
    r = torch.from_numpy(np.asarray(route, np.float32))
    N, H = T["xn"].shape
    I, k = intermediate, head.k

    def logits_of(idx, new):
        return label_logits(T, head, norm_w, lm, idx, new)

    def margin(row, bias, idx):
        kth = torch.topk(T["old_logits"][idx], k, -1).values[:, -1]
        return T["xn"][idx] @ row + bias - kth

    if r.sum() == 0 or r.sum() == N:
        raise ValueError("route: expected some examples marked true and some false")
    pos_w = torch.tensor(float((N - r.sum()) / r.sum()) / 4)
    every = torch.arange(N)
    # -- 1: the router row as a classifier of the examples to route
    row = torch.zeros(H, requires_grad=True)
    bias = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([row, bias], lr=0.05)
    for _ in range(400):
        loss = F.binary_cross_entropy_with_logits(margin(row, bias, every), r, pos_weight=pos_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        sel = margin(row, bias, every) > 0
        log(f"router row: selects {sel[r.bool()].float().mean():.1%} of the routed examples,"
            f" {sel[~r.bool()].float().mean():.2%} of the rest")
    # -- 2: expert + row end to end; routed examples down-weighted (their share of the
    # training set is higher than of live traffic: keep the scores calibrated)
    w_ex = torch.where(r.bool(), torch.tensor(routed_weight), torch.tensor(1.0))
    wgu = (torch.randn(2 * I, H) / H ** 0.5).requires_grad_(True)
    wd = torch.zeros(H, I, requires_grad=True)
    opt = torch.optim.Adam([wgu, wd, row, bias], lr=3e-3)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = torch.from_numpy(rng.integers(0, N, min(2048, N)))
        lg = logits_of(idx, (wgu, wd, row, bias))
        ce = (F.cross_entropy(lg, y[idx], reduction="none") * w_ex[idx]).sum() / w_ex[idx].sum()
        rl = F.binary_cross_entropy_with_logits(margin(row, bias, idx), r[idx], pos_weight=pos_w)
        loss = ce + 0.1 * rl + 1e-4 * (wgu.pow(2).mean() + wd.pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            log(f"step {step + 1} ce {ce.item():.4f} route {rl.item():.4f}")
    w1 = wgu[:I].detach().numpy().astype(np.float32)
    w3 = wgu[I:].detach().numpy().astype(np.float32)
    w2 = wd.detach().numpy().astype(np.float32)
    rq = q4_round or (lambda w: w)
    new = (torch.from_numpy(np.concatenate([rq(w1), rq(w3)]).astype(np.float32)),
           torch.from_numpy(rq(w2).astype(np.float32)), row.detach(), bias.detach())
    with torch.no_grad():
        acc0 = float((logits_of(every, None).argmax(-1) == y).float().mean())
        acc1 = float((logits_of(every, new).argmax(-1) == y).float().mean())
    return {"w1": w1, "w3": w3, "w2": w2,
            "router_row": row.detach().numpy().astype(np.float32),
            "router_bias": np.float32(bias.item()),
            "accuracy_before": acc0, "accuracy_after": acc1}


def label_logits(T: dict, head: Head, norm_w, lm, idx, new=None):
    """Next-token logits at the examples `idx` (torch tensors T of Features' fields), with
    the new expert `new` = (w_gate_up [2I,H], w_down [H,I], row [H], bias) among the
    routed ones, or without it (None: the model as it is)."""
    import torch
    import torch.nn.functional as F
    xn, lg, outs = T["xn"][idx], T["old_logits"][idx], T["old_out"][idx]
    H = xn.shape[1]
    if new is not None:
        wgu, wd, row, bias = new
        I = wd.shape[1]
        gu = xn @ wgu.T
        yo = (F.silu(gu[:, :I]) * gu[:, I:]) @ wd.T
        lg = torch.cat([lg, (xn @ row + bias)[:, None]], 1)
        outs = torch.cat([outs, yo[:, None, :]], 1)
    probs = torch.softmax(lg, -1)
    top_v, top_i = torch.topk(probs, head.k, -1)
    if head.norm_topk:
        top_v = top_v / top_v.sum(-1, keepdim=True)
    sel = torch.gather(outs, 1, top_i[:, :, None].expand(-1, -1, H))
    moe = (sel * top_v[:, :, None]).sum(1) + T["shared_out"][idx]
    x = T["h"][idx] + moe * head.residual_multiplier
    xs = x / torch.sqrt((x * x).mean(-1, keepdim=True) + head.eps) * norm_w
    return (xs @ lm.T) / head.logits_scaling
