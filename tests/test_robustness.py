"""Every way a user can get it wrong: one clear line and a typed error (API) or
`colibri: error: ...` and exit 2 (CLI), with nothing left half-applied (no mapping, no
open file, no thread, no output directory). docs/ROBUSTNESS.md lists the cases; damaged
model directories and NaN/Inf weights are in test_damaged_models.py; the command
line's mistakes, Ctrl-C and a NaN checkpoint's conversion in test_robustness_cli.py."""
from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np
import pytest

from colibri_core.config import (EngineConfig, LengthRule, ModelConfig, load_model_config,
                                 load_run_config, parse, read_mapping)
from colibri_core.engine import Engine
from colibri_core.errors import (ColibriError, EngineClosedError, ConfigError, ExpertIndexError, ModelFormatError,
                                 RequestError)
from colibri_core.model.testing import write_random_model
from colibri_core.model.weights import load_model

from robust_helpers import (_tokenizer_with_id, fd_count, maps_of, model_dict, one_line,  # noqa: F401
                            read_config, time_limit, tok_model, write_config)


VOCAB = 256   # tiny_model_dir: vocab 256, hidden 128, layers dense/moe/moe, 4 experts top-2


@pytest.fixture(scope="module")
def eng(tok_model):
    e = Engine.from_model_dir(tok_model, threads=1)
    yield e
    e.close()


# ============================================================================ configs

@pytest.mark.parametrize("name,text,match", [
    ("bad.yaml", "model: [unclosed\n", "not valid yaml"),
    ("bad.json", '{"model": "x",}', "not valid json"),
    ("list.yaml", "- a\n- b\n", "expected a mapping at the top level, got list"),
    ("scalar.yaml", "42\n", "expected a mapping at the top level, got int"),
    ("empty.yaml", "", "expected a mapping at the top level, got NoneType"),
    ("unhashable.yaml", "? [a, b]\n: 1\n", "not valid yaml"),
    ("huge_int.json", '{"model": "x", "engine": {"threads": ' + "9" * 5000 + "}}", "not valid json"),
    ("deep.json", "[" * 100000 + "]" * 100000, "not valid json"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else "")
def test_malformed_config_files(tmp_path, name, text, match):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_run_config(p)
    one_line(e.value)


def test_unreadable_config_files(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot read"):
        read_mapping(tmp_path / "bin.yaml")
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match="is a directory, expected a regular file"):
        read_mapping(tmp_path / "dir.yaml")
    with pytest.raises(ConfigError, match="file not found"):
        read_mapping(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text,field", [
    ("model: x\nengine: {sampling: {temperature: .nan}}\n", "engine.sampling.temperature"),
    ("model: x\nengine: {sampling: {top_p: .inf}}\n", "engine.sampling.top_p"),
    ("model: x\nengine: {max_resident_mb: .inf}\n", "engine.max_resident_mb"),
    ("model: x\nengine: {hotplug: {settle_s: .inf}}\n", "engine.hotplug.settle_s"),
    ("model: x\nengine: {sampling: {seed: -1}}\n", "engine.sampling.seed"),
    ("model: x\nengine: {length_policy: [{min_tokens: 50, max_tokens: 10, k: 1}]}\n",
     "engine.length_policy.0"),
])
def test_non_finite_and_contradictory_engine_settings(tmp_path, text, field):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    assert f"field '{field}'" in one_line(e.value)


@pytest.mark.parametrize("over,match", [
    (dict(layer_types=["dense"]), "layer_types has 1 entries, num_layers is 2"),
    (dict(num_kv_heads=3), "not a multiple of num_kv_heads"),
    (dict(num_experts=0, top_k=0), "'moe' layers but num_experts is 0"),
    (dict(intermediate_size=0), "'dense' layers but intermediate_size is 0"),
    (dict(n_group=3), "not a multiple of n_group"),
    (dict(topk_group=2), "topk_group=2 exceeds n_group=1"),
    (dict(head_dim=33), "must be even"),
    (dict(bos_token_id=256), "bos_token_id=256 is outside the vocabulary"),
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(attention="mla"), "attention 'mla' needs"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(layer_types=["dense", "sparse"]), "layer_types.1"),
    (dict(vocab_size="many"), "vocab_size"),
    (dict(extra_field=1), "unknown field"),
])
def test_contradictory_model_configs(over, match):
    with pytest.raises(ConfigError, match=match):
        parse(ModelConfig, model_dict(**over), "config.json")


