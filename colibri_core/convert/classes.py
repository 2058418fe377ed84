"""The tensor classes of a converted model: what each matrix section is (its class, set
as a whole by `tensor_bits`) and what each class was stored as (`colibri inspect`, the
GGUF report)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

# Tensor classes, each set as a whole (`tensor_bits`); attn_qo is every attention matrix
# but K/V (MLA: wq / wq_a / wq_b, wkv_a, wkv_b, wo).
TENSOR_CLASSES = ("embed", "lm_head", "attn_qo", "attn_kv", "dense_ffn", "shared_ffn", "experts")
# q6 where the C pipeline runs it: every class (the embedding rows, the products of the
# lm_head, the attention and, in the expert block's tiles, the FFNs).
SIX_BIT_CLASSES = TENSOR_CLASSES
# q5 (format/q5.py) where the C pipeline runs it in matrix products: not the embedding, whose
# rows are read one at a time (nor a tied lm_head, nor MLA's attn_qo with its wkv_b rows:
# convert refuses those); for GGUF Q5_K classes (issue 33).
FIVE_BIT_CLASSES = ("lm_head", "attn_qo", "attn_kv", "dense_ffn", "shared_ffn", "experts")

_ATTN_QO = ("wq", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b")


def tensor_class(name: str) -> Optional[str]:
    """The TENSOR_CLASSES entry of a model.bin matrix section (None: not a matrix class)."""
    if name in ("embed", "lm_head"):
        return name
    last = name.rsplit(".", 1)[-1]
    if last in ("wk", "wv"):
        return "attn_kv"
    if last in _ATTN_QO:
        return "attn_qo"
    if last in ("w1", "w3", "w2"):
        return "dense_ffn"
    if last.startswith("shared_w"):
        return "shared_ffn"
    return None


def tensor_classes(model_dir) -> list[dict]:
    """What each tensor class of a converted model was stored as, from the files' section
    tables: [{class, count (matrices), formats (e.g. "q6 g128"), weights, bytes, bits
    (stored bits per weight: data, scales and zero points)}], in TENSOR_CLASSES order."""
    from ..format.modelfile import ContainerFile, MAX_EXPERT_TABLE_BYTES
    model_dir = Path(model_dir)
    acc: dict[str, dict] = {}

    def add(cls: str, s, times: int = 1):
        a = acc.setdefault(cls, {"class": cls, "count": 0, "formats": set(), "weights": 0,
                                 "bytes": 0})
        a["count"] += times
        a["formats"].add(f"{s.dtype} g{s.group_size}" if s.group_size else s.dtype)
        rows, cols = s.shape
        a["weights"] += times * rows * cols
        a["bytes"] += times * sum(n for _, n in s.parts.values())

    f = ContainerFile(model_dir / "model.bin", "header")
    try:
        for s in f.sections.values():
            cls = tensor_class(s.name)
            if cls is not None and len(s.shape) == 2:
                add(cls, s)
    finally:
        f.close()
    experts = sorted(model_dir.glob("expert_*.bin"))
    if experts:                          # every expert file has the same layout
        e = ContainerFile(experts[0], "header", MAX_EXPERT_TABLE_BYTES)
        try:
            for m in ("w1", "w3", "w2"):
                add("experts", e.sections[m], len(experts))
        finally:
            e.close()
    out = []
    for cls in TENSOR_CLASSES:
        if cls in acc:
            a = acc[cls]
            out.append(dict(a, formats=", ".join(sorted(a["formats"])),
                            bits=8.0 * a["bytes"] / max(a["weights"], 1)))
    return out
