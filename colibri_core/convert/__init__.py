"""Hugging Face checkpoint -> Colibri model directory.

    convert(hf_dir, out_dir, bits=4, group_size=128, calibration=None)

- Families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3 (MLA attention, grouped
  sigmoid routing); Granite MoE, GLM-4.5, ERNIE-4.5-MoE (families_more.py); see
  families.py for the config mapping and what is refused.
- Precision (`bits`): 4 -> q4 (lm_head q6; embedding and attention K/V q8), 8 -> q8,
  16 -> the checkpoint's own 16-bit type copied bit for bit (bf16 or f16; a float32
  checkpoint is rounded to bf16), 32 -> f32. Norms, biases and routers stay f32.
  Per tensor class (TENSOR_CLASSES: embed, lm_head, attn_qo, attn_kv, dense_ffn,
  shared_ffn, experts) `tensor_bits` overrides it, 6 -> q6 (SIX_BIT_CLASSES: all) and
  5 -> q5 (FIVE_BIT_CLASSES: not the embedding); `lm_head_bits`, `embed_bits`, `kv_bits` are
  the same for one class each. `tensor_classes(out_dir)` reports what each class got.
  `q4_clip`: "mse" (per group, the scale/zero point of smallest squared error among
  min/max and shrunk ranges) or "minmax" (plain min/max); see quant.quantize_q4. Default:
  "mse", or "minmax" with `calibration` (AWQ searches its own clipping on the output error;
  unweighted mse clipping on top of its scales measured worse).
- `calibration`: a text file; AWQ scales are searched on the model's own activations
  (awq.py). Without it, plain round-to-nearest. AutoAWQ checkpoints are imported as they
  are.
- Streaming: one tensor at a time is read (pread; a quantized matrix a block of rows at a
  time), converted and written into its container; calibration holds one layer in float.
- Atomic: everything is written into a hidden staging folder beside `out_dir`, checked
  by loading it, and renamed into place at the end; an interrupted conversion leaves no
  directory that looks valid.
- Deterministic: the same inputs give byte-identical files (sizes and sha256 recorded in
  config.json).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..config import ModelConfig, format_validation_error
from ..errors import ConfigError
from ..files import read_bytes, read_text
from ..nesting import json_loads
from ..format.q5 import quantize_q5
from ..format.quant import DEFAULT_Q4_CLIP, Q4_CLIPS, check_group, quantize_q4, quantize_q6, quantize_q8, quantize_rows
from .. import kernels
from ..model.weights import (AttentionWeights, FFNWeights, LayerWeights, ModelExpert, write_model_dir)
from . import families as fam
from . import gptoss
from .awq import (AwqSpec, Scales, awq_dequantize, awq_q4, awq_spec, calibrate, calibration_tokens,
                  clip_groups)
from .safetensors_reader import Checkpoint, f32_to_bf16
from .classes import FIVE_BIT_CLASSES, SIX_BIT_CLASSES, TENSOR_CLASSES, tensor_class, tensor_classes

VALID_BITS = (4, 8, 16, 32)           # --bits: every matrix not set otherwise
ROLE_BITS = (4, 5, 6, 8, 16, 32)      # 5: q5, 6: q6, for the classes below

__all__ = ["convert", "VALID_BITS", "ROLE_BITS", "TENSOR_CLASSES", "tensor_classes"]


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    import sys
    return tqdm(total=total, desc=desc, unit="tensor", leave=False, file=sys.stderr,
                dynamic_ncols=True)


# Copied from the checkpoint when present (and listed with their sha256 in config.json):
# the engine reads tokenizer.json; the others keep the chat template, special tokens and
# generation settings next to the model for whoever serves it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def _read_json(path: Path) -> dict:
    if not os.path.lexists(path):
        raise ConfigError(f"{path}: not found (is {path.parent} a Hugging Face model directory?)")
    text = read_text(path, ConfigError)
    try:
        data = json_loads(text)
    except ValueError as e:
        raise ConfigError(f"{path}: unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _add_bos(hf_dir: Path) -> Optional[bool]:
    p = hf_dir / "tokenizer_config.json"
    if not p.is_file():
        return None
    try:
        v = json_loads(read_text(p, ConfigError)).get("add_bos_token")
    except Exception:
        return None
    return None if v is None else bool(v)


class _Writer:
    """Turns checkpoint tensors into stored sections for one conversion."""

    def __init__(self, ck: Checkpoint, cfg: ModelConfig, bits: int, group: int,
                 awq: Optional[AwqSpec], scales: Scales, q4_clip: str = DEFAULT_Q4_CLIP):
        self.ck, self.cfg, self.bits, self.group, self.awq, self.scales = ck, cfg, bits, group, awq, scales
        self.q4_clip = q4_clip
        self.class_group: dict = {}       # per tensor class group size (a GGUF's classes)

    def group_of(self, key: str) -> int:
        cls = "experts" if key.startswith("expert.") else tensor_class(key)
        return self.class_group.get(cls, self.group)

    def float32(self, src: fam.Src) -> np.ndarray:
        if src.awq:
            if self.awq is None:
                raise ConfigError(f"checkpoint: {src.name}.qweight is AWQ-packed but config.json "
                                  f"has no AWQ quantization_config")
            return awq_dequantize(self.ck, src, self.awq)
        return src.f32(self.ck)

    def vector(self, src: fam.Src) -> np.ndarray:
        return np.ascontiguousarray(src.f32(self.ck), np.float32)

    def matrix(self, src: fam.Src, key: str, bits: Optional[int] = None):
        """-> (stored tensor, act_scale or None)."""
        bits = bits or self.bits
        sc = self.scales
        scaled = key in sc.act or key in sc.fold_rows or key in sc.fold_cols or key in sc.clip
        if src.awq and bits == 4 and not scaled:
            return awq_q4(self.ck, src, self.awq), None
        if bits == 16 and not src.awq and not scaled:
            dt = src.dtype(self.ck)
            if dt in ("BF16", "F16"):                      # lossless copy of the stored bits
                return np.ascontiguousarray(src.raw(self.ck)), None
            return f32_to_bf16(src.f32(self.ck)), None
        got = (self.ck.matrix_rows(src.name, src.index, src.rows) if bits in (4, 6, 8) and isinstance(
            self.ck, Checkpoint) and not (scaled or src.awq or src.deinterleave or src.transpose) else None)
        if got is not None:            # a block of rows at a time: memory = output + one block
            return quantize_rows(f"q{bits}", got[2], *got[:2], self.group_of(key), self.q4_clip,
                                 kernels.q4_group_codes), None
        w = self.float32(src)
        if w.ndim != 2:
            raise ConfigError(f"checkpoint: {src.name} has shape {list(w.shape)}, expected a matrix")
        if bits == 32:
            return np.ascontiguousarray(w, np.float32), None
        if bits == 16:
            return f32_to_bf16(w), None
        s = sc.act.get(key)
        if key in sc.fold_rows:
            w = w / sc.fold_rows[key].astype(np.float64)[:, None]
        if key in sc.fold_cols:
            w = w * sc.fold_cols[key].astype(np.float64)[None, :]
        if s is not None:
            w = w * s.astype(np.float64)[None, :]
        g = self.group_of(key)
        if key in sc.clip:
            w = clip_groups(w, g, sc.clip[key])
        if bits == 4:
            return quantize_q4(w, g, clip=self.q4_clip, group_codes=kernels.q4_group_codes), s
        if bits == 5:
            return quantize_q5(w, g, clip=self.q4_clip, group_codes=kernels.q4_group_codes), s
        if bits == 6:
            return quantize_q6(w, g, clip=self.q4_clip, group_codes=kernels.q4_group_codes), s
        return quantize_q8(w, g), s


def _sha256(path: Path) -> str:
    return hashlib.sha256(read_bytes(path, ConfigError)).hexdigest()


def convert(hf_dir, out_dir, *, bits: Optional[int] = 4, group_size: Optional[int] = None,
            lm_head_bits: Optional[int] = None, embed_bits: Optional[int] = None,
            kv_bits: Optional[int] = None, tensor_bits: Optional[dict] = None,
            calibration=None, calibration_tokens_max: int = 512,
            q4_clip: Optional[str] = None, progress: bool = False,
            overwrite: bool = False, tokenizer_dir=None, report: Optional[list] = None) -> ModelConfig:
    """Convert; returns the written model config. Raises ConfigError (one line) for
    unsupported architectures and options, ModelFormatError for broken checkpoints.
    tensor_bits: {class: bits} for classes of TENSOR_CLASSES; lm_head_bits, embed_bits
    and kv_bits, when given, win over its lm_head, embed and attn_kv entries."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    gg = None                  # a GGUF file (gguf_convert.py): classes' bits from its types
    if hf_dir.suffix == ".gguf" or hf_dir.is_file():
        from . import gguf_convert
        gg, bits, tensor_bits, group_size, gguf_record = gguf_convert.prepare(
            hf_dir, bits, tensor_bits, group_size or 128, group_size is not None, calibration)
    bits = 4 if bits is None else bits
    group_size = group_size or 128
    if bits not in VALID_BITS:
        raise ConfigError(f"--bits {bits}: must be one of {', '.join(map(str, VALID_BITS))}")
    tb = dict(tensor_bits or {})
    for cls, b in (("lm_head", lm_head_bits), ("embed", embed_bits), ("attn_kv", kv_bits)):
        if b is not None:
            tb[cls] = b
    for cls, b in tb.items():
        if cls not in TENSOR_CLASSES:
            raise ConfigError(f"--tensor-bits {cls}: unknown tensor class; expected one of "
                              f"{', '.join(TENSOR_CLASSES)}")
        ok = tuple(b2 for b2 in ROLE_BITS if (b2 != 6 or cls in SIX_BIT_CLASSES)
                   and (b2 != 5 or cls in FIVE_BIT_CLASSES))
        if b not in ok:
            why = (f" (6 bits applies to {', '.join(SIX_BIT_CLASSES)})" if b == 6 else
                   f" (5 bits applies to {', '.join(FIVE_BIT_CLASSES)})" if b == 5 else "")
            raise ConfigError(f"--tensor-bits {cls}={b}: must be one of "
                              f"{', '.join(map(str, ok))}{why}")
    try:
        check_group(group_size)
    except ValueError as e:
        raise ConfigError(f"--group-size {group_size}: {e}") from None
    if q4_clip is None:
        q4_clip = "minmax" if calibration is not None else DEFAULT_Q4_CLIP
    if q4_clip not in Q4_CLIPS:
        raise ConfigError(f"--q4-clip {q4_clip}: must be one of {', '.join(Q4_CLIPS)}")
    hf = gg.hf if gg is not None else _read_json(hf_dir / "config.json")
    fields = fam.model_config_fields(hf, add_bos=gg.add_bos if gg is not None else _add_bos(hf_dir))
    spec = awq_spec(hf)
    if calibration is not None:
        if spec is not None:
            raise ConfigError("--calibration: the checkpoint is already AWQ-quantized; it is "
                              "imported as it is (drop --calibration)")
        if bits not in (4, 8):
            raise ConfigError(f"--calibration applies to --bits 4 or 8, not {bits}")
        if fields.get("norm_type") == "layer":
            raise ConfigError("--calibration: not supported with LayerNorms (Phi-3.5-MoE): "
                              "AWQ's calibration forward runs RMSNorms")
        if fields["architecture"] == gptoss.FAMILY:
            raise ConfigError("--calibration: not supported for gpt-oss (its experts are MXFP4; "
                              "AWQ's search knows neither their biases nor the clamped SwiGLU)")
    # The lm_head at 6 bits under a 4-bit body: every token reads all of it (on the
    # benchmark model 32.2 of 116.5 MiB at q8, 24.7 at q6), and on both trained models the
    # q6 head left the converted model's KL to the float model within 2.2% and its
    # perplexity within 0.4% of the q8 head's (benchmarks/accuracy/precision_sensitivity.py,
    # docs/BENCHMARKS.md "Precision by measured sensitivity").
    lm_bits = tb.get("lm_head") or (6 if bits == 4 else bits)
    # The embedding at 8 bits under a 4-bit body too: decode reads one row of it per token,
    # so this costs file size only, and at 4 bits it is the largest single cause of logit
    # error (benchmarks/peers/_peer_fidelity_ablation.py). Tied, it is the lm_head.
    emb_bits = tb.get("embed") or (lm_bits if fields.get("tie_word_embeddings")
                                   else (8 if bits == 4 else bits))
    # Attention K/V projections at 8 bits under a 4-bit body (as llama.cpp does): they are
    # small (kv_heads x head_dim rows) but carry a large share of the logit error (measured
    # by benchmarks/peers/_peer_fidelity_ablation.py). An AWQ import keeps its own 4 bits.
    kvb = tb.get("attn_kv") or (8 if bits == 4 and spec is None else bits)
    cls_bits = {"embed": emb_bits, "lm_head": lm_bits, "attn_kv": kvb,
                **{c: tb.get(c) or bits for c in ("attn_qo", "dense_ffn", "shared_ffn", "experts")}}
    method = "awq-import" if spec is not None else ("awq" if calibration is not None else "rtn")
    try:
        cfg = ModelConfig.model_validate(fields)
    except Exception as e:
        from pydantic import ValidationError
        if isinstance(e, ValidationError):
            raise ConfigError(format_validation_error(str(hf_dir / "config.json"), e)) from None
        raise
    cfg.check_experts()
    for cls, why in (("embed", "the lm_head is tied to the embedding, whose rows"),
                     ("attn_qo", "MLA's wkv_b rows")):
        if cls_bits[cls] == 5 and (cls == "embed" or cfg.attention == "mla"):
            raise ConfigError(f"--tensor-bits {'lm_head' if cls == 'embed' else cls}=5: {why} are "
                              f"read one at a time and q5 runs in matrix products only; use 4, 6 or 8")
    ck = gg.ck if gg is not None else Checkpoint(hf_dir, hf.get("transformers_weights"),
                                                 fam.more.text_model(hf)[1])
    if gg is not None:
        method = "gguf"
        tok_files, tok_line = gguf_convert.tokenizer_files(gg, tokenizer_dir, TOKENIZER_FILES)
        if report is not None:
            report.append(tok_line)

    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir}: already exists and is not empty (pass overwrite / --force)")
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    E = cfg.num_experts
    n_attn = sum(1 for _, _, k in fam.attention_sections(ck, cfg, 0) if k == "matrix")
    per_layer = [n_attn + (3 if t == "dense" else 3 * E + (3 if cfg.shared_expert_intermediate_size else 0))
                 for t in cfg.layer_types]
    total = sum(per_layer) + 1 + (0 if cfg.tie_word_embeddings else 1)
    if calibration is not None:
        total += cfg.num_layers
    bar = _progress(total, "convert", progress)

    def tick(n=1):
        if bar is not None:
            bar.update(n)

    scales = Scales()
    try:
        staging.mkdir(parents=True)
        wr = _Writer(ck, cfg, bits, group_size, spec, scales, q4_clip)
        if gg is not None:
            wr.class_group = gguf_record["group_size"]
        if calibration is not None:
            if bar is not None:
                bar.set_description("calibrate")
            seqs = calibration_tokens(hf_dir, Path(calibration), cfg, calibration_tokens_max)
            embed = wr.float32(fam.Src("model.embed_tokens.weight"))
            sc = calibrate(cfg, seqs, embed, lambda L: _float_layer(wr, L), bits, group_size, tick,
                           q4_clip=q4_clip)
            del embed
            scales = sc
            wr.scales = sc
            if bar is not None:
                bar.set_description("convert")

        quant = {"method": method, "bits": bits, "group_size": spec.group if spec else group_size,
                 "lm_head_bits": lm_bits, "embed_bits": emb_bits, "kv_bits": kvb,
                 "source_dtypes": sorted(ck.float_dtypes())}
        other = {c: b for c, b in cls_bits.items()
                 if c in ("attn_qo", "dense_ffn", "shared_ffn", "experts") and b != bits}
        if other:                  # recorded only when set (earlier conversions stay as they were)
            quant["tensor_bits"] = other
        if gg is not None:
            quant["gguf"] = gguf_record
        if {4, 6} & set(cls_bits.values()):
            quant["q4_clip"] = q4_clip
        if calibration is not None:
            quant["calibration"] = {"sha256": _sha256(Path(calibration)), "tokens": scales.tokens,
                                    **scales.summary()}
        cfg = cfg.model_copy(update={"quantization": quant})

        main = _main_sections(wr, cfg, cls_bits, tick)
        routing = list(_routing_sections(wr, cfg))
        experts = _experts(wr, cfg, tick, cls_bits["experts"])
        n_main = 4 + sum(12 + 2 * n_attn + (8 if cfg.shared_expert_intermediate_size else 6)
                         for _ in cfg.layer_types)
        final = write_model_dir(staging, cfg, main, routing, experts,
                                extra_files=tok_files if gg is not None else
                                [hf_dir / n for n in TOKENIZER_FILES if os.path.lexists(hf_dir / n)],
                                main_reserve=16 + n_main * 256)
        from ..model.weights import load_model
        load_model(staging).close()                 # the result must load (shapes, sizes)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
        if gg is not None:
            gguf_convert.cleanup(gg)
    if gg is not None and report is not None:
        report.extend(gguf_convert.report(gguf_record, tensor_classes(out_dir)))
    return final


