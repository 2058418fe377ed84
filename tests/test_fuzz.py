"""Property-based tests and structural fuzzers (hypothesis) on everything that reads
user-supplied bytes: config files, model directories (container tables, config.json),
the prompt's MODE: prefix and token ids; the ELF metadata reader of hot-plugged experts is
fuzzed in test_fuzz_elf.py, with the same machinery (fuzz_helpers.py).

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
    python -m benchmarks.robustness.fuzz --minutes 30          # rounds with fresh seeds, a summary

COLIBRI_FUZZ_REPORT=path.json writes how many inputs each fuzzer tried (docs/ROBUSTNESS.md).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from colibri_core.config import (EngineConfig, ModelConfig, RunConfig, load_model_config,
                                 load_run_config, parse, read_mapping)
from colibri_core.errors import ConfigError, ExpertIndexError, ModelFormatError, RequestError
from colibri_core.format.modelfile import _PREFIX, ContainerFile
from colibri_core.runtime.kselect import split_mode_prefix
from colibri_core.model.weights import load_model

from fuzz_helpers import TRIED, EDGE_INTS, fuzz, guarded, json_values, mutated
from fuzz_helpers import scratch  # noqa: F401  (a fixture)

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
    from colibri_core.model.testing import write_random_model
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
            from colibri_core.forward.model import Model
            m = Model(w, EngineConfig(threads=1))
            cache = m.new_cache(4)
            k = max(1, min(w.cfg.top_k or 1, w.cfg.num_experts or 1))
            out = m.forward([np.array([1, 2], dtype=np.int64)], [cache], [k])[0]
            assert out.shape == (w.cfg.vocab_size,)
            m.expert_set = None
        finally:
            w.close()
    guarded("model dir: load + forward", go, (ConfigError, ModelFormatError))
