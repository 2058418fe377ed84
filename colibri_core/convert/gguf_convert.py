"""What `convert` does differently for a GGUF file (issue 33): the precision of each tensor
class is chosen from the GGUF's own types, the tokenizer comes from its metadata.

Precision: every GGUF tensor is dequantized (gguf package) and, per tensor class
(convert.TENSOR_CLASSES), stored in the Colibri format of the most bits per weight that
is not more than the GGUF's class had (its bits per weight over all its weights):
f32 (32) > the 16-bit type (16; an F16/BF16 tensor is copied bit for bit) > q8 (8.25) >
q6 (6.31) > q5 (5.31; not where rows are read one at a time: the embedding, a tied lm_head,
MLA's q/o) > q4 (4.31), each at the smallest group of 64, 128, 256 that keeps it under the
GGUF's bits (Q8_0's 8.5: q8 g64, 8.5; Q6_K's 6.56: q6 g128; Q5_K's 5.5: q5 g128, 5.31; a
Q5_K_M expert class of Q5_K and Q6_K, 5.85: q5 g64, 5.63; Q4_K's 4.5: q4 g128, 4.31; a
Q4_K_M expert class of Q4_K and Q6_K, ~4.8: q4 g64, 4.63). A class
below 4.16 bits (Q3_K, Q2_K) is refused in one line unless --bits (or a class's flag) asks
for a larger model: q4 g256 (4.16) is the floor.
What these choices leave under the GGUF's bits per weight (the whole model's) is then
spent on the embedding, the attention K/V, q/o and the lm_head, in that order
(HEADROOM_ORDER), so the model as a whole stays at or under the GGUF's bits per weight (a
tied lm_head is the embedding: counted once).
No C kernel runs a GGUF block format: K-quants, Q8_0 and MXFP4 are requantized.
`--bits` / `--tensor-bits` (and the per-class flags) override the choice as for a
checkpoint folder.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from .gguf_families import TYPE_BITS
from .gguf_reader import GGUFSource, open_gguf

from .classes import FIVE_BIT_CLASSES, SIX_BIT_CLASSES


def stored_bits(bits: int, group: int, shapes=None) -> float:
    """Colibri's stored bits per weight of a format (data, f32 scale, u8 zero point), over
    matrices of `shapes` (rows, cols) when given: a row is padded to whole groups."""
    if bits in (32, 16):
        return float(bits)
    per_group = {8: 32, 6: 40, 5: 40, 4: 40}[bits]
    if not shapes:
        return bits + per_group / group
    stored = weights = 0
    for r, c in shapes:
        ng = -(-c // group)
        stored += r * (ng * group * bits + ng * per_group)
        weights += r * c
    return stored / max(weights, 1)


def tensor_class(hf_name: str) -> Optional[str]:
    """TENSOR_CLASSES entry of a Hugging Face weight name (None: norms, routers, biases)."""
    if hf_name == "model.embed_tokens.weight":
        return "embed"
    if hf_name == "lm_head.weight":
        return "lm_head"
    if not hf_name.endswith(".weight") or "norm" in hf_name:
        return None
    if ".mlp.experts." in hf_name:
        return "experts"
    if ".mlp.shared_experts." in hf_name:
        return "shared_ffn"
    if hf_name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")):
        return "dense_ffn"
    if ".self_attn." in hf_name:
        return "attn_kv" if hf_name.endswith(("k_proj.weight", "v_proj.weight")) else "attn_qo"
    return None


def class_types(src: GGUFSource, shapes: Optional[dict] = None) -> dict[str, dict[str, int]]:
    """{class: {GGUF type: weights}}; fills `shapes` with {class: [(rows, cols), ..]}."""
    out: dict[str, dict[str, int]] = {}
    shapes = {} if shapes is None else shapes
    for n in src.ck.names():
        c = tensor_class(n)
        if c is None:
            continue
        for t, w in src.ck.types_of([n]).items():
            d = out.setdefault(c, {})
            d[t] = d.get(t, 0) + w
        shapes.setdefault(c, []).append(tuple(src.ck.shape(n)))
    if "lm_head" not in out and "embed" in out:        # tied: the embedding is the lm_head
        out["lm_head"] = dict(out["embed"])
        shapes["lm_head"] = list(shapes["embed"])
    return out


def class_bits(types: dict[str, int]) -> float:
    w = sum(types.values())
    return sum(TYPE_BITS[t] * n for t, n in types.items()) / max(w, 1)


GROUPS = (64, 128, 256)


def choose(cls: str, gguf_bits: float, groups=GROUPS, shapes=None,
           five=FIVE_BIT_CLASSES) -> tuple[int, int]:
    """(bits, group) for a class: the most bits per weight not above the GGUF's (stored
    over the class's matrices, padding included), at the smallest group that keeps it so;
    when nothing fits, q4 at the group that stores the fewest bits (the floor). `five`: the
    classes that may be q5."""
    cands = tuple(b for b in (32, 16, 8, 6, 5, 4) if (b != 6 or cls in SIX_BIT_CLASSES)
                  and (b != 5 or cls in five))
    for b in cands:
        for g in sorted(groups):
            if stored_bits(b, g, shapes) <= gguf_bits + 1e-9:
                return b, g
    return 4, min(sorted(groups), key=lambda g: stored_bits(4, g, shapes))


def _below_floor(name: str, cls: str, types: dict, gguf_bits: float, b: int, g: int) -> str:
    """A class stored in fewer bits than Colibri's smallest format (Q3_K, Q2_K, IQ*): the
    requantized model would be larger than the GGUF, which the user must ask for."""
    kinds = "+".join(sorted(types))
    return (f"{name}: tensor class {cls} is {kinds} ({gguf_bits:.2f} bits per weight), below "
            f"Colibri's smallest format (q{b} g{g}, {stored_bits(b, g):.2f} bits); convert "
            f"with --bits 4 to accept a larger model, or from a Q4 (or larger) GGUF")


def prepare(path: Path, bits: Optional[int], tensor_bits: Optional[dict], group_size: int,
            group_given: bool, calibration) -> tuple[GGUFSource, int, dict, int, dict]:
    """-> (source, bits, tensor_bits, group size, the GGUF record for config.json, whose
    "group_size" is the group of each class)."""
    if calibration is not None:
        raise ConfigError(f"--calibration: {path} is a GGUF file (already quantized); AWQ "
                          f"calibration applies to Hugging Face checkpoints")
    src = open_gguf(path)
    shapes: dict = {}
    types = class_types(src, shapes)
    gb = {c: class_bits(t) for c, t in types.items()}
    groups = (group_size,) if group_given else GROUPS
    tb = dict(tensor_bits or {})
    cls_group = {}
    # q5 nowhere its rows are read one at a time (convert refuses it): a tied lm_head (the
    # embedding), MLA's attention (wkv_b)
    five = tuple(c for c in FIVE_BIT_CLASSES if not (c == "lm_head" and src.hf["tie_word_embeddings"])
                 and not (c == "attn_qo" and src.arch == "deepseek2"))
    for c, v in gb.items():
        # nominal bits (matrices whole groups wide, as at real sizes): on narrower test
        # matrices the padding would steer the choice away from what a real file gets
        b, g = choose(c, v, groups, five=five)
        if bits is None and c not in tb:
            if stored_bits(b, g) > v + 1e-9:
                raise ConfigError(_below_floor(src.path.name, c, types[c], v, b, g))
            tb[c] = b
        cls_group[c] = g if tb.get(c, bits) == b else min(groups)
    headroom = {}
    if bits is None:
        tied = src.hf["tie_word_embeddings"]
        skip = set(tensor_bits or {}) | ({"embed", "lm_head"} if tied else set())
        # tied: the lm_head is the embedding's weights, stored once (counted once)
        headroom = _headroom({c: t for c, t in types.items() if not (tied and c == "lm_head")},
                             gb, tb, cls_group, groups, skip, five)
    if bits is None:
        # the model-wide --bits (every class is in tb): the FFN's, where it is one of them
        bits = next((b for b in (tb.get("experts"), tb.get("dense_ffn")) if b in (4, 8, 16, 32)), 4)
    record = {"file": src.path.name, "architecture": src.arch, "group_size": cls_group,
              **({"headroom": headroom} if headroom else {}),
              "classes": {c: {"types": {t: n for t, n in sorted(types[c].items())},
                              "bits": round(gb[c], 4)} for c in sorted(types)}}
    return src, bits, tb, group_size, record


# the formats a class may move up to with the headroom, best first
_UP = ((8, 64), (8, 128), (8, 256), (6, 64), (6, 128), (6, 256), (5, 64), (5, 128), (5, 256))
# the classes that take the headroom, in this order: the embedding (one row read per
# token: file size only), then the attention K/V, q/o and the lm_head (small next to the
# experts). FFN classes are most of the model: a step up would not fit under the GGUF's bits.
HEADROOM_ORDER = ("embed", "attn_kv", "attn_qo", "lm_head")


def _headroom(types: dict, gb: dict, tb: dict, cls_group: dict, groups, skip, five=()) -> dict:
    """Spend what the classes' choices left under the GGUF's bits per weight (the whole
    model's, over all matrix classes) on HEADROOM_ORDER, each class moved up to the best
    format that keeps the model at or under the GGUF's bits per weight. At 4-5 bits the
    embedding and the attention matrices carry a large share of the logit error for their
    size (as for checkpoints, where --bits 4 keeps the embedding and K/V at q8)."""
    w = {c: sum(t.values()) for c, t in types.items()}
    if any(c not in tb for c in w):
        return {}
    gguf_total = sum(gb[c] * w[c] for c in w)
    ours = {c: stored_bits(tb[c], cls_group[c]) for c in w}
    done = {}
    for c in HEADROOM_ORDER:
        if c not in w or c in skip:
            continue
        rest = sum(ours[k] * w[k] for k in w if k != c)
        for b, g in _UP:
            if (len(groups) == 1 and g not in groups) or (b == 5 and c not in five):
                continue
            sb = stored_bits(b, g)
            if sb > ours[c] and rest + sb * w[c] <= gguf_total + 1e-6:
                done[c] = f"q{b} g{g} ({sb:.2f} bits) instead of {ours[c]:.2f}"
                tb[c], cls_group[c], ours[c] = b, g, sb
                break
    if done:
        done["model"] = (f"{sum(ours[c] * w[c] for c in w) / sum(w.values()):.2f} bits per "
                         f"weight, the GGUF's {gguf_total / sum(w.values()):.2f}")
    return done


def report(record: dict, rows: list[dict]) -> list[str]:
    """Lines: per class, the GGUF's types and bits per weight -> what was stored."""
    stored = {r["class"]: r for r in rows}
    out = ["colibri: GGUF tensor classes: GGUF types (bits per weight) -> stored (bits per weight)"]
    for c, g in record["classes"].items():
        r = stored.get(c)
        kinds = "+".join(g["types"])
        to = f"{r['formats']} {r['bits']:.2f}" if r else "(tied: the embedding)"
        verdict = "tied" if not r else "kept" if set(g["types"]) <= {"F32", "F16", "BF16"} and \
            r["bits"] >= g["bits"] else "requantized"
        out.append(f"  {c:<11} {kinds:<16} {g['bits']:6.2f} -> {to:<18} {verdict}")
    for c, what in (record.get("headroom") or {}).items():
        if c != "model":
            out.append(f"  {c}: {what} (the model's headroom under the GGUF's bits)")
    tot = [r for r in rows if r["class"] in record["classes"]]
    if tot:
        gw = sum(sum(record["classes"][r["class"]]["types"].values()) for r in tot)
        gbits = sum(record["classes"][r["class"]]["bits"] * sum(record["classes"][r["class"]]["types"].values())
                    for r in tot) / max(gw, 1)
        sbits = 8 * sum(r["bytes"] for r in tot) / max(sum(r["weights"] for r in tot), 1)
        out.append(f"  {'all':<11} {'':<16} {gbits:6.2f} -> {sbits:.2f}")
    return out


# ----------------------------------------------------------------------------- tokenizer

def tokenizer_files(src: GGUFSource, tokenizer_dir: Optional[Path],
                    names: tuple) -> tuple[list[Path], str]:
    """Tokenizer files for the converted model, and a line saying where they came from.
    With `tokenizer_dir`, its files are copied; otherwise tokenizer.json is built from the
    GGUF's metadata by transformers' GGUF loader (when transformers is installed) and the
    chat template written from `tokenizer.chat_template`."""
    if tokenizer_dir is not None:           # names: convert.TOKENIZER_FILES
        d = Path(tokenizer_dir)
        files = [d / n for n in names if os.path.lexists(d / n)]
        if not any(f.name == "tokenizer.json" for f in files):
            raise ConfigError(f"--tokenizer {d}: no tokenizer.json in it")
        return files, f"tokenizer files from {d}"
    tmp = Path(tempfile.mkdtemp(prefix="colibri-gguf-tok-"))
    src._tmp = tmp                                   # removed by cleanup()
    files: list[Path] = []
    tmpl = src.meta.get("tokenizer.chat_template")
    cfg: dict = {}
    if src.add_bos is not None:
        cfg["add_bos_token"] = bool(src.add_bos)
    if isinstance(tmpl, str):
        (tmp / "chat_template.jinja").write_text(tmpl)
        files.append(tmp / "chat_template.jinja")
    why = _build_tokenizer_json(src, tmp, cfg)
    if why is None:
        files.insert(0, tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    files.append(tmp / "tokenizer_config.json")
    if why is not None:
        return files, (f"tokenizer: not built from {src.path.name} ({why}); pass --tokenizer DIR "
                       f"(the model's Hugging Face tokenizer.json folder), or run from token ids")
    return files, (f"tokenizer.json built from {src.path.name}'s metadata (transformers' GGUF "
                   f"loader)" + (", chat template from tokenizer.chat_template" if tmpl else ""))


def _build_tokenizer_json(src: GGUFSource, out: Path, cfg: dict) -> Optional[str]:
    if src.meta.get("tokenizer.ggml.model") is None:
        return "the file has no tokenizer metadata"
    return build_tokenizer_json(src.parts[0], int(src.hf["vocab_size"]), out, cfg)


def build_tokenizer_json(path: Path, vocab: int, out: Path, cfg: dict) -> Optional[str]:
    """Write out/tokenizer.json from the GGUF's tokenizer metadata (and fill the
    tokenizer_config `cfg`); None, or why it could not be built."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except Exception:
        return "building it needs transformers' GGUF tokenizer loader (pip install transformers)"
    try:
        arch, tok, tok_cfg = get_gguf_tokenizer(str(path))
        fast, extra = convert_gguf_tokenizer(arch, tok)
        if tok.get("tokenizer_type") == "llama" and _space_prefix(path):
            _llama_space_prefix(fast)
        fast.save(str(out / "tokenizer.json"))
        _drop_added_past(out / "tokenizer.json", vocab)
    except Exception as e:
        return f"transformers could not build it: {type(e).__name__}: {str(e)[:120]}"
    for k, v in {**tok_cfg, **(extra or {})}.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            cfg.setdefault(k, v)
    return None


def _space_prefix(path: Path) -> bool:
    """tokenizer.ggml.add_space_prefix (llama.cpp's default for SPM vocabularies: true)."""
    import gguf
    f = gguf.GGUFReader(str(path), "r").fields.get("tokenizer.ggml.add_space_prefix")
    return True if f is None else bool(f.contents())


def _llama_space_prefix(fast) -> None:
    """A sentencepiece vocabulary with add_space_prefix: "\u2581" before the text and every
    space as "\u2581" (the normalizer of Llama/Mistral tokenizer.json files, and what
    llama.cpp does), so a text that starts with spaces keeps all of them; transformers'
    GGUF builder's Metaspace pre-tokenizer drops one ("  " -> "\u2581\u2581")."""
    from tokenizers import normalizers
    fast.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                            normalizers.Replace(" ", "\u2581")])
    fast.pre_tokenizer = None


def _drop_added_past(path: Path, vocab: int) -> None:
    """Remove added tokens with ids the model has no row for (transformers' GPT-2 builder
    adds an `<|endoftext|>` when the file's vocabulary lacks one)."""
    t = json.loads(path.read_text(encoding="utf-8"))
    kept = [a for a in t.get("added_tokens") or [] if a.get("id", 0) < vocab]
    if len(kept) != len(t.get("added_tokens") or []):
        t["added_tokens"] = kept
        path.write_text(json.dumps(t, ensure_ascii=False), encoding="utf-8")


def cleanup(src: GGUFSource) -> None:
    tmp = getattr(src, "_tmp", None)
    if tmp is not None:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