# ----------------------------------------------------------------------------- sections

def _main_sections(wr: _Writer, cfg: ModelConfig, cls_bits: dict, tick) -> Iterator:
    ck = wr.ck

    def mat(name, src, key=None, bits=None):
        t, s = wr.matrix(src, key or name, bits)
        yield name, t
        if s is not None:
            yield name + ".act_scale", s
        tick()

    yield from mat("embed", fam.Src("model.embed_tokens.weight"), bits=cls_bits["embed"])
    for L, kind in enumerate(cfg.layer_types):
        p, q = f"layer.{L}.", f"model.layers.{L}."
        yield p + "attn_norm", wr.vector(fam.Src(q + "input_layernorm.weight"))
        yield p + "ffn_norm", wr.vector(fam.Src(q + "post_attention_layernorm.weight"))
        for name, src, k in fam.attention_sections(ck, cfg, L):
            if k == "matrix":
                kv = name.endswith((".wk", ".wv"))
                yield from mat(name, src, bits=cls_bits["attn_kv" if kv else "attn_qo"])
            else:
                yield name, wr.vector(src)
        if kind == "dense":
            for s, src in zip(("w1", "w3", "w2"), fam.dense_sources(ck, L)):
                yield from mat(p + s, src, bits=cls_bits["dense_ffn"])
        elif cfg.shared_expert_intermediate_size:
            for s, src in zip(("shared_w1", "shared_w3", "shared_w2"), fam.shared_sources(ck, L)):
                yield from mat(p + s, src, bits=cls_bits["shared_ffn"])
            if cfg.shared_expert_gate:
                g = wr.vector(fam.shared_gate_source(ck, L))
                yield p + "shared_gate", g.reshape(1, cfg.hidden_size)
    yield "final_norm", wr.vector(fam.Src("model.norm.weight"))
    if cfg.norm_type == "layer":                     # Phi-3.5-MoE: LayerNorm with a bias
        yield "final_norm_bias", wr.vector(fam.Src("model.norm.bias"))
    if "lm_head.bias" in wr.ck:
        yield "lm_head_bias", wr.vector(fam.Src("lm_head.bias"))
    if not cfg.tie_word_embeddings:
        yield from mat("lm_head", fam.Src("lm_head.weight"), bits=cls_bits["lm_head"])


