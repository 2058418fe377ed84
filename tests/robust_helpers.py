"""Helpers shared by the robustness tests and the fuzzers: damaging model directories on
purpose, counting open files and mappings, running the CLI, bounding time and memory."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from colibri_core.format.modelfile import ContainerFile
from colibri_core.model.testing import write_random_model


# ----------------------------------------------------------------------------- model dirs

def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def refresh_files(d: Path) -> None:
    """Re-record every listed file's size and sha256 in config.json (so only the damage
    under test is seen, not a checksum or size mismatch)."""
    cfg = read_config(d)
    for name in cfg["files"]:
        p = d / name
        cfg["files"][name] = {"size": p.stat().st_size,
                              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    write_config(d, cfg)


def part_offset(path: Path, section: str, part: str = "data") -> tuple[int, int]:
    f = ContainerFile(path)
    try:
        return f.sections[section].parts[part]
    finally:
        f.close()


def poke(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def poke_f32(model_dir: Path, file: str, section: str, part: str, index: int, value: float,
             refresh: bool = True) -> None:
    """Overwrite float32 number `index` of a section's part (e.g. a q4 scale with NaN)."""
    off, _ = part_offset(model_dir / file, section, part)
    poke(model_dir / file, off + 4 * index, np.float32(value).tobytes())
    if refresh:
        refresh_files(model_dir)


# ----------------------------------------------------------------------------- resources

def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_of(path: Path | str) -> int:
    """Mappings of this process whose file lies under `path`."""
    prefix = str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if prefix in line)


@contextlib.contextmanager
def time_limit(seconds: float, what: str = "call"):
    """Fail (AssertionError) when the body runs longer than `seconds` (a hang)."""
    def on_alarm(signum, frame):
        raise AssertionError(f"{what} did not finish within {seconds} s (hang?)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def memory_limit(max_bytes: int, what: str = "call"):
    """Fail when the body's peak traced allocation (Python objects and numpy buffers)
    exceeds `max_bytes`: a table claiming a 1 TB section must be refused, not allocated."""
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not was:
            tracemalloc.stop()
    assert peak <= max_bytes, f"{what} allocated {peak / 2**20:.1f} MiB (limit {max_bytes / 2**20:.1f})"


# ----------------------------------------------------------------------------- CLI

def colibri_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "colibri_core", *map(str, args)]


def run_many(cases: dict[str, list[str]], timeout: float = 120) -> dict[str, subprocess.CompletedProcess]:
    """Run several CLI commands at once (each a separate process); results by name."""
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd="/")
             for k, cmd in cases.items()}
    out = {}
    for k, p in procs.items():
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            raise AssertionError(f"{k}: {cases[k]} timed out")
        out[k] = subprocess.CompletedProcess(cases[k], p.returncode, so, se)
    return out


def one_line(e: BaseException) -> str:
    """The error's text, asserted to be one line."""
    text = str(e)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