def test_top_k_beyond_experts_fails_at_load_naming_the_field(model):
    cfg = read_config(model)
    cfg["top_k"] = 5
    write_config(model, cfg)
    with pytest.raises(ExpertIndexError) as e:
        load_model(model)
    assert "FATAL: expert index out of bounds" in one_line(e.value) and "'top_k'" in str(e.value)
    cfg["top_k"] = 0
    write_config(model, cfg)
    with pytest.raises(ExpertIndexError):
        load_model_config(model / "config.json")


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    """'Billion laughs': the error message must not repr() the whole expanded value."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    prev = "a"
    for name in "bcdefgh":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
        prev = name
    lines += ["model: x", "engine:", f"  threads: *{prev}"]
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with time_limit(20, "alias bomb"), pytest.raises(ConfigError) as e:
        load_run_config(p)
    assert time.perf_counter() - t0 < 10
    assert all(len(line) < 400 for line in str(e.value).splitlines())


def test_engine_settings_are_typed_errors(tiny_model_dir):
    with pytest.raises(ConfigError, match="field 'threads'"):
        Engine.from_config("builtin", threads=0)
    with pytest.raises(ConfigError, match="field 'load_mode'"):
        Engine.from_model_dir(tiny_model_dir, load_mode="disk")
    with pytest.raises(ConfigError, match="unknown field"):
        Engine.from_model_dir(tiny_model_dir, thraeds=2)
    with pytest.raises(ConfigError, match="expected an EngineConfig"):
        Engine(tiny_model_dir, {"threads": 1})


def _settled() -> None:
    """Engines earlier tests dropped without close() stay alive while their scheduler
    thread idles (up to 2 s) and close their files when collected: let that happen before
    counting this process's open files."""
    import gc
    import threading
    end = time.monotonic() + 10
    while (any(t.name.startswith("colibri-sched") for t in threading.enumerate())
           and time.monotonic() < end):
        time.sleep(0.02)
    gc.collect()


def test_failed_engine_construction_leaves_nothing_open(tiny_model_dir, tmp_path):
    _settled()
    fds, maps = fd_count(), maps_of(tiny_model_dir)
    # the length policy asks for more experts than the model has: refused at load
    cfg = EngineConfig(length_policy=[LengthRule(max_tokens=8, k=5)])
    with pytest.raises(ConfigError, match=r"length_policy\.0\.k': value 5.*allowed 1\.\.4"):
        Engine(tiny_model_dir, cfg)
    # a plugins folder that does not exist: refused after the weights were mapped
    with pytest.raises(ColibriError, match="does not exist"):
        Engine(tiny_model_dir, EngineConfig(plugins_dir=str(tmp_path / "no-plugins")))
    assert (fd_count(), maps_of(tiny_model_dir)) == (fds, maps)


def test_close_unmaps_and_closes_files_at_once(tok_model):
    """Engine.close() releases every mapping and descriptor of the model right away, not
    at the next garbage collection (the expert set and the layer views held them)."""
    import gc
    fds, maps = fd_count(), maps_of(tok_model)
    was = gc.isenabled()
    gc.disable()
    try:
        e = Engine.from_model_dir(tok_model, threads=1)
        e.generate("hello", max_new_tokens=3, temperature=0).run()
        assert maps_of(tok_model) > maps
        e.close()
        assert (fd_count(), maps_of(tok_model)) == (fds, maps)
        e.close()                                        # idempotent
        with pytest.raises(EngineClosedError, match="engine is closed"):
            e.generate([1, 2])
    finally:
        if was:
            gc.enable()