def _routing_sections(wr: _Writer, cfg: ModelConfig) -> Iterator:
    for L in cfg.moe_layers:
        yield f"layer.{L}.router", wr.vector(fam.router_source(wr.ck, L))
        b = fam.router_bias_source(wr.ck, L)
        if b is not None and (cfg.scoring_func == "sigmoid" or cfg.select_bias_on_probs):
            yield f"layer.{L}.router_bias", wr.vector(b).reshape(-1)       # ERNIE's is [1, E]
        lb = gptoss.router_logit_bias(wr.ck, L) if cfg.architecture == gptoss.FAMILY else None
        if lb is not None:
            yield f"layer.{L}.router_logit_bias", lb


def _experts(wr: _Writer, cfg: ModelConfig, tick, bits: int) -> Iterator:
    I = cfg.expert_intermediate
    for L in cfg.moe_layers:
        for e in range(cfg.num_experts):
            if cfg.architecture == gptoss.FAMILY:       # MXFP4 at 4 bits, biases
                yield L, e, gptoss.expert_ffn(wr.ck, L, e, bits, wr.group_of("expert."))
                tick(3)
                continue
            srcs = fam.expert_sources(wr.ck, L, e, I)
            got = [wr.matrix(src, f"expert.{L}.{e}.{m}", bits)
                   for m, src in zip(("w1", "w3", "w2"), srcs)]
            ffn = FFNWeights(*(t for t, _ in got))
            ffn.act_scales = {m: s for m, (_, s) in zip(("w1", "w3", "w2"), got) if s is not None}
            yield L, e, ffn
            tick(3)


