"""The model fingerprint: which model a hot-plugged expert was built for.

A trained expert is a function of the hidden states one model produces at its layers, and
it competes for tokens with that model's own router rows: the same bytes in another model
(even one of the same shape) compute nonsense. docs/HOTPLUG.md's fraud expert dropped into
the built-in model turned its greedy text into "ps areashavior" without a word. So every
expert records the fingerprint of the model it was built for (`base_model`), and the
engine refuses a mismatch unless the expert was built `portable`.

The rule (FINGERPRINT_VERSION 1): sha256 over

    b"colibri-model-fingerprint 1\\n"
    the architecture, one JSON line (sorted keys, no spaces): architecture, hidden_size,
        num_layers, layer_types, num_experts, vocab_size, scoring_func, norm_topk_prob
    then per MoE layer, ascending: b"layer %d\\n", its router [num_experts, hidden] and its
        FFN input norm [hidden] as little-endian float32 bytes, DeepSeek's selection
        bias [num_experts] when the model has one, then gpt-oss's router logit bias
        [num_experts] when it has one (no other model's fingerprint changes)

The router and the norm before the FFN are what an expert's computation depends on
directly: the norm defines the input it is given, the router the scores it is chosen
against. Any retraining or fine-tune of the base changes them; reconverting the same
checkpoint (another bit width, AWQ or not) does not, because both stay float32 from the
checkpoint -- unlike `config.json`'s file checksums, which change with every conversion.
Cost: the routers are read for routing anyway; hashing them is num_moe_layers x
num_experts x hidden x 4 bytes (0.1 MB on the built-in model, 50 MB on Qwen3-30B-A3B),
done once per loaded model and cached on its weights.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

FINGERPRINT_VERSION = 1
ARCH_FIELDS = ("architecture", "hidden_size", "num_layers", "layer_types", "num_experts",
               "vocab_size", "scoring_func", "norm_topk_prob")
_CACHE_ATTR = "_colibri_fingerprint"


def model_fingerprint(weights) -> str:
    """64 hex digits: the fingerprint of loaded model `weights` (weights.ModelWeights),
    worked out on the first call and cached on the object."""
    cached = getattr(weights, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    cfg = weights.cfg
    h = hashlib.sha256(b"colibri-model-fingerprint %d\n" % FINGERPRINT_VERSION)
    arch = {k: getattr(cfg, k) for k in ARCH_FIELDS}
    h.update(json.dumps(arch, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    for lw in weights.layers:
        if lw.kind != "moe":
            continue
        h.update(b"layer %d\n" % lw.index)
        for arr in (lw.router, lw.ffn_norm, lw.router_bias, lw.router_logit_bias, lw.ffn_norm_bias):
            if arr is not None:
                h.update(memoryview(np.ascontiguousarray(arr, "<f4")).cast("B"))
    fp = h.hexdigest()
    setattr(weights, _CACHE_ATTR, fp)
    return fp


def fingerprint_of_dir(model_dir) -> str:
    """The fingerprint of the model in `model_dir` (mapped, hashed, unmapped)."""
    from .weights import load_model
    w = load_model(model_dir, "mmap", lazy_experts=True)
    try:
        return model_fingerprint(w)
    finally:
        w.close()


def parse_fingerprint(text: str, where: str) -> str:
    """A fingerprint given as text (64 hex digits), lowercased; ValueError naming `where`."""
    t = str(text).strip().lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise ValueError(f"{where} = {text!r}, expected a model fingerprint: 64 hex digits"
                         " (`colibri experts fingerprint --config NAME` prints one)")
    return t


def fingerprint_for(config: str | None = None, model=None) -> str:
    """The fingerprint of `--config NAME|FILE`'s model, or of model directory `model`."""
    from pathlib import Path

    from ..config import find_config, load_run_config
    if model is None:
        _, model = load_run_config(find_config(config or "builtin"))
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"{model}: not a Colibri model directory (no config.json)")
    return fingerprint_of_dir(model)


def main(argv=None) -> int:
    """`python -m colibri_core.model.fingerprint [--c] [CONFIG|MODEL_DIR]`: print the fingerprint
    (hex, or with --c as a C initializer for colibri_expert_meta.base_model: the Makefile
    of experts_so/ uses it)."""
    import argparse
    import os
    import sys
    ap = argparse.ArgumentParser(prog="python -m colibri_core.model.fingerprint")
    ap.add_argument("--c", action="store_true", help="print a C initializer {0x..,...}")
    ap.add_argument("model", nargs="?", default="builtin",
                    help="a run config (name or file) or a model directory")
    a = ap.parse_args(argv)
    try:
        if os.path.isdir(a.model):
            fp = fingerprint_for(model=a.model)
        else:
            fp = fingerprint_for(config=a.model)
    except (ValueError, OSError) as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    print("{" + ",".join(f"0x{b:02x}" for b in bytes.fromhex(fp)) + "}" if a.c else fp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
