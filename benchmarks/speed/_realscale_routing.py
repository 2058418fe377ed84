"""The routing variants of the real-size models (issue 31): "uniform" (the random
routers) and "skewed" (the same rows scaled by popularity rank), written into both the
Colibri model and its GGUF so that both engines read the same routers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.speed._realscale_models import DEFAULT_DIR, Draw, model_config, paths

# The skewed variant: router row of popularity rank r scaled by 1 + SKEW_A / r (rank ->
# expert a random permutation per layer). A random row dotted with any hidden state is a
# Gaussian logit whose spread the scale sets, so a larger row wins top-k more often. An
# exact Zipf law with s = 1 is not reachable with top-k of E distinct experts: for
# Qwen3-30B-A3B (top-8 of 128) rank 1 would need 18.4 % of the selections, 1.47 a token.
# Capped at one a token, Zipf's top-8 share is 46 %; scaling rows alone caps each expert
# near one selection in two tokens (a logit as often negative as positive), and 1 + 100 / r
# gives a top-8 share of 39 % (Monte Carlo of iid logits; 6.25 % uniform). The measured
# shares of both engines are reported by bench_outofmem.py.
SKEW_A = 100.0
ROUTING = ("uniform", "skewed")


def routers(cfg, variant: str, seed: int = 7) -> dict:
    """{MoE layer: float32 [E, H] router} of a routing variant; both engines get these."""
    dr = Draw(seed)
    E, H = cfg.num_experts, cfg.hidden_size
    out = {}
    for L in cfg.moe_layers:
        R = dr.router(E, H)
        perm = dr.rng.permutation(E)               # drawn for both variants: same rows
        if variant == "skewed":
            g = np.empty(E, np.float32)
            g[perm] = 1.0 + SKEW_A / np.arange(1, E + 1)
            R = (R * g[:, None]).astype(np.float32)
        elif variant != "uniform":
            raise ValueError(f"routing variant {variant!r}: have {', '.join(ROUTING)}")
        out[L] = R
    return out


def set_routing(shape: str, variant: str, root: Path = DEFAULT_DIR) -> dict:
    """Write `variant`'s routers into both files of `shape` in place: Colibri's
    routing.bin (rewritten, its other sections kept; config.json's size and sha256 of it
    updated) and the GGUF's ffn_gate_inp tensors (F32, overwritten where they lie).
    -> {MoE layer: router}."""
    from colibri_core.format.container import sha256_file
    from colibri_core.files import write_atomic
    from colibri_core.format.writer import write_container
    from colibri_core.format.modelfile import ContainerFile
    from benchmarks.peers._llamacpp_tools import import_gguf
    cfg = model_config(shape)
    rs = routers(cfg, variant)
    p = paths(shape, root)
    mdir = p["colibri"]
    rb = mdir / "routing.bin"
    cf = ContainerFile(rb)              # its other sections kept (gpt-oss's router biases)
    keep = [(n, np.array(cf.tensor(n))) for n in cf.sections if not n.endswith(".router")]
    cf.close()
    write_container(rb, [(f"layer.{L}.router", R) for L, R in rs.items()] + keep)
    cj = mdir / "config.json"
    data = json.loads(cj.read_text())
    data["files"]["routing.bin"] = {"size": rb.stat().st_size, "sha256": sha256_file(rb)}
    write_atomic(cj, json.dumps(data, indent=1, sort_keys=True) + "\n")
    if p["gguf"].exists():
        gguf = import_gguf()
        rd = gguf.GGUFReader(str(p["gguf"]), "r+")
        for t in rd.tensors:
            if t.name.endswith(".ffn_gate_inp.weight"):
                L = int(t.name.split(".")[1])
                t.data[...] = rs[L].reshape(t.data.shape)
        rd.data.flush()
        del rd
    (mdir / "routing_variant.txt").write_text(variant + "\n")
    return rs


def routing_variant(shape: str, root: Path = DEFAULT_DIR) -> Optional[str]:
    f = paths(shape, root)["colibri"] / "routing_variant.txt"
    return f.read_text().strip() if f.exists() else None
