"""What bench_pipeline.py measures its runs against: the bytes and multiply-adds a token
reads (from the model files' sections), the model files in or out of the page cache, the
cold read rate of the expert files, the q4 batch kernel's rate, and the lines of the
forward path."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO
from benchmarks.speed._pipeline_report import MiB

FORWARD_FILES = ("colibri_core/forward/model.py", "colibri_core/decode.py", "colibri_core/model/mla.py",
                 "colibri_core/model/ops.py", "colibri_core/model/routing.py", "colibri_core/kernels/__init__.py",
                 "colibri_core/forward/pipeline.py", "colibri_core/kernels/c/ck_core.c",
                 "colibri_core/kernels/c/ck_decode.c", "colibri_core/kernels/c/ck_pool.c",
                 "colibri_core/kernels/c/ck_step.c", "colibri_core/kernels/c/ck_step.h",
                 "colibri_core/kernels/c/ck_step_attn.c", "colibri_core/kernels/c/ck_step_moe.c",
                 "colibri_core/forward/steptables.py", "colibri_core/forward/reference.py", "colibri_core/model/kvcache.py")



def weights_per_token(model_dir: Path) -> dict:
    """What one token of single-sequence decode reads of the model's weights, and its
    multiply-adds, from the sections of the model's files: per part (embedding row,
    attention, dense FFN, shared experts, norms, routers, lm_head, and the routed experts
    at top-k of E per MoE layer) `bytes` and `macs` per token; `routed_expert` the bytes
    and multiply-adds of one routed expert (averaged over the model's); `fixed_bytes` /
    `fixed_macs` what every token reads whatever its experts; `bytes_per_token` the total."""
    from colibri_core.format.modelfile import ContainerFile
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    parts = {p: {"bytes": 0, "macs": 0} for p in
             ("embed", "attention", "dense", "shared", "norms", "router", "lm_head", "routed")}
    n_exp, exp_bytes, exp_macs = 0, 0, 0
    for fn in sorted(cfg["files"]):
        if not fn.endswith(".bin"):
            continue
        cf = ContainerFile(Path(model_dir) / fn)
        try:
            secs = list(cf.sections.values())
        finally:
            cf.close()
        if fn.startswith("expert_"):
            n_exp += 1
        for s in secs:
            nb = sum(n for _, n in s.parts.values())
            macs = int(np.prod(s.shape)) if len(s.shape) == 2 else 0
            name = s.name
            if fn.startswith("expert_"):
                exp_bytes, exp_macs = exp_bytes + nb, exp_macs + macs
                continue
            if fn == "routing.bin":
                part = "router"
            elif name == "embed":
                part, nb, macs = "embed", nb // cfg["vocab_size"], 0      # one row looked up
            elif name == "lm_head":
                part = "lm_head"
            elif len(s.shape) < 2 or name.endswith("norm") or name.endswith("act_scale"):
                part, macs = "norms", 0
            else:
                tail = name.rsplit(".", 1)[-1]
                part = ("shared" if tail.startswith("shared") else
                        "dense" if tail in ("w1", "w2", "w3") else "attention")
            parts[part]["bytes"] += nb
            parts[part]["macs"] += macs
    moe_layers = sum(t == "moe" for t in cfg.get("layer_types", [])) or (
        cfg["num_layers"] if n_exp else 0)
    k = cfg["top_k"] if n_exp else 0
    one = {"bytes": exp_bytes / max(n_exp, 1), "macs": exp_macs / max(n_exp, 1)}
    parts["routed"] = {"bytes": one["bytes"] * k * moe_layers, "macs": one["macs"] * k * moe_layers}
    fixed = {x: sum(v[x] for p, v in parts.items() if p != "routed") for x in ("bytes", "macs")}
    return {"parts": parts, "routed_expert": one, "top_k": k, "moe_layers": moe_layers,
            "experts_per_layer": cfg.get("num_experts", 0), "fixed_bytes": fixed["bytes"],
            "fixed_macs": fixed["macs"], "bytes_per_token": fixed["bytes"] + parts["routed"]["bytes"],
            "macs_per_token": fixed["macs"] + parts["routed"]["macs"]}


def model_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).iterdir() if p.suffix == ".bin")


def expert_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir() if p.name.startswith("expert_"))


def drop_cache(model_dir: Path) -> None:
    from colibri_core.memstat import drop_file_cache
    for f in Path(model_dir).iterdir():
        if f.suffix == ".bin":
            drop_file_cache(f, sync=True)


def warm_cache(model_dir: Path) -> None:
    """Read every model file once, so a run without a budget starts from the page cache."""
    buf = bytearray(8 * MiB)
    for f in sorted(Path(model_dir).iterdir()):
        if f.suffix == ".bin":
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def cold_read_rate(model_dir: Path, threads: int) -> dict:
    """Bytes/s of reading the expert files whole from a dropped page cache (posix_fadvise
    DONTNEED on each first), `threads` files at a time: the rate the expert cache's loads
    can expect from this disk. (What the cache loads is dropped again on eviction.)"""
    from concurrent.futures import ThreadPoolExecutor
    from colibri_core.memstat import drop_file_cache, file_cache_bytes
    files = expert_files(model_dir)
    for f in files:
        drop_file_cache(f, sync=True)
    left = sum(file_cache_bytes(f) for f in files)

    def read(f):
        buf = bytearray(MiB)
        n = 0
        with open(f, "rb", buffering=0) as fh:
            while (got := fh.readinto(buf)):
                n += got
        return n
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, files))
    dt = time.perf_counter() - t
    return {"GBps": total / dt / 1e9, "bytes": total, "files": len(files), "threads": threads,
            "cached_before": left}


def kernel_rate(threads: int, quick: bool) -> dict:
    """Multiply-adds/s of the q4 batch kernel (K.q4_matmul, int8 activations) on
    bench_kernels.py's 1024x2816 matrix with N = 8 (bench_kernels' case) and N = 64 tokens,
    hot, at `threads` threads, timed by bench_kernels.bench; `macs_per_s` the higher."""
    from benchmarks.speed import bench_kernels as BK
    from colibri_core import kernels as K
    from colibri_core.format.quant import quantize_q4
    K.set_threads(threads)
    rng = np.random.default_rng(0)
    rows, cols = 1024, 2816
    w = quantize_q4(rng.standard_normal((rows, cols)).astype(np.float32), 128)
    res = {"backend": K.backend(), "shape": [rows, cols], "threads": threads}
    for n in (8, 64):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        out = np.empty((n, rows), np.float32)
        s = BK.bench(lambda: K.q4_matmul(w, x, out, "int8"), 0.1 if quick else 0.5)
        res[f"N{n}_macs_per_s"] = n * rows * cols / s
    res["macs_per_s"] = max(res["N8_macs_per_s"], res["N64_macs_per_s"])
    return res


def forward_lines() -> dict:
    out = {}
    for rel in FORWARD_FILES:
        p = REPO / rel
        if not p.exists():
            continue
        lines = p.read_text().splitlines()
        out[rel] = {"lines": len(lines), "non_blank": sum(bool(x.strip()) for x in lines)}
    for lang, ext in (("python", ".py"), ("c", ".c")):
        sel = [v for k, v in out.items() if k.endswith(ext)]
        out[lang] = {"lines": sum(v["lines"] for v in sel), "non_blank": sum(v["non_blank"] for v in sel)}
    return out
