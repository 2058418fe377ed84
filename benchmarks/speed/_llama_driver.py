"""llama.cpp's side of bench_outofmem.py: _llama_decode.c (mmap, no repack unless asked;
its graph's ffn_moe_topk read through the eval callback) built against the libllama of
_llamacpp_tools.py, its command line, and its output as the Colibri child's fields."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO

DRIVER_SRC = REPO / "benchmarks" / "speed" / "_llama_decode.c"
DRIVER = REPO / "build" / "outofmem" / "_llama_decode"


def build_driver() -> Path:
    from benchmarks.peers._llamacpp_tools import ensure_tools
    tools = ensure_tools(("llama-bench",), build=False)
    bindir = Path(tools["llama-bench"]).parent
    src = next((REPO / "build" / "llamacpp" / "src").glob("*/vendor/llama.cpp"))
    if DRIVER.exists() and DRIVER.stat().st_mtime >= DRIVER_SRC.stat().st_mtime:
        return DRIVER
    DRIVER.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-O2", "-o", str(DRIVER), str(DRIVER_SRC), f"-I{src}/include",
                    f"-I{src}/ggml/include", f"-L{bindir}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{bindir}"], check=True)
    return DRIVER


IDS = OUT / "outofmem_ids.txt"


def write_ids(V: int) -> Path:
    OUT.mkdir(exist_ok=True)
    IDS.write_text(" ".join(map(str, np.random.default_rng(31).integers(1, V - 1, 4096))) + "\n")
    return IDS


def llama_cmd(gguf: Path, a, repack: int = 0) -> list:
    return [str(DRIVER), str(gguf), str(a.threads), str(a.warmup), str(a.tokens), "1",
            str(repack), "1", str(IDS)]


def llama_row(row: dict, expert_bytes_per_token: float, n_tokens: int) -> dict:
    """The driver's output as the Colibri child's fields."""
    if "runs" not in row:
        return row
    r = row.pop("runs")[0]
    row.update(s_per_token=r["s"] / n_tokens, tok_s=r["tok_s"], read_per_token=r["read"] / n_tokens)
    row["hit_rate"] = max(0.0, 1 - row["read_per_token"] / expert_bytes_per_token)
    row["routed"] = {str(i): c for i, c in enumerate(row.pop("routed", []))}
    return row