def test_missing_experts_dir_is_refused_and_not_created(tiny_model_dir, tmp_path):
    missing = tmp_path / "typo" / "experts"
    with pytest.raises(ConfigError, match="no such folder"):
        Engine(tiny_model_dir, EngineConfig(experts_dir=str(missing)))
    assert not (tmp_path / "typo").exists()


# ============================================================================ requests

@pytest.mark.parametrize("prompt,kw,match", [
    ([1, 2], dict(experts_per_token=0), "experts_per_token=0 from the experts_per_token argument is out of range"),
    ([1, 2], dict(experts_per_token=5), r"allowed 1\.\.4"),
    ([1, 2], dict(experts_per_token=2.5), "is not an integer"),
    ([1, 2], dict(experts_per_token=True), "is not an integer"),
    ("MODE:k0|hello", {}, "k must be at least 1"),
    ("MODE:k9|hello", {}, "experts_per_token=9 from the MODE: prefix is out of range"),
    ("MODE:kx|hello", {}, "malformed MODE: prefix"),
    ("MODE:k2 hello", {}, "malformed MODE: prefix"),
    ("MODE:k\u0663|hello", {}, "malformed MODE: prefix"),        # Arabic-Indic digit 3
    ("MODE:k12345|hello", {}, "malformed MODE: prefix"),
    ([-1], {}, r"token id -1 out of range 0\.\.255"),
    ([VOCAB], {}, r"token id 256 out of range 0\.\.255"),
    ([2 ** 80], {}, "out of range"),
    (["a", "b"], {}, "token id at position 0 is 'a' .str."),
    ([1, 2.5], {}, "token id at position 1 is 2.5"),
    ([1, None], {}, "token id at position 1 is None"),
    ([[1, 2]], {}, "token ids are integers"),
    (np.zeros((2, 2), np.int64), {}, "1-D integer array"),
    (np.array([1.0, 2.0]), {}, "1-D integer array"),
    (b"hello", {}, "prompt is bytes"),
    (None, {}, "prompt of type NoneType"),
    (3, {}, "prompt of type int"),
    ("", {}, "empty prompt"),
    ("MODE:k2|", {}, "empty prompt"),
    ([], {}, "empty prompt"),
    ("\ud800abc", {}, "not valid Unicode"),
    ([1, 2], dict(max_new_tokens=-1), "max_new_tokens=-1"),
    ([1, 2], dict(max_new_tokens=2.5), "max_new_tokens=2.5"),
    ([1, 2], dict(temperature=float("nan")), "temperature=nan"),
    ([1, 2], dict(temperature=-1.0), "temperature=-1.0"),
    ([1, 2], dict(top_p=0.0), "top_p=0.0"),
    ([1, 2], dict(seed=-3), "sampling settings"),
    ([1, 2], dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_requests_are_request_errors(eng, prompt, kw, match):
    with pytest.raises(RequestError, match=match) as e:
        eng.generate(prompt, **kw).run()
    one_line(e.value)


def test_bad_requests_on_the_other_entry_points(eng):
    with pytest.raises(RequestError, match="token id 256"):
        eng.next_token_logits([1, VOCAB])
    with pytest.raises(RequestError, match="experts_per_token=7"):
        eng.next_token_logits([1, 2], experts_per_token=7)
    with pytest.raises(RequestError, match="empty prompt"):
        eng.score_batch([[1, 2], []])
    with pytest.raises(RequestError, match="token ids are integers"):
        eng.score_batch([[1, "x"]])
    # still serving after all that
    assert len(eng.generate([1, 2, 3], max_new_tokens=3, temperature=0).run().token_ids) == 3


def test_prompt_beyond_context_is_truncated_with_a_warning(eng, caplog):
    ctx = eng.model_cfg.max_position_embeddings
    with caplog.at_level(logging.WARNING, logger="colibri"):
        g = eng.generate(list(range(1, 200)) * 2, max_new_tokens=2, temperature=0)
        g.run()
    assert g.truncated_from == 398 and len(g.prompt_ids) == ctx - 1
    assert "exceeds the context" in caplog.text


def test_tokenizer_beyond_vocab_is_refused_padded_vocab_accepted(tmp_path):
    # vocabulary with a hole: 257 entries, the largest id 300 >= vocab_size 260
    bad = write_random_model(tmp_path / "bad", vocab=260,
                             tokenizer=_tokenizer_with_id(tmp_path / "t1", 300))
    assert bad.vocab_size == 260
    fds = fd_count()
    with pytest.raises(ModelFormatError, match="largest id 300.*vocab_size is 260") as e:
        Engine.from_model_dir(tmp_path / "bad", threads=1)
    one_line(e.value)
    assert fd_count() == fds and maps_of(tmp_path / "bad") == 0
    # a model vocabulary padded above the tokenizer's (257 ids in a 320 vocab): normal
    write_random_model(tmp_path / "pad", vocab=320, tokenizer=_tokenizer_with_id(tmp_path / "t2", 256))
    with Engine.from_model_dir(tmp_path / "pad", threads=1) as e:
        g = e.generate("hello", max_new_tokens=4, temperature=1.0, seed=3).run()
        assert len(g.token_ids) >= 1                     # ids >= 257 decode to nothing


# ============================================================================ hot-plug leaks

def test_expert_replaced_within_one_drain_is_released(tiny_model_dir, tmp_path):
    """Two changes of one expert adopted between the same two tokens (added, then replaced
    before any token used it): the intermediate version's library must be unloaded too.
    Found by benchmarks/robustness/soak.py: one staged .so stayed mapped after everything was removed."""
    def settle(eng):                # the watcher sees the rename, the worker checks the file
        time.sleep(0.3)
        assert eng.hotplug.wait_idle(30)
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    from colibri_core.config import HotplugConfig
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    H, I = 128, 64
    build = tmp_path / "build"
    build.mkdir()
    sos = []
    for v in (1, 2):
        rng = np.random.default_rng(v)
        np.savez(build / f"w{v}.npz", w1=rng.standard_normal((I, H)), w3=rng.standard_normal((I, H)),
                 w2=rng.standard_normal((H, I)), router_row=np.zeros(H, np.float32))
        build_expert(build / f"w{v}.npz", build / f"x{v}.so", layer=1, name="x", version=str(v),
                     portable=True)
        sos.append(build / f"x{v}.so")
    from colibri_core.experts.hotplug.expert import _ffi
    kept = len(getattr(_ffi, "_libraries", []))
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    staging = watched / ".colibri-state" / "staging"
    eng = Engine(tiny_model_dir, EngineConfig(threads=1, experts_dir=str(watched),
                                              hotplug=HotplugConfig(settle_s=0.02)))
    try:
        shutil.copyfile(sos[0], build / "tmp.so")
        os.replace(build / "tmp.so", watched / "x.so")             # add v1 ...
        settle(eng)
        shutil.copyfile(sos[1], build / "tmp.so")
        os.replace(build / "tmp.so", watched / "x.so")             # ... replace by v2
        settle(eng)
        eng.apply_expert_changes()                                  # both in one batch
        assert [h.version for h in eng.model.expert_set.hot_experts()] == ["2"]
        assert len({line.split()[-1] for line in open("/proc/self/maps")
                    if str(staging) in line}) == 1, "the intermediate v1 is still loaded"
        (watched / "x.so").unlink()
        settle(eng)
        eng.apply_expert_changes()
        eng.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
        import gc
        gc.collect()
        assert maps_of(staging) == 0
        # cffi's FFI.dlopen() keeps every library object it returned unless told otherwise
        assert len(getattr(_ffi, "_libraries", [])) == kept
    finally:
        eng.close()