def _float_layer(wr: _Writer, L: int):
    """Layer L in float32 for calibration -> (LayerWeights, {matrix key: array})."""
    from ..model.mla import MLAWeights
    ck, cfg = wr.ck, wr.cfg
    keys: dict[str, np.ndarray] = {}

    def mat(key, src):
        a = np.ascontiguousarray(wr.float32(src), np.float32)
        keys[key] = a
        return a

    p, q = f"layer.{L}.", f"model.layers.{L}."
    d = {}
    for name, src, k in fam.attention_sections(ck, cfg, L):
        d[name[len(p):]] = mat(name, src) if k == "matrix" else wr.vector(src)
    attn = MLAWeights(**d) if cfg.attention == "mla" else AttentionWeights(**d)
    kind = cfg.layer_types[L]
    lw = LayerWeights(L, kind, wr.vector(fam.Src(q + "input_layernorm.weight")),
                      wr.vector(fam.Src(q + "post_attention_layernorm.weight")), attn)
    if kind == "dense":
        lw.dense = FFNWeights(*(mat(p + s, src) for s, src in
                                zip(("w1", "w3", "w2"), fam.dense_sources(ck, L))))
    else:
        lw.router = wr.vector(fam.router_source(ck, L))
        b = fam.router_bias_source(ck, L)
        lw.router_bias = (wr.vector(b).reshape(-1) if b is not None and (
            cfg.scoring_func == "sigmoid" or cfg.select_bias_on_probs) else None)
        I = cfg.expert_intermediate
        for e in range(cfg.num_experts):
            srcs = fam.expert_sources(ck, L, e, I)
            lw.experts.append(ModelExpert(L, e, FFNWeights(*(mat(f"expert.{L}.{e}.{m}", s)
                                                       for m, s in zip(("w1", "w3", "w2"), srcs)))))
        if cfg.shared_expert_intermediate_size:
            lw.shared = FFNWeights(*(mat(p + s, src) for s, src in
                                     zip(("shared_w1", "shared_w3", "shared_w2"), fam.shared_sources(ck, L))))
            if cfg.shared_expert_gate:
                lw.shared_gate = wr.vector(fam.shared_gate_source(ck, L)).reshape(1, -1)
    return lw, keys
