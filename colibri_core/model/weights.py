"""A model directory opened for inference: config, mapped files, and per-layer weight views
(the jump table: (layer, expert) -> section views, computed once at load). No math.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Optional, Union

import numpy as np

from ..config import ModelConfig, load_model_config
from ..errors import ModelFormatError
from ..format.filemap import check_map_count
from ..files import check_regular, read_bytes
from ..format.modelfile import (FORMAT_MAJOR, MAX_EXPERT_TABLE_BYTES, MAX_TABLE_BYTES,
                                ContainerFile, Tensor, expert_file_name, expert_name, sha256_file,
                                write_container)
from ..format.mxfp4 import MXFP4Tensor
from ..format.q5 import Q5Tensor
from ..format.quant import Q4Tensor, Q6Tensor, Q8Tensor

Matrix = Union[np.ndarray, Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor, MXFP4Tensor]


@dataclass
class FFNWeights:
    w1: Matrix   # gate [I, H]
    w3: Matrix   # up   [I, H]
    w2: Matrix   # down [H, I]
    # AWQ activation scales by matrix name ("w1", "w3", "w2"): the stored matrix is
    # W * s per column and the engine divides its input by s (sections "<name>.act_scale").
    act_scales: dict = field(default_factory=dict)
    # biases by matrix name, all three or none (gpt-oss's experts; sections "<name>.bias")
    biases: dict = field(default_factory=dict)


@dataclass
class ModelExpert:
    """One of the model's own experts (experts/protocol.py's Expert: the model reads no
    other kind, but the protocol lives with the kinds above the model that it names)."""
    layer: int
    index: int
    ffn: FFNWeights
    file: Optional[ContainerFile] = None   # the mapped expert_{layer}_{index}.bin

    @property
    def name(self) -> str:
        return expert_name(self.layer, self.index)

    @property
    def address(self) -> int:
        return self.file.base_address if self.file is not None else 0

    @property
    def nbytes(self) -> int:
        return self.file.size if self.file is not None else 0


@dataclass
class AttentionWeights:
    wq: Matrix                      # [heads*hd, H]
    wk: Matrix                      # [kv_heads*hd, H]
    wv: Matrix                      # [kv_heads*hd, H]
    wo: Matrix                      # [H, heads*hd]
    bq: Optional[np.ndarray] = None
    bk: Optional[np.ndarray] = None
    bv: Optional[np.ndarray] = None
    q_norm: Optional[np.ndarray] = None  # [hd] (per head) or [heads*hd] (whole projection)
    k_norm: Optional[np.ndarray] = None
    act_scales: dict = field(default_factory=dict)   # "wq".."wo" -> [cols] (AWQ)
    bo: Optional[np.ndarray] = None      # [H] the output projection's bias (gpt-oss)
    sinks: Optional[np.ndarray] = None   # [heads] attention sinks (cfg.attention_sinks)


@dataclass
class LayerWeights:
    index: int                       # global layer index
    kind: str                        # "dense" | "moe"
    attn_norm: np.ndarray            # [H]
    ffn_norm: np.ndarray             # [H]
    attn: AttentionWeights
    dense: Optional[FFNWeights] = None
    router: Optional[np.ndarray] = None       # [E, H] f32
    router_bias: Optional[np.ndarray] = None  # [E] selection-only bias
    router_logit_bias: Optional[np.ndarray] = None  # [E] added to the logits (gpt-oss)
    experts: list[ModelExpert] = field(default_factory=list)
    shared: Optional[FFNWeights] = None
    shared_gate: Optional[np.ndarray] = None  # [1, H]
    attn_norm_bias: Optional[np.ndarray] = None   # [H] norm_type "layer": the LayerNorms'
    ffn_norm_bias: Optional[np.ndarray] = None    # biases (Phi-3.5-MoE)


@dataclass
class ModelWeights:
    cfg: ModelConfig
    path: Path
    embed: Matrix                    # [V, H]
    final_norm: np.ndarray           # [H]
    lm_head: Matrix                  # [V, H] (the embedding when tied)
    layers: list[LayerWeights]
    files: list[ContainerFile]
    final_norm_bias: Optional[np.ndarray] = None  # [H] norm_type "layer"
    lm_head_bias: Optional[np.ndarray] = None     # [V] (Phi-3.5-MoE), or None

    def close(self) -> None:
        # Views first: a mapping is unmapped (and its file descriptor closed) only once no
        # array views into it are left, so drop ours before closing the files.
        self.layers = []
        self.embed = self.lm_head = self.final_norm = None
        for f in self.files:
            f.close()
        self.files = []


# ----------------------------------------------------------------------------- loading

def _plain_name(name: str) -> bool:
    """A file name inside the model directory: no folders, no '..', no NUL."""
    return bool(name) and name not in (".", "..") and not name.startswith("..") \
        and os.sep not in name and "/" not in name and "\0" not in name


def _check_files(cfg: ModelConfig, path: Path) -> None:
    if cfg.format is None:
        raise ModelFormatError(f"{path / 'config.json'}: no 'format' field; not a converted "
                               f"Colibri model directory")
    if cfg.format.major != FORMAT_MAJOR:
        raise ModelFormatError(f"{path / 'config.json'}: format {cfg.format.major}."
                               f"{cfg.format.minor}, this Colibri reads {FORMAT_MAJOR}.x; "
                               f"re-convert the model")
    for name, info in cfg.files.items():
        f = path / name
        if not _plain_name(name):
            raise ModelFormatError(f"{path / 'config.json'}: file name {name!r} is not a plain name")
        try:
            st = f.stat()
        except FileNotFoundError:
            raise ModelFormatError(f"{f}: missing (listed in config.json)") from None
        except OSError as e:
            raise ModelFormatError(f"{f}: cannot read ({e.strerror}; listed in config.json)") from None
        check_regular(f, st)                 # a FIFO would otherwise read as "size 0"
        size = st.st_size
        if size != info.size:
            raise ModelFormatError(f"{f}: size {size} bytes, config.json records {info.size}; "
                                   f"the file was truncated or replaced — re-convert or restore it")


def check_gate_up(path, w: FFNWeights) -> FFNWeights:
    """Gate (w1) and up (w3) read the same input, quantized once for both: they must share
    a number type and a group size (a mismatch would fail inside the kernels, mid-request)."""
    a, b = w.w1, w.w3
    if _describe(a) != _describe(b):
        raise ModelFormatError(
            f"{path}: gate (w1) is {_describe(a)} but up (w3) is {_describe(b)}; both must "
            f"have the same number type and group size (re-convert the model)")
    return w


def _describe(t) -> str:
    if isinstance(t, (Q4Tensor, Q5Tensor, Q6Tensor, Q8Tensor, MXFP4Tensor)):
        kind = {Q4Tensor: "q4", Q5Tensor: "q5", Q6Tensor: "q6", MXFP4Tensor: "mxfp4"}.get(type(t), "q8")
        return f"{kind} with group size {t.group}"
    return str(getattr(t, "dtype", type(t).__name__))


# Expert files with the same section table share one Sections mapping (modelfile._parsed):
# expert_ffn checks a table once per model shape, not once per file (6,144 files for
# Qwen3-30B-A3B). id(table) -> (table, hidden, inter); the table is held, so its id stays its.
_CHECKED_TABLES: dict = {}


def expert_ffn(f: ContainerFile, hidden: int, inter: int, buf: Optional[np.ndarray] = None,
               base: int = 0) -> Optional[FFNWeights]:
    """An expert file's FFN: its sections' shapes checked against the config, then views
    into the file (mapped or copied in), or into `buf` holding the file's bytes from offset
    `base` on (the memory budget's copy-in slots, residency.py). A file opened for its table
    only (load mode "header") and no `buf`: checked only, returns None."""
    hit = _CHECKED_TABLES.get(id(f.sections))
    checked = hit is not None and hit[0] is f.sections and hit[1:] == (hidden, inter)
    if not checked:
        _check_expert_table(f, hidden, inter)
    if buf is None and f.buf is None:
        return None
    w = FFNWeights(*(f.tensor(n, buf, base) for n in ("w1", "w3", "w2")))
    if not checked:
        check_gate_up(f.path, w)
        if isinstance(f.sections, MappingProxyType):      # shared by the files of a table
            if len(_CHECKED_TABLES) >= 64:
                _CHECKED_TABLES.clear()
            _CHECKED_TABLES[id(f.sections)] = (f.sections, hidden, inter)
    for m in ("w1", "w3", "w2"):              # equal AWQ scales share one array (as at load)
        if m + ".act_scale" in f:
            a = f.tensor(m + ".act_scale", buf, base)
            same = next((v for v in w.act_scales.values() if np.array_equal(v, a)), None)
            w.act_scales[m] = same if same is not None else a
        if m + ".bias" in f:
            w.biases[m] = f.tensor(m + ".bias", buf, base)
    return w


def _check_expert_table(f: ContainerFile, hidden: int, inter: int) -> None:
    want = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter),
            "w1.act_scale": (hidden,), "w3.act_scale": (hidden,), "w2.act_scale": (inter,),
            "w1.bias": (inter,), "w3.bias": (inter,), "w2.bias": (hidden,)}
    nb = sum(n + ".bias" in f.sections for n in ("w1", "w3", "w2"))
    if nb not in (0, 3):
        raise ModelFormatError(f"{f.path}: sections w1.bias, w3.bias, w2.bias: all three or "
                               f"none, found {nb}")
    for name, shape in want.items():
        s = f.sections.get(name)
        if s is None:
            if name.endswith((".act_scale", ".bias")):
                continue
            raise ModelFormatError(f"{f.path}: missing section '{name}'")
        if tuple(s.shape) != shape:
            raise ModelFormatError(f"{f.path}: section '{name}' has shape {list(s.shape)}, "
                                   f"expected {list(shape)} from config.json")


def load_model(path: Union[str, Path], load_mode: str = "mmap",
               lazy_experts: bool = False) -> ModelWeights:
    """Open a model directory. lazy_experts: routed expert files are opened for their
    section table only (ModelExpert.ffn is None); the memory budget's copy-in residency reads
    them into slots on demand (residency.py)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelFormatError(f"{path}: model directory not found")
    cfg = load_model_config(path / "config.json")
    _check_files(cfg, path)
    if load_mode == "mmap":     # one mapping per file: refused at once past vm.max_map_count
        check_map_count(2 + (0 if lazy_experts else len(cfg.moe_layers) * cfg.num_experts),
                        str(path))
    files: list[ContainerFile] = []

    def open_file(name: str, mode: str = load_mode,
                  max_table: int = MAX_TABLE_BYTES) -> ContainerFile:
        f = ContainerFile(path / name, mode, max_table)
        files.append(f)
        return f

    try:
        main = open_file("model.bin")
        routing = open_file("routing.bin") if cfg.moe_layers else None
        H = cfg.hidden_size

        def get(f: ContainerFile, name: str, shape=None, optional=False):
            if optional and name not in f:
                return None
            t = f.tensor(name)
            got = (t.rows, t.cols) if hasattr(t, "rows") else tuple(t.shape)
            if shape is not None and tuple(shape) != got:
                raise ModelFormatError(f"{f.path}: section '{name}' has shape {list(got)}, "
                                       f"expected {list(shape)} from config.json")
            return t

        def act_scales(f: ContainerFile, prefix: str, mats) -> dict:
            """Optional AWQ sections `<prefix><m>.act_scale`; equal scales share one array
            (w1/w3 of an FFN: their common input is divided once)."""
            out = {}
            for m, cols in mats:
                s = get(f, prefix + m + ".act_scale", (cols,), optional=True)
                if s is not None:
                    same = next((v for v in out.values() if np.array_equal(v, s)), None)
                    out[m] = same if same is not None else s
            return out

        def ffn(f: ContainerFile, prefix: str, names, I: int) -> FFNWeights:
            """names: section names of (gate, up, down) under `prefix`."""
            n1, n3, n2 = names
            w = check_gate_up(f.path, FFNWeights(get(f, prefix + n1, (I, H)),
                                                 get(f, prefix + n3, (I, H)),
                                                 get(f, prefix + n2, (H, I))))
            sc = act_scales(f, prefix, ((n1, H), (n3, H), (n2, I)))
            w.act_scales = {k: sc[n] for k, n in zip(("w1", "w3", "w2"), names) if n in sc}
            return w

        hd, nh, nkv = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
        layers = []
        for L, kind in enumerate(cfg.layer_types):
            p = f"layer.{L}."
            if cfg.attention == "mla":
                from .mla import load_mla_weights
                attn = load_mla_weights(
                    lambda n, shape, optional=False: get(main, n, shape, optional), p, cfg)
            else:
                attn = AttentionWeights(
                    wq=get(main, p + "wq", (nh * hd, H)), wk=get(main, p + "wk", (nkv * hd, H)),
                    wv=get(main, p + "wv", (nkv * hd, H)), wo=get(main, p + "wo", (H, nh * hd)),
                    bq=get(main, p + "bq", (nh * hd,), optional=True),
                    bk=get(main, p + "bk", (nkv * hd,), optional=True),
                    bv=get(main, p + "bv", (nkv * hd,), optional=True),
                    q_norm=get(main, p + "q_norm", optional=cfg.qk_norm in ("none", "l2")),
                    k_norm=get(main, p + "k_norm", optional=cfg.qk_norm in ("none", "l2")),
                    bo=get(main, p + "bo", (H,), optional=True),
                    sinks=get(main, p + "sinks", (nh,), optional=not cfg.attention_sinks),
                    act_scales=act_scales(main, p, (("wq", H), ("wk", H), ("wv", H),
                                                    ("wo", nh * hd))))
            lw = LayerWeights(L, kind, get(main, p + "attn_norm", (H,)),
                              get(main, p + "ffn_norm", (H,)), attn)
            if cfg.norm_type == "layer":             # LayerNorms: their biases
                lw.attn_norm_bias = get(main, p + "attn_norm_bias", (H,))
                lw.ffn_norm_bias = get(main, p + "ffn_norm_bias", (H,))
            if kind == "dense":
                lw.dense = ffn(main, p, ("w1", "w3", "w2"), cfg.intermediate_size)
            else:
                E, I = cfg.num_experts, cfg.expert_intermediate
                lw.router = np.ascontiguousarray(get(routing, p + "router", (E, H)), np.float32)
                lw.router_bias = get(routing, p + "router_bias", (E,), optional=True)
                lw.router_logit_bias = get(routing, p + "router_logit_bias", (E,), optional=True)
                for e in range(E):
                    if lazy_experts:
                        f = open_file(expert_file_name(L, e), "header", MAX_EXPERT_TABLE_BYTES)
                        lw.experts.append(ModelExpert(L, e, expert_ffn(f, H, I), f))
                        continue
                    f = open_file(expert_file_name(L, e), max_table=MAX_EXPERT_TABLE_BYTES)
                    lw.experts.append(ModelExpert(L, e, expert_ffn(f, H, I), f))
                if cfg.shared_expert_intermediate_size:
                    lw.shared = ffn(main, p, ("shared_w1", "shared_w3", "shared_w2"),
                                    cfg.shared_expert_intermediate_size)
                    if cfg.shared_expert_gate:
                        lw.shared_gate = get(main, p + "shared_gate", (1, H))
            layers.append(lw)
        embed = get(main, "embed", (cfg.vocab_size, H))
        lm_head = embed if cfg.tie_word_embeddings else get(main, "lm_head", (cfg.vocab_size, H))
        return ModelWeights(cfg, path, embed, get(main, "final_norm", (H,)), lm_head, layers, files,
                            get(main, "final_norm_bias", (H,)) if cfg.norm_type == "layer" else None,
                            get(main, "lm_head_bias", (cfg.vocab_size,), optional=True))
    except BaseException:
        for f in files:
            f.close()
        raise


# ----------------------------------------------------------------------------- writing

def write_model_dir(out: Path, cfg: ModelConfig,
                    main_sections: Iterable[tuple[str, Tensor]],
                    routing_sections: Iterable[tuple[str, Tensor]],
                    experts: Iterable[tuple[int, int, FFNWeights]],
                    extra_files: Iterable[Path] = (), main_reserve: Optional[int] = None,
                    check_finite: bool = True) -> ModelConfig:
    """Write a complete model directory into `out` (which must exist and be empty or a
    staging folder). config.json is written last, with sizes and hashes, so a directory
    without it is never mistaken for a model. Returns the final config.

    Sections are written as the iterables produce them (streaming: a generator's tensors
    are not all held at once); `main_reserve` sizes model.bin's header room (see
    modelfile.write_container). An expert's AWQ scales (`ffn.act_scales`) are written after
    its three matrices as `<name>.act_scale`.

    check_finite (default on): every tensor is checked as it is written
    (validate.check_tensor: no NaN/Inf values, finite q4/q8 scales); the first bad one
    raises ModelFormatError naming the file and section; that file is not renamed into
    place and config.json is not written."""
    from ..format.validate import checked
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def check(sections, name):
        # Messages name the file (expert_1_2.bin: layer 1, expert 2), not the folder: a
        # converter writes into a staging folder that is gone by the time one reads them.
        if not check_finite:
            return sections
        if isinstance(sections, (list, tuple)):      # keep write_container's exact layout
            return list(checked(sections, name))
        return checked(sections, name)               # streamed: checked one at a time

    minor = write_container(out / "model.bin", check(main_sections, "model.bin"), reserve=main_reserve)
    routing_sections = list(check(routing_sections, "routing.bin"))
    names = ["model.bin"]
    if routing_sections:
        minor = max(minor, write_container(out / "routing.bin", routing_sections))
        names.append("routing.bin")
    for L, e, ffn in experts:
        name = expert_file_name(L, e)
        minor = max(minor, write_container(out / name, check(
            [("w1", ffn.w1), ("w3", ffn.w3), ("w2", ffn.w2)]
            + [(f"{m}.act_scale", np.asarray(ffn.act_scales[m], np.float32))
               for m in ("w1", "w3", "w2") if m in ffn.act_scales]
            + [(f"{m}.bias", np.asarray(ffn.biases[m], np.float32))
               for m in ("w1", "w3", "w2") if m in ffn.biases], name)))
        names.append(name)
    for extra in extra_files:
        target = out / Path(extra).name
        if Path(extra).resolve() != target.resolve():
            target.write_bytes(read_bytes(extra))
        names.append(target.name)
    files = {n: {"size": (out / n).stat().st_size, "sha256": sha256_file(out / n)} for n in names}
    data = cfg.model_dump(exclude={"format", "files"})
    data["format"] = {"major": FORMAT_MAJOR, "minor": minor}   # the newest any file needs
    data["files"] = files
    final = ModelConfig.model_validate(data)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(final.model_dump(), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / "config.json")
    return final


def verify_checksums(path: Path) -> list[str]:
    """Problems found comparing every file's sha256 with config.json (empty: all good)."""
    cfg = load_model_config(Path(path) / "config.json")
    problems = []
    for name, info in sorted(cfg.files.items()):
        f = Path(path) / name
        if not _plain_name(name):
            problems.append(f"{Path(path) / 'config.json'}: file name {name!r} is not a plain name")
            continue
        try:
            st = f.stat()
            check_regular(f, st)
            if st.st_size != info.size:
                problems.append(f"{f}: size {st.st_size}, expected {info.size}")
            elif sha256_file(f) != info.sha256:
                problems.append(f"{f}: sha256 mismatch (file corrupted or modified)")
        except FileNotFoundError:
            problems.append(f"{f}: missing")
        except OSError as e:
            problems.append(f"{f}: cannot read ({e.strerror})")
        except ModelFormatError as e:        # not a regular file (sha256_file, check_regular)
            problems.append(str(e))
    return problems


_failed_once: set = set()


def run_own_code(ex, x: np.ndarray, out: np.ndarray, row_weights: np.ndarray) -> None:
    """A hot-plugged expert that brings its own code (ffn_forward, `ex.ffn` is None) on
    rows x [m, H]: out [m, H] += its output * row_weights [m]. The pipeline calls it
    between two C calls. A failing expert contributes nothing to these rows (logged once
    per expert); the hot-plug manager removes it at the next token boundary."""
    from ..errors import ExpertError
    y = np.empty_like(x)
    try:
        ex.forward(x, y)
    except ExpertError as e:
        if ex.name not in _failed_once:
            _failed_once.add(ex.name)
            logging.getLogger("colibri").warning(
                "%s failed (%s); it contributes nothing until it is removed", ex.name, e)
        return
    out += y * np.asarray(row_weights, np.float32)[:, None]
