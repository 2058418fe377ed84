"""Property-based tests and structural fuzzers (hypothesis) on everything that reads
user-supplied bytes: config files, model directories (container tables, config.json),
the prompt's MODE: prefix and token ids, and the ELF metadata reader of hot-plugged experts.

The contract, for every input: return normally or raise one of the documented typed errors
(ColibriError subclasses: ConfigError, ModelFormatError, RequestError, ExpertRejected...),
finish within a time limit (no hang), and allocate a bounded amount of memory (tracemalloc:
a table claiming a 1 TB section is refused before anything is allocated).

Valid inputs are mutated *structurally*: fields of the section table, of config.json, of
the ELF header, section and program headers, symbol table entries and the expert metadata
record are set to boundary values (0, -1, 2**31, 2**63, the file size, ...) or random ones,
as well as random byte flips and truncations.

CI runs a few hundred examples per fuzzer (tens of seconds in all). A longer run:

    COLIBRI_FUZZ_EXAMPLES=100000 python -m pytest tests/test_fuzz.py -q
    python benchmarks/fuzz.py --minutes 30          # rounds with fresh seeds, a summary

COLIBRI_FUZZ_REPORT=path.json writes how many inputs each fuzzer tried (docs/ROBUSTNESS.md).
"""
from __future__ import annotations

import atexit
import copy
import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colibri_core.config import (EngineConfig, ModelConfig, RunConfig, load_model_config,
                                 load_run_config, parse, read_mapping)
from colibri_core.errors import (ColibriError, ConfigError, ExpertIndexError, ModelFormatError,
                                 RequestError)
from colibri_core.hotplug.errors import ExpertRejected
from colibri_core.modelfile import _PREFIX, ContainerFile
from colibri_core.requests import split_mode_prefix
from colibri_core.weights import load_model

from robust_helpers import memory_limit, time_limit

SCALE = float(os.environ.get("COLIBRI_FUZZ_SCALE", "1"))
FIXED = os.environ.get("COLIBRI_FUZZ_EXAMPLES")


def examples(default: int) -> int:
    """Examples per fuzzer: the CI default (tuned to keep the file near 15 s on 2 idle cores),
    or COLIBRI_FUZZ_EXAMPLES for a long run."""
    return int(FIXED) if FIXED else max(1, int(default * SCALE))


def fuzz(default: int):
    return settings(max_examples=examples(default), deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


TRIED: Counter = Counter()          # inputs tried per fuzzer (reported on exit)
TIME_LIMIT_S = 10.0                 # one input must be handled within this (hang guard)
MEM_LIMIT = 64 << 20                # ... and allocate at most this (the inputs are < 1 MiB)


def _report():
    path = os.environ.get("COLIBRI_FUZZ_REPORT")
    if path and TRIED:
        old = {}
        if os.path.exists(path):
            try:
                old = json.loads(Path(path).read_text())
            except ValueError:
                old = {}
        for k, v in TRIED.items():
            old[k] = old.get(k, 0) + v
        Path(path).write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


atexit.register(_report)


def guarded(name: str, fn, allowed=(ColibriError,)):
    """Run fn under the time and memory guards; only the typed errors are allowed out.
    Returns fn's result, or the (allowed) exception."""
    TRIED[name] += 1
    with time_limit(TIME_LIMIT_S, name), memory_limit(MEM_LIMIT, name):
        try:
            return fn()
        except allowed as e:
            text = str(e)
            assert text.strip(), f"{name}: empty error message from {type(e).__name__}"
            return e


# ============================================================================ values

# Boundary values that break naive readers, plus anything JSON can hold.
EDGE_INTS = [0, 1, -1, 2, 3, 63, 64, 65, 127, 128, 4095, 4096, 4097, 2 ** 16, 2 ** 31 - 1,
             2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40, 2 ** 40 + 1, 2 ** 53, 2 ** 63 - 1, 2 ** 63,
             2 ** 64, -(2 ** 63), 10 ** 30]
json_scalars = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["", "q4", "q8", "f32", "f16", "bf16", "moe", "dense", "mla", "gqa",
                     "softmax", "sigmoid", "yarn", "\x00", "x" * 300]))
