"""Hugging Face checkpoint -> Colibri model directory.

    convert(hf_dir, out_dir, bits=4, group_size=128)

Writes into a hidden staging folder beside `out_dir` and renames it into place at the
end, so a failed or interrupted conversion never leaves a directory that looks valid.
Tensors are read one at a time from the memory-mapped safetensors files.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError
from ..quant import quantize_q4, quantize_q8
from ..weights import FFNWeights, write_model_dir
from .families import expert_weights, family_of, model_config_fields, router_weight
from .safetensors_reader import Checkpoint

VALID_BITS = (4, 8, 16, 32)


def _matrix(w: np.ndarray, bits: int, group: int):
    """Store a weight matrix at the requested precision."""
    if bits == 4:
        return quantize_q4(w, group)
    if bits == 8:
        return quantize_q8(w, group)
    if bits == 16:
        return np.asarray(w, np.float16)
    return np.asarray(w, np.float32)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="tensor", leave=False)
    except ImportError:
        return None


def convert(hf_dir, out_dir, *, bits: int = 4, group_size: int = 128,
            lm_head_bits: Optional[int] = None, embed_bits: Optional[int] = None,
            progress: bool = False, overwrite: bool = False) -> ModelConfig:
    """Convert; returns the written model config."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if bits not in VALID_BITS:
        raise ConfigError(f"--bits {bits}: must be one of {VALID_BITS}")
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path}: not found (is {hf_dir} a Hugging Face model directory?)")
    hf = json.loads(cfg_path.read_text())
    fields = model_config_fields(hf)
    cfg = ModelConfig.model_validate(fields)
    cfg.check_experts()
    # lm_head / embeddings: keep at least 8 bits under a 4-bit body (llama.cpp keeps its
    # output matrix at 6 bits for the same reason: it dominates the logit error).
    lm_bits = lm_head_bits or (8 if bits == 4 else bits)
    emb_bits = embed_bits or bits
    ck = Checkpoint(hf_dir)

    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir}: already exists and is not empty (pass overwrite / --force)")
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    H = cfg.hidden_size
    n_tensors = 3 + sum(7 if t == "dense" else 5 + 3 * cfg.num_experts for t in cfg.layer_types)
    bar = _progress(n_tensors, "convert", progress)

    def tick(n=1):
        if bar is not None:
            bar.update(n)

    def main_sections() -> Iterator:
        yield "embed", _matrix(ck.get("model.embed_tokens.weight"), emb_bits, group_size)
        tick()
        for L, kind in enumerate(cfg.layer_types):
            p, q = f"layer.{L}.", f"model.layers.{L}."
            yield p + "attn_norm", ck.get(q + "input_layernorm.weight")
            yield p + "ffn_norm", ck.get(q + "post_attention_layernorm.weight")
            for s, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
                yield p + s, _matrix(ck.get(q + f"self_attn.{name}.weight"), bits, group_size)
                tick()
            if cfg.attention_bias:
                for s, name in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                    if q + f"self_attn.{name}.bias" in ck:
                        yield p + s, ck.get(q + f"self_attn.{name}.bias")
            if cfg.qk_norm != "none":
                yield p + "q_norm", ck.get(q + "self_attn.q_norm.weight")
                yield p + "k_norm", ck.get(q + "self_attn.k_norm.weight")
            if kind == "dense":
                for s, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    yield p + s, _matrix(ck.get(q + f"mlp.{name}.weight"), bits, group_size)
                    tick()
            elif cfg.shared_expert_intermediate_size:
                for s, name in (("shared_w1", "gate_proj"), ("shared_w3", "up_proj"),
                                ("shared_w2", "down_proj")):
                    yield p + s, _matrix(ck.get(q + f"mlp.shared_expert.{name}.weight"), bits, group_size)
                if cfg.shared_expert_gate:
                    yield p + "shared_gate", ck.get(q + "mlp.shared_expert_gate.weight")
        yield "final_norm", ck.get("model.norm.weight")
        if not cfg.tie_word_embeddings:
            yield "lm_head", _matrix(ck.get("lm_head.weight"), lm_bits, group_size)
        tick()

    def routing_sections() -> Iterator:
        for L in cfg.moe_layers:
            yield f"layer.{L}.router", router_weight(ck, L)

    def experts() -> Iterator:
        I = cfg.expert_intermediate
        for L in cfg.moe_layers:
            for e in range(cfg.num_experts):
                w1, w3, w2 = expert_weights(ck, L, e, I)
                yield L, e, FFNWeights(_matrix(w1, bits, group_size), _matrix(w3, bits, group_size),
                                       _matrix(w2, bits, group_size))
                tick(3)

    tok = hf_dir / "tokenizer.json"
    try:
        final = write_model_dir(staging, cfg, main_sections(), routing_sections(), experts(),
                                extra_files=[tok] if tok.exists() else [])
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return final