def damage_model(model: Path, how: str) -> None:
    """Break a copy of the tiny model in the way `how` names (test_damaged_models.DAMAGE)."""
    cfg = read_config(model)
    if how == "no config.json":
        (model / "config.json").unlink()
    elif how == "config.json truncated":
        (model / "config.json").write_text((model / "config.json").read_text()[:100])
    elif how == "config.json not an object":
        (model / "config.json").write_text("[1, 2]")
    elif how == "model.bin missing":
        (model / "model.bin").unlink()
    elif how == "expert file missing":
        (model / "expert_2_3.bin").unlink()
    elif how == "expert file missing, unlisted":
        (model / "expert_2_3.bin").unlink()
        del cfg["files"]["expert_2_3.bin"]
        write_config(model, cfg)
    elif how == "truncated":
        p = model / "expert_1_0.bin"
        p.write_bytes(p.read_bytes()[:5000])
    elif how == "truncated, size re-recorded":
        p = model / "expert_1_0.bin"
        p.write_bytes(p.read_bytes()[:5000])
        refresh_files(model)
    elif how == "resized":
        with open(model / "routing.bin", "ab") as f:
            f.write(b"\0" * 10)
    elif how == "bad magic":
        poke(model / "model.bin", 0, b"NOTCOLIB")
        refresh_files(model)
    elif how == "future major version":
        poke(model / "model.bin", 8, (7).to_bytes(2, "little"))
        refresh_files(model)
    elif how == "garbage table":
        poke(model / "expert_1_1.bin", 16, b"{not json")
        refresh_files(model)
    elif how == "table offset past end":
        raw = (model / "expert_1_1.bin").read_bytes()
        tlen = int.from_bytes(raw[12:16], "little")
        table = json.loads(raw[16:16 + tlen])
        table["sections"][0]["parts"]["data"][0] += 1 << 30
        new = json.dumps(table, separators=(",", ":")).encode()
        poke(model / "expert_1_1.bin", 12, len(new).to_bytes(4, "little") + new)
        refresh_files(model)
    elif how == "file name escapes":
        cfg["files"]["../model.bin"] = cfg["files"]["model.bin"]
        write_config(model, cfg)
    elif how == "file name with NUL":
        cfg["files"]["model\0.bin"] = cfg["files"]["model.bin"]
        write_config(model, cfg)
    elif how == "model.bin is a folder":
        (model / "model.bin").unlink()
        (model / "model.bin").mkdir()
        del cfg["files"]["model.bin"]
        write_config(model, cfg)
    elif how == "no format field":
        del cfg["format"]
        write_config(model, cfg)
    elif how == "format 2.0":
        cfg["format"]["major"] = 2
        write_config(model, cfg)
    elif how == "hidden_size changed":
        cfg["hidden_size"] = 64
        cfg["num_heads"] = 2
        write_config(model, cfg)
    elif how == "more experts than files":
        cfg["num_experts"] = 5
        write_config(model, cfg)
    elif how == "vocab_size changed":
        cfg["vocab_size"] = 300
        write_config(model, cfg)
    else:
        raise AssertionError(how)


def nan_model(tmp_path, section="lm_head", part="scales", index=0):
    """A random model whose `section` holds a NaN in `part` at `index`."""
    from colibri_core.model.testing import write_random_model
    d = tmp_path / "nan"
    write_random_model(d, seed=2)
    poke_f32(d, "model.bin", section, part, index, float("nan"))
    return d


def model_dict(**over):
    """A small valid ModelConfig as a dict, with `over` applied."""
    d = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_layers=2,
             num_heads=4, num_kv_heads=2, layer_types=["dense", "moe"], num_experts=4, top_k=2)
    d.update(over)
    return d


def solo_tokens(engine, prompt, n: int = 12) -> list:
    """A request's greedy tokens when it runs alone (the reference for concurrent runs)."""
    return engine.generate(prompt, max_new_tokens=n, temperature=0).run().token_ids


# ----------------------------------------------------------------------------- robustness tests
# (test_robustness.py and test_robustness_cli.py; test_hardening_server runs _default_sigint)

@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    """The tiny model with a byte-level tokenizer (256 ids, the model's whole vocab)."""
    from hf_helpers import write_tokenizer
    d = tmp_path_factory.mktemp("tokm")
    tok = write_tokenizer(d)
    write_random_model(d / "m", seed=1, tokenizer=tok)
    return d / "m"


def _tokenizer_with_id(d: Path, extra_id: int) -> Path:
    from hf_helpers import write_tokenizer
    d.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(d)
    data = json.loads(tok.read_text())
    data["model"]["vocab"]["<extra>"] = extra_id
    tok.write_text(json.dumps(data))
    return tok


def _default_sigint() -> None:
    """In the child before exec: a shell's background job (`nohup pytest ... &`) starts
    with SIGINT ignored, which Python keeps (no KeyboardInterrupt); put back the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