json_values = st.recursive(json_scalars,
                           lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                   st.dictionaries(st.text(max_size=8), inner,
                                                                   max_size=4)),
                           max_leaves=12)


def _paths(obj, prefix=()):
    """Every path (tuple of keys/indices) into a JSON-like value, the root excluded."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw, base, n_max: int = 3, values=json_values):
    """`base` (a JSON-like dict) with 1..n_max structural mutations: a field set to another
    value, deleted, duplicated into a new key, or a new key added."""
    obj = copy.deepcopy(base)

    def value():                    # a fresh copy: sampled constants are shared objects
        return copy.deepcopy(draw(values))
    for _ in range(draw(st.integers(1, n_max))):
        paths = _paths(obj)
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add", "list"]))
        if not paths or op == "add":
            parent = obj if not paths else _get(obj, draw(st.sampled_from(paths))[:-1])
            if isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = value()
            continue
        path = draw(st.sampled_from(paths))
        parent = _get(obj, path[:-1])
        if op == "delete":
            del parent[path[-1]]
        elif op == "list" and isinstance(parent[path[-1]], list):
            lst = parent[path[-1]]
            how = draw(st.sampled_from(["empty", "double", "first", "reverse", "append"]))
            new = {"empty": [], "double": lst * 2, "first": lst[:1], "reverse": lst[::-1],
                   "append": lst + [value()]}[how]
            lst[:] = copy.deepcopy(new)
        else:
            parent[path[-1]] = value()
    return obj


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


# ============================================================================ configs

def _valid_model_config(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "config.json").read_text())


RUN_CONFIG = {"model": "builtin", "description": "x",
              "engine": {"threads": 2, "load_mode": "mmap", "routing": "fixed",
                         "activations": "int8", "prefetch": "willneed",
                         "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 0,
                                      "max_new_tokens": 64, "stop": ["\n\n"]},
                         "length_policy": [{"max_tokens": 31, "k": 1}, {"min_tokens": 129, "k": 2}],
                         "hotplug": {"isolation": "inprocess", "allowlist": None,
                                     "probe_timeout_s": 5.0, "settle_s": 0.2},
                         "debug": ["routing"], "max_resident_mb": None}}


def test_shipped_run_config_shape_is_valid():
    parse(RunConfig, RUN_CONFIG, "fuzz base")


@pytest.fixture(scope="module")
def model_cfg_base(tiny_model_dir):
    return _valid_model_config(tiny_model_dir)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@fuzz(200)
@given(data=st.data())
def test_fuzz_config_structures(model_cfg_base, data):
    """ModelConfig / RunConfig / EngineConfig from structurally mutated valid dicts."""
    which = data.draw(st.sampled_from(["model", "run", "engine"]))
    if which == "model":
        d = data.draw(mutated(model_cfg_base))

        def go():
            cfg = parse(ModelConfig, d, "config.json")
            try:
                cfg.check_experts()
            except ExpertIndexError:
                pass
            return cfg
        guarded("config: ModelConfig structure", go)
    elif which == "run":
        d = data.draw(mutated(RUN_CONFIG))
        guarded("config: RunConfig structure", lambda: parse(RunConfig, d, "run.yaml"))
    else:
        d = data.draw(mutated(RUN_CONFIG["engine"]))
        guarded("config: EngineConfig structure", lambda: parse(EngineConfig, d, "engine"))


def _yaml_dump(obj) -> str:
    import yaml
    return yaml.safe_dump(obj, allow_unicode=True)


@fuzz(160)
@given(data=st.data())
def test_fuzz_config_files(model_cfg_base, scratch, data):
    """read_mapping / load_run_config / load_model_config on mutated files, as text (JSON,
    YAML) and as raw bytes (truncations, flips, garbage)."""
    which = data.draw(st.sampled_from(["run", "model"]))
    base = RUN_CONFIG if which == "run" else model_cfg_base
    d = data.draw(mutated(base))
    ext = data.draw(st.sampled_from([".json", ".yaml"]))
    try:
        text = (json.dumps(d) if ext == ".json" else _yaml_dump(d)).encode("utf-8", "surrogatepass")
    except (ValueError, TypeError):
        text = b"{}"
    how = data.draw(st.sampled_from(["as is", "as is", "truncate", "flip", "garbage", "splice"]))
    if how == "truncate" and text:
        text = text[:data.draw(st.integers(0, len(text) - 1))]
    elif how == "flip" and text:
        raw = bytearray(text)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        text = bytes(raw)
    elif how == "garbage":
        text = data.draw(st.binary(max_size=200))
    elif how == "splice":
        text = text + data.draw(st.sampled_from([b"\n- x\n", b"\n&a [*a]\n", b"\x00", b": :",
                                                 b"\n? [a]\n: 1\n", b"\n!!python/object {}\n"]))
    p = scratch / f"cfg{ext}"
    p.write_bytes(text)

    def go():
        if which == "run":
            return load_run_config(p)
        return load_model_config(p)
    got = guarded(f"config: {which} file", go)
    if not isinstance(got, BaseException):
        read_mapping(p)                  # what loaded is a mapping


# ============================================================================ requests

@fuzz(1000)
@given(prompt=st.one_of(
    st.text(),
    st.text().map(lambda s: "MODE:" + s),
    st.tuples(st.text(alphabet="0123456789k٣x|-+ ", max_size=8), st.text()).map(
        lambda t: "MODE:k" + t[0] + "|" + t[1]),
    st.tuples(st.integers(-5, 20000), st.text()).map(lambda t: f"MODE:k{t[0]}|{t[1]}")))
def test_fuzz_mode_prefix(prompt):
    got = guarded("requests: MODE: prefix", lambda: split_mode_prefix(prompt), (RequestError,))
    if isinstance(got, RequestError):
        assert prompt.startswith("MODE:") and "\n" not in str(got)
        return
    k, rest = got
    if not prompt.startswith("MODE:"):
        assert (k, rest) == (None, prompt)
    else:
        assert isinstance(k, int) and 1 <= k <= 9999
        assert prompt == f"MODE:k{prompt[6:prompt.index('|')]}|" + rest
        assert int(prompt[6:prompt.index("|")]) == k


@given(k=st.integers(1, 9999), text=st.text())
@fuzz(300)
def test_mode_prefix_round_trip(k, text):
    TRIED["requests: MODE: round trip"] += 1
    assert split_mode_prefix(f"MODE:k{k}|{text}") == (k, text)


@pytest.fixture(scope="module")
def tok_engine(tmp_path_factory):
    from hf_helpers import write_tokenizer

    from colibri_core.engine import Engine
    from colibri_core.testing import write_random_model
    d = tmp_path_factory.mktemp("fuzzeng")
    write_random_model(d / "m", seed=4, tokenizer=write_tokenizer(d))
    e = Engine.from_model_dir(d / "m", threads=1)
    yield e
    e.close()


token_like = st.one_of(st.integers(), st.sampled_from(EDGE_INTS), st.floats(), st.text(max_size=3),
                       st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
                       st.just(np.int64(3)), st.just(np.float32(1.0)))


@fuzz(300)
@given(prompt=st.one_of(st.text(max_size=200), st.lists(token_like, max_size=12),
                        st.binary(max_size=8), st.integers(), st.none(),
                        st.lists(st.integers(0, 255), min_size=1, max_size=400)),
       top_k=st.one_of(st.none(), st.integers(-2, 6), st.floats(), st.booleans()))
def test_fuzz_request_inputs(tok_engine, prompt, top_k):
    eng = tok_engine

    def go():
        ids, prefix_k, _ = eng.prepare_ids(prompt, reserve=1)
        k, _ = eng.choose_k(len(ids), top_k, prefix_k, {})
        return ids, k
    got = guarded("requests: prompt and top_k", go, (RequestError,))
    if not isinstance(got, BaseException):
        ids, k = got
        assert ids and all(type(t) is int and 0 <= t < eng.model_cfg.vocab_size for t in ids)
        assert len(ids) < eng.model_cfg.max_position_embeddings
        assert 1 <= k <= eng.num_experts


# ============================================================================ containers

def _split(raw: bytes):
    magic, major, minor, tlen = _PREFIX.unpack_from(raw, 0)
    table = json.loads(raw[_PREFIX.size:_PREFIX.size + tlen])
    room = min(off for s in table["sections"] for off, _ in s["parts"].values())
    return table, room


def _join(raw: bytes, table, room: int, prefix=None) -> bytes | None:
    text = json.dumps(table, separators=(",", ":")).encode()
    if _PREFIX.size + len(text) > room:
        return None
    head = prefix if prefix is not None else _PREFIX.pack(*_PREFIX.unpack_from(raw, 0)[:3], len(text))
    out = bytearray(raw)
    out[:room] = b"\0" * room
    out[:_PREFIX.size] = head
    out[_PREFIX.size:_PREFIX.size + len(text)] = text
    return bytes(out)


SECTION_FIELDS = ["name", "dtype", "shape", "group_size", "parts"]


@st.composite
def mutated_container(draw, raw: bytes, size: int):
    """A container file's bytes with its table, prefix or bytes mutated."""
    table, room = _split(raw)
    op = draw(st.sampled_from(["table", "table", "table", "prefix", "bytes", "truncate"]))
    if op == "table":
        values = st.one_of(json_values, st.sampled_from(
            [size, size - 4096, size + 1, room, room - 1, 4096 * 1000, 2 ** 40 * 4096]))
        t = draw(mutated(table, n_max=4, values=values))
        out = _join(raw, t, room)
        assume(out is not None)
        return out
    if op == "prefix":
        magic, major, minor, tlen = _PREFIX.unpack_from(raw, 0)
        field = draw(st.sampled_from(["magic", "major", "minor", "tlen"]))
        if field == "magic":
            magic = draw(st.sampled_from([b"COLIBRI\x01", b"\0" * 8, b"\x7fELF\0\0\0\0"]))
        elif field == "major":
            major = draw(st.sampled_from([0, 2, 0xFFFF]))
        elif field == "minor":
            minor = draw(st.integers(0, 0xFFFF))
        else:
            tlen = draw(st.sampled_from([0, 1, tlen - 1, tlen + 1, size, size - 15, 2 ** 26,
                                         2 ** 26 + 1, 2 ** 32 - 1]))
        out = bytearray(raw)
        out[:_PREFIX.size] = _PREFIX.pack(magic, major, minor, tlen)
        return bytes(out)
    if op == "truncate":
        return raw[:draw(st.sampled_from([0, 1, 15, 16, 100, room - 1, room, size // 2, size - 1]))]
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 8))):
        hi = draw(st.sampled_from([room, size])) - 1
        out[draw(st.integers(0, hi))] = draw(st.integers(0, 255))
    return bytes(out)


@pytest.fixture(scope="module")
def container_bytes(tiny_model_dir):
    return {n: (tiny_model_dir / n).read_bytes() for n in ("expert_1_2.bin", "routing.bin")}


def _touch(f: ContainerFile) -> None:
    """Read every section through the public API (views must lie inside the file)."""
    for name in list(f.sections):
        t = f.tensor(name)
        arrays = (t,) if isinstance(t, np.ndarray) else (t.data, t.scales, getattr(t, "zeros", t.data))
        for a in arrays:
            a.reshape(-1)[-1:].tobytes()           # the last byte of every part is readable


@fuzz(400)
@given(data=st.data())
def test_fuzz_container_file(container_bytes, scratch, data):
    name = data.draw(st.sampled_from(sorted(container_bytes)))
    raw = container_bytes[name]
    out = data.draw(mutated_container(raw, len(raw)))
    p = scratch / name
    p.write_bytes(out)
    mode = data.draw(st.sampled_from(["mmap", "copy"]))

    def go():
        f = ContainerFile(p, mode)
        try:
            _touch(f)
        finally:
            f.close()
    guarded("model dir: container file", go, (ModelFormatError,))


@st.composite
def mutated_model_dir(draw, base: Path, cfg: dict, dst: Path):
    """A copy of the tiny model with config.json and/or one container table mutated."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base, dst)
    what = draw(st.sampled_from(["config", "config", "table", "both", "file"]))
    if what in ("config", "both"):
        values = st.one_of(json_values, st.sampled_from([cfg["hidden_size"] * 2, cfg["num_experts"] + 1,
                                                          ["moe"] * 3, ["dense"] * 3, 10 ** 9]))
        (dst / "config.json").write_text(json.dumps(draw(mutated(cfg, n_max=3, values=values))))
    if what in ("table", "both"):
        name = draw(st.sampled_from(sorted(n for n in cfg["files"] if n.endswith(".bin"))))
        raw = (dst / name).read_bytes()
        table, room = _split(raw)
        values = st.one_of(json_values, st.sampled_from(["q8", "f32", "f16", "bf16", [1, 1], [128], 2 ** 40]))
        out = _join(raw, draw(mutated(table, n_max=3, values=values)), room)
        assume(out is not None)
        (dst / name).write_bytes(out)
    if what == "file":
        name = draw(st.sampled_from(sorted(cfg["files"])))
        op = draw(st.sampled_from(["delete", "empty", "dir", "swap"]))
        (dst / name).unlink()
        if op == "empty":
            (dst / name).write_bytes(b"")
        elif op == "dir":
            (dst / name).mkdir()
        elif op == "swap":
            shutil.copy(base / "model.bin", dst / name)
    return what


@fuzz(120)
@given(data=st.data())
def test_fuzz_model_dir(tiny_model_dir, model_cfg_base, scratch, data):
    """load_model on mutated model directories; when one loads, a forward pass runs."""
    dst = scratch / "model"
    data.draw(mutated_model_dir(tiny_model_dir, model_cfg_base, dst))
    mode = data.draw(st.sampled_from(["mmap", "copy"]))

    def go():
        w = load_model(dst, mode)
        try:
            from colibri_core.model import Model
            m = Model(w, EngineConfig(threads=1))
            cache = m.new_cache(4)
            k = max(1, min(w.cfg.top_k or 1, w.cfg.num_experts or 1))
            out = m.forward([np.array([1, 2], dtype=np.int64)], [cache], [k])[0]
            assert out.shape == (w.cfg.vocab_size,)
            m.expert_set = None
        finally:
            w.close()
    guarded("model dir: load + forward", go, (ConfigError, ModelFormatError))


# ============================================================================ ELF

ELF_FIELDS = {   # Elf64_Ehdr after e_ident: name -> (offset, struct format)
    "e_type": (16, "<H"), "e_machine": (18, "<H"), "e_version": (20, "<I"), "e_entry": (24, "<Q"),
    "e_phoff": (32, "<Q"), "e_shoff": (40, "<Q"), "e_flags": (48, "<I"), "e_ehsize": (52, "<H"),
    "e_phentsize": (54, "<H"), "e_phnum": (56, "<H"), "e_shentsize": (58, "<H"),
    "e_shnum": (60, "<H"), "e_shstrndx": (62, "<H")}
SHDR_FIELDS = [("sh_name", 0, "<I"), ("sh_type", 4, "<I"), ("sh_flags", 8, "<Q"), ("sh_addr", 16, "<Q"),
               ("sh_offset", 24, "<Q"), ("sh_size", 32, "<Q"), ("sh_link", 40, "<I"), ("sh_info", 44, "<I"),
               ("sh_addralign", 48, "<Q"), ("sh_entsize", 56, "<Q")]
PHDR_FIELDS = [("p_type", 0, "<I"), ("p_flags", 4, "<I"), ("p_offset", 8, "<Q"), ("p_vaddr", 16, "<Q"),
               ("p_paddr", 24, "<Q"), ("p_filesz", 32, "<Q"), ("p_memsz", 40, "<Q"), ("p_align", 48, "<Q")]
SYM_FIELDS = [("st_name", 0, "<I"), ("st_info", 4, "<B"), ("st_other", 5, "<B"), ("st_shndx", 6, "<H"),
              ("st_value", 8, "<Q"), ("st_size", 16, "<Q")]
META_FIELDS = [("magic", 0, "<I"), ("abi_version", 4, "<I"), ("struct_size", 8, "<I"), ("flags", 12, "<I"),
               ("hidden", 16, "<I"), ("intermediate", 20, "<I"), ("group", 24, "<I"),
               ("n_layers", 28, "<I"), ("layers[0]", 32, "<i"), ("layers[15]", 92, "<i"),
               ("router_bias", 96, "<f"), ("name[0]", 104, "<B"), ("name[63]", 167, "<B"),
               ("version[0]", 168, "<B"), ("target[127]", 327, "<B")]


class ElfLayout:
    """Where the mutable structures of a valid expert .so lie (from its own headers)."""

    def __init__(self, path: Path):
        from colibri_core.hotplug.elf import SHT_DYNSYM, SHT_SYMTAB, ElfFile
        self.raw = path.read_bytes()
        self.size = len(self.raw)
        r = self.raw
        self.phoff, self.shoff = struct.unpack_from("<QQ", r, 32)
        self.phnum, self.shnum = struct.unpack_from("<H", r, 56)[0], struct.unpack_from("<H", r, 60)[0]
        with ElfFile(path) as elf:
            self.symtabs = [(s.offset, s.size // 24) for s in elf.sections if s.type in (SHT_DYNSYM, SHT_SYMTAB)]
            self.symbols = {}
            for s in elf.sections:
                if s.type in (SHT_DYNSYM, SHT_SYMTAB):
                    strtab = elf.sections[s.link]
                    names = r[strtab.offset:strtab.offset + strtab.size]
                    for i in range(1, s.size // 24):
                        st_name = struct.unpack_from("<I", r, s.offset + 24 * i)[0]
                        end = names.find(b"\0", st_name)
                        nm = names[st_name:end].decode("utf-8", "replace")
                        if nm.startswith("colibri_") or nm == "ffn_forward":
                            self.symbols.setdefault(nm, []).append(s.offset + 24 * i)
            meta = elf.symbol("colibri_expert_meta")
            self.meta_off = elf.symbol_offset(meta)


def _elf_values(bits_fmt: str, size: int, orig: int):
    n = struct.calcsize(bits_fmt)
    if bits_fmt == "<f":
        return st.one_of(st.floats(width=32), st.sampled_from([float("nan"), float("inf"), 0.0]))
    signed = bits_fmt[-1].islower() and bits_fmt[-1] not in "BHIQ"
    lo, hi = (-(1 << (8 * n - 1)), (1 << (8 * n - 1)) - 1) if signed else (0, (1 << (8 * n)) - 1)
    edges = [v for v in {0, 1, 2, 3, 16, 24, 56, 64, 360, 4096, size - 1, size, size + 1, size * 2,
                         orig - 1, orig + 1, orig + 24, orig * 2, hi, hi - 1, hi // 2, hi // 2 + 1,
                         lo, 0xFFFF, 0xFF00, 0x7FFFFFFF} if lo <= v <= hi]
    return st.one_of(st.sampled_from(sorted(edges)), st.integers(lo, hi))


@st.composite
def mutated_elf(draw, lay: ElfLayout):
    raw = bytearray(lay.raw)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["ehdr", "ident", "shdr", "shdr", "phdr", "sym", "sym", "meta",
                                     "meta", "bytes", "truncate"]))
        if kind == "ident":
            if len(raw) >= 16:
                raw[draw(st.integers(0, 15))] = draw(st.integers(0, 255))
            continue
        if kind == "truncate":
            cut = draw(st.sampled_from([0, 3, 4, 15, 16, 63, 64, lay.shoff, lay.shoff + 1,
                                        lay.size - 1, lay.meta_off + 100]))
            del raw[min(cut, len(raw)):]
            continue
        if kind == "bytes":
            if raw:
                for _ in range(draw(st.integers(1, 16))):
                    raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
            continue
        if kind == "ehdr":
            name = draw(st.sampled_from(sorted(ELF_FIELDS)))
            off, fmt = ELF_FIELDS[name]
        elif kind == "shdr":
            i = draw(st.integers(0, max(0, lay.shnum - 1)))
            _, rel, fmt = draw(st.sampled_from(SHDR_FIELDS))
            off = lay.shoff + 64 * i + rel
        elif kind == "phdr":
            i = draw(st.integers(0, max(0, lay.phnum - 1)))
            _, rel, fmt = draw(st.sampled_from(PHDR_FIELDS))
            off = lay.phoff + 56 * i + rel
        elif kind == "sym":
            name = draw(st.sampled_from(sorted(lay.symbols)))
            base = draw(st.sampled_from(lay.symbols[name]))
            _, rel, fmt = draw(st.sampled_from(SYM_FIELDS))
            off = base + rel
        else:
            _, rel, fmt = draw(st.sampled_from(META_FIELDS))
            off = lay.meta_off + rel
        n = struct.calcsize(fmt)
        if off + n > len(raw):
            continue
        orig = struct.unpack_from(fmt, raw, off)[0]
        val = draw(_elf_values(fmt, lay.size, int(orig) if fmt != "<f" else 0))
        struct.pack_into(fmt, raw, off, val)
    return bytes(raw)


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """Two valid experts: the C test expert (no q4 weights) and a built one (q4 symbols)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    from colibri_core.hotplug.builder import build_expert
    from colibri_core.hotplug.testing import compile_test_expert
    d = tmp_path_factory.mktemp("elf")
    a = compile_test_expert(d / "plain.so", hidden=128, layer=1, name="plain")
    rng = np.random.default_rng(0)
    np.savez(d / "w.npz", w1=rng.standard_normal((64, 128)), w3=rng.standard_normal((64, 128)),
             w2=rng.standard_normal((128, 64)), router_row=rng.standard_normal(128).astype(np.float32))
    build_expert(d / "w.npz", d / "q4.so", layer=2, name="q4", version="1")
    return {"plain": ElfLayout(a), "q4": ElfLayout(d / "q4.so")}


def test_valid_experts_read(experts, scratch):
    from colibri_core.hotplug.meta import read_expert_file
    for name, lay in experts.items():
        p = scratch / f"ok-{name}.so"
        p.write_bytes(lay.raw)
        info = read_expert_file(str(p), 128, {1, 2})
        assert info.meta.name == name and (info.q4 is not None) == (name == "q4")


@fuzz(500)
@given(data=st.data())
def test_fuzz_expert_elf(experts, scratch, data):
    from colibri_core.hotplug.elf import ElfFile
    from colibri_core.hotplug.meta import read_expert_file
    which = data.draw(st.sampled_from(sorted(experts)))
    raw = data.draw(mutated_elf(experts[which]))
    p = scratch / f"fuzz-{which}.so"
    p.write_bytes(raw)

    def go():
        with ElfFile(p) as elf:                 # the reader on its own
            for s in list(elf.symbols.values())[:50]:
                if s.defined and s.size < (1 << 20):
                    try:
                        elf.symbol_bytes(s)
                    except ExpertRejected:
                        pass
        return read_expert_file(str(p), 128, {1, 2})
    got = guarded("expert .so: ELF + metadata", go, (ExpertRejected,))
    if not isinstance(got, BaseException):
        assert got.meta.hidden_size == 128 and got.router_row.offset + got.router_row.nbytes <= len(raw)
        for part in (got.q4 or {}).values():
            assert 0 <= part.offset and part.offset + part.nbytes <= len(raw)
