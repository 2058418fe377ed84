"""Activation-aware weight quantization (AWQ) for the converter.

Two things live here:

1. **Calibration** (`calibrate`): the model runs in float (Colibri's own forward, float
   routing and activations) over the tokens of a calibration text, one layer at a time so
   only one layer's float weights are in memory. Every linear's input activations are
   recorded; for each set of linears that share an input, a per-input-channel scale is
   searched as AutoAWQ does: `s = a^alpha` or ("duo") `s = a^alpha / w_mean^(1-alpha)`,
   a = mean|x| per channel, normalised so that sqrt(max*min) = 1, alpha on a grid in
   [0, 1], minimising the output error ||x W^T - x (Q(W s)/s)^T||^2 on those activations.
   Plain alpha = 0 is RTN, so the choice is never worse than RTN on the calibration set.
   Then, per matrix, a weight-clipping ratio (each group clipped to +-ratio * max|w|
   before rounding, AutoAWQ's auto-clip with one ratio per matrix) is searched the same
   way. Candidates are scored with the q4 rounding rule the matrix is stored with
   (`q4_clip`). The matrix is stored as Q(clip(W*s)) together with s (section
   `<name>.act_scale`), and the engine divides its input by s before the matmul. Nothing
   is folded into the norm that the router shares with the experts. The one exception
   is an FFN's down projection: its input scale is folded exactly into the rows of the
   up projection of the same FFN (the up projection's output feeds nothing else, and
   row-wise quantization is unchanged by a row factor), so the fused expert kernel keeps
   running without a division inside it.

2. **Import** of checkpoints already quantized by AutoAWQ (GEMM packing, 4 bits, zero
   point): the packed integers, zero points and scales map one to one onto Colibri's q4
   layout, so they are copied without re-quantizing (`awq_q4`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..model import ops
from ..errors import ColibriError, ConfigError
from ..files import read_text
from ..runtime.tokenizer import library_message
from ..format.quant import DEFAULT_Q4_CLIP, Q4Tensor, fake_quant_q4, pack_nibbles, padded_cols
from .families import Src
from .safetensors_reader import Checkpoint

log = logging.getLogger("colibri")

ALPHAS = np.round(np.linspace(0.0, 1.0, 11), 2)
MAX_SEARCH_ROWS = 128          # activation rows used to score one candidate scale
MIN_EXPERT_ROWS = 8            # fewer routed rows: score an expert on all the layer's rows

# ----------------------------------------------------------------------------- AutoAWQ import

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble j of a packed int32 holds column 8c + ORDER[j]


@dataclass(frozen=True)
class AwqSpec:
    bits: int
    group: int


def awq_spec(hf: dict) -> Optional[AwqSpec]:
    """The checkpoint's AutoAWQ settings, or None when it is not AWQ-quantized; refuses
    AWQ variants whose packing is not the GEMM one."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "awq":
        return None
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    version = str(q.get("version", "gemm")).lower()
    zp = q.get("zero_point", True)
    if bits != 4 or version != "gemm" or not zp:
        raise ConfigError(f"config.json: AWQ checkpoint with bits={bits}, version={version!r}, "
                          f"zero_point={zp} is not supported (supported: 4-bit GEMM packing "
                          f"with zero points)")
    return AwqSpec(bits, group)


def _unpack_awq(packed: np.ndarray) -> np.ndarray:
    """int32 [n, m/8] (AutoAWQ order) -> uint8 [n, m] values 0..15."""
    p = np.asarray(packed).view(np.uint32)
    n, m8 = p.shape
    out = np.empty((n, m8, 8), dtype=np.uint8)
    for j, col in enumerate(AWQ_ORDER):
        out[:, :, col] = (p >> (4 * j)) & 0xF
    return out.reshape(n, m8 * 8)


