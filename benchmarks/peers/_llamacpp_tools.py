"""llama.cpp's own command-line tools for the benchmarks (llama-batched-bench, llama-bench,
llama-server, llama-quantize), built on demand from the llama.cpp that llama-cpp-python's source
distribution vendors, and the Q4_0 GGUF of the Mixtral-shaped benchmark model made with
them when llama-cpp-python itself is not installed.

Everything is cached under build/llamacpp/ (git-ignored):

    sdist/   llama_cpp_python-*.tar.gz   (pip download --no-binary :all: --no-deps)
    src/     the unpacked sdist; its vendor/llama.cpp is the source built
    build/   cmake's build folder; the tools end up in build/bin/
    build.log

The build (about 11 minutes on 2 cores) runs under `nice -n 19`, as the machine is shared.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO

BASE = REPO / "build" / "llamacpp"
BUILD = BASE / "build"
TARGETS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-quantize")
CMAKE_FLAGS = ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
# /proc/cpuinfo flag -> ggml's CMake option, for a build without AMX (cpu_flags)
_GGML_ISA = {"sse4_2": "SSE42", "avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C",
             "bmi2": "BMI2", "avx_vnni": "AVX_VNNI", "avx512f": "AVX512",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16"}


def cpu_flags() -> list[str]:
    """ggml's ISA options for this CPU. -march=native (GGML_NATIVE) everywhere but on CPUs
    with AMX: there ggml compiles in its AMX matmul, which crashed (SIGSEGV in
    ggml_backend_amx_mul_mat, Q4_0, on the Xeon KVM guest this was measured on), so the
    ISA extensions are named one by one instead, AMX left out."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo")
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return []
    if not any(f.startswith("amx") for f in flags):
        return []
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{opt}={'ON' if f in flags else 'OFF'}"
                                    for f, opt in _GGML_ISA.items()]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def tool(name: str) -> Path | None:
    """The built tool `name` (e.g. "llama-batched-bench"), or None."""
    p = BUILD / "bin" / name
    return p if p.is_file() else None


def source_dir() -> Path | None:
    """vendor/llama.cpp of the unpacked llama-cpp-python sdist, or None."""
    got = sorted((BASE / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return got[-1] if got else None


def _run(cmd: list, what: str, logf) -> None:
    logf.write(f"$ {' '.join(map(str, cmd))}\n")
    logf.flush()
    p = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}); see {BASE / 'build.log'}")


def ensure_tools(targets=TARGETS, build: bool = True) -> dict:
    """{target: path} of the tools, building the missing ones when `build`. Raises
    RuntimeError (naming the failed step) when a tool is missing and cannot be built."""
    flags = CMAKE_FLAGS + cpu_flags()
    marker = BUILD / "colibri-cmake-flags.txt"
    stale = not marker.exists() or marker.read_text() != " ".join(flags)
    missing = [t for t in targets if tool(t) is None or stale]
    if missing and not build:
        raise RuntimeError(f"{', '.join(missing)} not built (see benchmarks/peers/_llamacpp_tools.py)")
    if missing:
        BASE.mkdir(parents=True, exist_ok=True)
        with open(BASE / "build.log", "a") as logf:
            src = source_dir()
            if src is None:
                sd = BASE / "sdist"
                if not sorted(sd.glob("llama_cpp_python-*.tar.gz")):
                    log("downloading the llama-cpp-python sdist (for its vendored llama.cpp) ...")
                    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                          "--no-deps", "llama-cpp-python", "-d", str(sd)], "pip download", logf)
                (BASE / "src").mkdir(exist_ok=True)
                _run(["tar", "xzf", str(sorted(sd.glob("llama_cpp_python-*.tar.gz"))[-1]),
                      "-C", str(BASE / "src")], "unpacking the sdist", logf)
                src = source_dir()
            if not (BUILD / "CMakeCache.txt").exists() or stale:
                _run(["nice", "-n", "19", "cmake", "-S", str(src), "-B", str(BUILD), *flags],
                     "cmake configure", logf)
                marker.write_text(" ".join(flags))
            log(f"building {', '.join(missing)} under nice -n 19 (about 11 minutes; log: "
                f"{BASE / 'build.log'}) ...")
            _run(["nice", "-n", "19", "cmake", "--build", str(BUILD), "-j2", "--target", *missing],
                 "cmake --build", logf)
    return {t: tool(t) for t in targets}


def import_gguf():
    """The `gguf` package: installed, else the gguf-py beside the vendored llama.cpp."""
    try:
        import gguf
        return gguf
    except ImportError:
        src = source_dir()
        if src is None or not (src / "gguf-py").is_dir():
            raise
        import importlib.util
        pkg = src / "gguf-py" / "gguf"
        spec = importlib.util.spec_from_file_location("gguf", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
        gguf = importlib.util.module_from_spec(spec)
        sys.modules["gguf"] = gguf
        spec.loader.exec_module(gguf)
        return gguf


def q4_gguf(hf: Path, work: Path, threads: int, build: bool = True) -> Path:
    """The Q4_0 GGUF of the benchmark model (work/model-q4_0.gguf, as bench_vs_llamacpp.py
    names it): the F16 GGUF written by _vs_models.build_gguf_f16, quantized with
    llama-cpp-python where it is installed, else with the llama-quantize tool (both call
    llama.cpp's llama_model_quantize)."""
    import os
    from benchmarks.peers._vs_models import build_gguf_f16, build_gguf_q4
    import_gguf()
    f16 = build_gguf_f16(hf, work / "model-f16.gguf")
    out = work / "model-q4_0.gguf"
    if out.exists() and out.stat().st_mtime >= f16.stat().st_mtime:
        return out
    try:
        import llama_cpp  # noqa: F401
        return build_gguf_q4(f16, out, threads)
    except ImportError:
        pass
    q = ensure_tools(("llama-quantize",), build)["llama-quantize"]
    tmp = out.with_suffix(".partial")
    log(f"quantizing to Q4_0 with {q} ...")
    p = subprocess.run([str(q), str(f16), str(tmp), "Q4_0", str(threads)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize failed (exit {p.returncode}): {p.stderr[-1500:]}")
    os.replace(tmp, out)
    return out


def parse_batched_bench(text: str) -> list[dict]:
    """The rows of llama-batched-bench's table (| PP | TG | B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s |) as dicts with those keys."""
    keys = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(keys):
            continue
        try:
            vals = [float(c) for c in cells]
        except ValueError:
            continue                   # the header and the separator line
        rows.append({k: (int(v) if k in ("PP", "TG", "B", "N_KV") else v)
                     for k, v in zip(keys, vals)})
    return rows