def awq_parts(ck: Checkpoint, src: Src, spec: AwqSpec):
    """(q uint8 [out, in], zeros uint8 [out, in/G], scales float32 [out, in/G])."""
    q = _unpack_awq(ck.raw(src.name + ".qweight")).T            # [out, in]
    z = _unpack_awq(ck.raw(src.name + ".qzeros")).T             # [out, in/G]
    s = ck.get(src.name + ".scales").T                          # [out, in/G]
    rows, cols = q.shape
    if cols % spec.group or z.shape != (rows, cols // spec.group) or s.shape != z.shape:
        raise ConfigError(f"checkpoint: {src.name}: AWQ tensors have inconsistent shapes "
                          f"(qweight -> {list(q.shape)}, qzeros -> {list(z.shape)}, scales -> "
                          f"{list(s.shape)}, group {spec.group})")
    return np.ascontiguousarray(q), np.ascontiguousarray(z), np.ascontiguousarray(s, np.float32)


def awq_dequantize(ck: Checkpoint, src: Src, spec: AwqSpec) -> np.ndarray:
    q, z, s = awq_parts(ck, src, spec)
    g = spec.group
    return ((q.astype(np.float32) - np.repeat(z, g, axis=1)) * np.repeat(s, g, axis=1)).astype(np.float32)


def awq_q4(ck: Checkpoint, src: Src, spec: AwqSpec) -> Q4Tensor:
    """The AWQ matrix as a Colibri q4 tensor, bit for bit (no re-quantization)."""
    if spec.group % 64:
        raise ConfigError(f"checkpoint: AWQ group size {spec.group} cannot be imported as q4 "
                          f"(Colibri's groups are multiples of 64); convert with --bits 8, 16 "
                          f"or 32 to dequantize it instead")
    q, z, s = awq_parts(ck, src, spec)
    rows, cols = q.shape
    cp = padded_cols(cols, spec.group)          # == cols (AWQ needs cols % group == 0)
    return Q4Tensor(pack_nibbles(q[:, :cp]), s, z, rows, cols, spec.group)


# ----------------------------------------------------------------------------- fake quant

def fake_quant(w: np.ndarray, bits: int, group: int, q4_clip: str = DEFAULT_Q4_CLIP) -> np.ndarray:
    """Dequantized float64 copy of `w` after Colibri's q4 / q8 rounding (docs/FORMAT.md),
    vectorized over groups (same results as quant.quantize_q4(clip=q4_clip) / quantize_q8)."""
    w = np.asarray(w, np.float64)
    if bits != 8:
        return fake_quant_q4(w, group, q4_clip)
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    wp = np.full((rows, cp), np.nan)
    wp[:, :cols] = w
    g = wp.reshape(rows, cp // group, group)
    amax = np.nanmax(np.abs(g), axis=2)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32).astype(np.float64)
    q = np.clip(np.round(g / scale[:, :, None]), -127, 127)
    return (q * scale[:, :, None]).reshape(rows, cp)[:, :cols]


def clip_groups(w: np.ndarray, group: int, ratio: float) -> np.ndarray:
    """`w` with every (row, group) clipped to +-ratio * its largest magnitude (AutoAWQ's
    weight clipping; ratio 1 changes nothing). Partial last groups use their real values."""
    w = np.asarray(w, np.float64)
    rows, cols = w.shape
    cp = padded_cols(cols, group)
    wp = np.zeros((rows, cp))
    wp[:, :cols] = w
    g = wp.reshape(rows, cp // group, group)
    m = np.abs(g).max(axis=2, keepdims=True) * ratio
    return np.clip(g, -m, m).reshape(rows, cp)[:, :cols]


# ----------------------------------------------------------------------------- search

@dataclass
class SearchResult:
    alpha: float
    err: float        # output error with the chosen scale
    err_rtn: float    # output error with plain RTN (alpha = 0)
    duo: bool = False # s = a^alpha / w_mean^(1-alpha) (else a^alpha)


def _w_mean(ws: list[np.ndarray], group: int) -> np.ndarray:
    """AutoAWQ's per-input-channel weight magnitude: |w| / (max |w| of its row group),
    averaged over all rows of the matrices."""
    acc, n = None, 0
    for w in ws:
        rows, cols = w.shape
        cp = padded_cols(cols, group)
        wp = np.zeros((rows, cp))
        wp[:, :cols] = np.abs(w)
        g = wp.reshape(rows, cp // group, group)
        g = g / (g.max(axis=2, keepdims=True) + 1e-6)
        m = g.reshape(rows, cp)[:, :cols].sum(axis=0)
        acc = m if acc is None else acc + m
        n += rows
    return acc / n


def _out_err(x: np.ndarray, d: np.ndarray) -> float:
    return float(np.square(x @ d.astype(np.float32).T, dtype=np.float32).sum(dtype=np.float64))


def search_scale(ws: list[np.ndarray], x: np.ndarray, mean_abs: np.ndarray, bits: int,
                 group: int, q4_clip: str = DEFAULT_Q4_CLIP) -> tuple[Optional[np.ndarray], SearchResult]:
    """Best per-input-channel scale for the matrices `ws` ([R_i, C] each) sharing input
    rows `x` [N, C]; None when plain RTN (alpha = 0) is best.

    Candidates (as AutoAWQ): s = a^alpha and, "duo", s = a^alpha / w_mean^(1 - alpha), with
    a = mean|x| per channel, alpha = 0, 0.1, .., 1 and then the two midpoints beside the
    best; s normalised so that sqrt(max*min) = 1. A candidate's error is
    ||x (Q(W s)/s - W)^T||^2 summed over the matrices (float32)."""
    x = np.ascontiguousarray(x, np.float32)
    a = np.asarray(mean_abs, np.float64)
    a = np.maximum(a, max(a.max(), 1e-12) * 1e-5)               # channels never active
    ws64 = [np.asarray(w, np.float64) for w in ws]
    wm = np.maximum(_w_mean(ws64, group), 1e-4)
    tried: dict[tuple[bool, float], tuple[float, np.ndarray]] = {}

    def score(duo: bool, alpha: float) -> float:
        key = (duo, round(alpha, 3))
        if key not in tried:
            s = a ** alpha / (wm ** (1 - alpha) if duo else 1.0)
            s = s / np.sqrt(s.max() * s.min())
            err = sum(_out_err(x, fake_quant(w * s[None, :], bits, group, q4_clip) / s[None, :] - w)
                      for w in ws64)
            tried[key] = (err, s)
        return tried[key][0]

    for alpha in ALPHAS:
        score(False, float(alpha))
        if alpha < 1:
            score(True, float(alpha))
    duo, best = min(tried, key=lambda k: (tried[k][0], k))
    for alpha in (best - 0.05, best + 0.05):
        if 0.0 < alpha < 1.0:
            score(duo, alpha)
    key = min(tried, key=lambda k: (tried[k][0], k))
    err, s = tried[key]
    res = SearchResult(float(key[1]), err, tried[(False, 0.0)][0], duo=key[0])
    if key == (False, 0.0):
        return None, res
    return s.astype(np.float32), res


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)


def search_clip(w: np.ndarray, x: np.ndarray, bits: int, group: int,
                q4_clip: str = DEFAULT_Q4_CLIP) -> Optional[float]:
    """Best weight-clipping ratio for one (already scaled) matrix on its (already divided)
    inputs x; None when no clipping is best. One ratio per matrix, so what has to be kept
    until the matrix is written is a single number."""
    x = np.ascontiguousarray(x, np.float32)
    w = np.asarray(w, np.float64)
    errs = [(_out_err(x, fake_quant(clip_groups(w, group, r), bits, group, q4_clip) - w), -r)
            for r in CLIP_RATIOS]
    err, neg_r = min(errs)
    return None if neg_r == -1.0 else -neg_r


# ----------------------------------------------------------------------------- calibration

@dataclass
class Scales:
    """What the converter applies per matrix key (model.bin section name, or
    `expert.{L}.{E}.w1|w3|w2`)."""
    act: dict = field(default_factory=dict)        # key -> s: store Q(W*s) + section s
    fold_cols: dict = field(default_factory=dict)  # key -> s: W*s, no section (down proj)
    fold_rows: dict = field(default_factory=dict)  # key -> s: rows W/s (up proj)
    clip: dict = field(default_factory=dict)       # key -> ratio: clip groups before rounding
    results: dict = field(default_factory=dict)    # key -> SearchResult (for reports)
    tokens: int = 0

    def summary(self) -> dict:
        r = list(self.results.values())
        if not r:
            return {}
        return {"groups": len(r), "scaled": sum(x.alpha > 0 or x.duo for x in r),
                "clipped": len(self.clip),
                "mean_alpha": round(float(np.mean([x.alpha for x in r])), 3),
                "calib_err_reduction": round(1.0 - sum(x.err for x in r) / max(sum(x.err_rtn for x in r), 1e-30), 4)}


class _Recorder:
    """Model.observer: input activations of every linear, by weight identity."""

    def __init__(self):
        self.x: dict[int, list[np.ndarray]] = {}

    def __call__(self, w, x):
        self.x.setdefault(id(w), []).append(np.array(x, np.float32))

    def rows(self, w) -> Optional[np.ndarray]:
        got = self.x.get(id(w))
        return np.concatenate(got, axis=0) if got else None


def _subsample(x: np.ndarray, n: int = MAX_SEARCH_ROWS) -> np.ndarray:
    if x.shape[0] <= n:
        return x
    return x[np.linspace(0, x.shape[0] - 1, n).round().astype(np.int64)]


def calibration_tokens(hf_dir: Path, text_file: Path, cfg, max_tokens: int) -> list[list[int]]:
    """The calibration text as token sequences (chunks of at most 128 tokens)."""
    tok = Path(hf_dir) / "tokenizer.json"
    if not os.path.lexists(tok):
        raise ConfigError(f"--calibration needs {tok} to tokenize {text_file}")
    text = read_text(text_file, lambda msg: ConfigError(f"--calibration {msg}"))
    from tokenizers import Tokenizer
    try:                    # read through files.py, not by the library: no FIFO waits
        hf_tok = Tokenizer.from_str(read_text(tok, ConfigError))
    except ColibriError:
        raise
    except Exception as e:
        raise ConfigError(f"{tok}: unreadable tokenizer ({library_message(e)})") from None
    ids = hf_tok.encode(text, add_special_tokens=False).ids
    ids = [i for i in ids if i < cfg.vocab_size][:max_tokens]
    if len(ids) < 16:
        raise ConfigError(f"--calibration {text_file}: only {len(ids)} tokens; give at least "
                          f"16 (a few paragraphs are better)")
    chunk = min(128, cfg.max_position_embeddings - 1)
    seqs = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    if cfg.bos_token_id is not None:
        seqs = [[cfg.bos_token_id] + s for s in seqs]
    return seqs


def _moe_float(model, cfg, lw, xn: np.ndarray, kt: np.ndarray) -> np.ndarray:
    """The MoE block in float (same math as ReferenceModel._moe with float routing), running every
    expert through model._ffn so the observer sees each expert's own rows."""
    from ..model.routing import route
    r = route(ops.router_logits(xn, lw.router), kt, mode="float", scoring=cfg.scoring_func,
              norm_topk_prob=cfg.norm_topk_prob, bias=lw.router_bias, n_group=cfg.n_group,
              topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor,
              bias_on_probs=cfg.select_bias_on_probs)
    y = np.zeros_like(xn)
    for e in np.unique(r.ids[r.ids >= 0]):
        rows, slot = np.nonzero(r.ids == e)
        buf = np.zeros((len(rows), xn.shape[1]), dtype=np.float32)
        model._ffn(lw.experts[e].ffn, np.ascontiguousarray(xn[rows]), buf,
                   row_weights=np.ascontiguousarray(r.weights[rows, slot], np.float32), accumulate=True)
        y[rows] += buf
    if lw.shared is not None:
        sh = np.empty_like(xn)
        model._ffn(lw.shared, xn, sh)
        if lw.shared_gate is not None:
            sh *= ops.sigmoid(xn @ np.asarray(lw.shared_gate, np.float32).T)
        y += sh
    return y


def calibrate(cfg, seqs: list[list[int]], embed: np.ndarray, layer_loader: Callable,
              bits: int, group: int, tick: Callable = lambda n=1: None,
              q4_clip: str = DEFAULT_Q4_CLIP) -> Scales:
    """Run the float model layer by layer over `seqs`, searching AWQ scales as it goes.

    layer_loader(L) -> (LayerWeights of float32 arrays, {matrix key: weight array}) where
    the keys name the matrices as the converter does."""
    from ..config import EngineConfig
    from ..forward.reference import ReferenceModel
    from ..model.weights import ModelWeights

    mw = ModelWeights(cfg, Path("."), embed=None, final_norm=None, lm_head=None, layers=[], files=[])
    model = ReferenceModel(mw, EngineConfig(routing="float", activations="float", prefetch="none"))
    caches = [model.new_cache(len(s)) for s in seqs]
    pos = np.concatenate([np.arange(len(s)) for s in seqs])
    spans, t = [], 0
    for s, c in zip(seqs, caches):
        spans.append((t, t + len(s), c))
        t += len(s)
    ids = np.concatenate([np.asarray(s, np.int64) for s in seqs])
    x = np.asarray(embed[ids], np.float32) * np.float32(cfg.embedding_multiplier)
    kt = np.full(len(ids), cfg.top_k)
    out = Scales(tokens=len(ids))

    def search(keys_ws, xr):
        """Scale search for matrices sharing inputs xr, then a clip search per matrix."""
        if xr is None or not len(xr):
            return None
        xs = _subsample(xr)
        s, res = search_scale([w for _, w in keys_ws], xs, np.abs(xr).mean(axis=0), bits, group,
                              q4_clip)
        out.results[keys_ws[0][0]] = res
        for k, w in keys_ws:
            r = search_clip(w if s is None else w * s[None, :],
                            xs if s is None else xs / s[None, :], bits, group, q4_clip)
            if r is not None:
                out.clip[k] = r
        return s

    for L in range(cfg.num_layers):
        lw, keys = layer_loader(L)
        rec = _Recorder()
        model.observer = rec
        xa = model._rmsnorm(x, lw.attn_norm)
        x = x + model._attention(lw, xa, pos, spans)
        xn = model._rmsnorm(x, lw.ffn_norm)
        if lw.kind == "dense":
            y = np.empty_like(xn)
            model._ffn(lw.dense, xn, y)
        else:
            y = _moe_float(model, cfg, lw, xn, kt)
        x = x + y * np.float32(cfg.residual_multiplier)
        model.observer = None
        # --- searches for this layer
        by_id = {id(w): k for k, w in keys.items()}

        def key(w):
            return by_id[id(w)]

        a = lw.attn
        if cfg.attention == "mla":
            first = [m for m in (a.wq, a.wq_a) if m is not None][0]
            groups = [[first, a.wkv_a]] + ([[a.wq_b]] if a.wq_b is not None else []) + [[a.wkv_b], [a.wo]]
        else:
            groups = [[a.wq, a.wk, a.wv], [a.wo]]
        for g in groups:
            s = search([(key(w), np.asarray(w, np.float32)) for w in g], rec.rows(g[0]))
            if s is not None:
                for w in g:
                    out.act[key(w)] = s
        ffns = [(lw.dense, None)] if lw.kind == "dense" else []
        if lw.kind == "moe":
            ffns += [(ex.ffn, xn) for ex in lw.experts]
            if lw.shared is not None:
                ffns.append((lw.shared, None))
        for ffn, fallback in ffns:
            xr = rec.rows(ffn.w1)
            if fallback is not None and (xr is None or len(xr) < MIN_EXPERT_ROWS):
                xr = fallback
            s = search([(key(ffn.w1), ffn.w1), (key(ffn.w3), ffn.w3)], xr)
            if s is not None:
                out.act[key(ffn.w1)] = out.act[key(ffn.w3)] = s
            hr = rec.rows(ffn.w2)
            if fallback is not None and (hr is None or len(hr) < MIN_EXPERT_ROWS):
                hr = ops.silu(fallback @ ffn.w1.T) * (fallback @ ffn.w3.T)
            s2 = search([(key(ffn.w2), ffn.w2)], hr)
            if s2 is not None:
                out.fold_cols[key(ffn.w2)] = s2
                out.fold_rows[key(ffn.w3)] = s2
        model.__dict__.pop("_mla_wkv_b", None)
        tick(1)
        del lw, keys, rec
    return out
