"""Experts bound to their model (issue 34 item 4): the model fingerprint, the metadata's
base_model, refusal of an expert built for another model, portable and unbound experts."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_core.model.fingerprint import fingerprint_for, model_fingerprint
from colibri_core.experts.hotplug.errors import ModelMismatch
from colibri_core.experts.hotplug.meta import read_expert_file
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
from colibri_core.model.weights import load_model
from hotplug_helpers import folder, make_manager  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
REPO = Path(__file__).resolve().parent.parent
FRAUD_NPZ = REPO / "examples" / "fraud" / "new_expert" / "card_testing.npz"
PROMPT = "The assert statement"       # the issue's: "ps areashavior..." with the fraud expert


@pytest.fixture(scope="module")
def fps():
    return {"builtin": fingerprint_for("builtin"), "fraud": fingerprint_for("fraud")}


def test_fingerprint_rule_routers_and_norms_not_the_rest(fps):
    """Two models of the same shape differ; within a model, the fingerprint follows the
    routers and FFN norms (what an expert computes against), not attention or expert
    weights (what a reconversion may requantize); it is cached on the weights."""
    assert fps["builtin"] != fps["fraud"]
    w = load_model(REPO / "colibri_core" / "models" / "builtin")
    try:
        fp = model_fingerprint(w)
        assert fp == fps["builtin"] and model_fingerprint(w) is fp      # cached

        def changed(**layer_fields) -> str:
            L = w.cfg.moe_layers[-1]
            layers = list(w.layers)
            layers[L] = dataclasses.replace(layers[L], **layer_fields)
            return model_fingerprint(dataclasses.replace(w, layers=layers))
        router = np.array(w.layers[w.cfg.moe_layers[-1]].router)
        router[0, 0] += 1e-3
        norm = np.array(w.layers[w.cfg.moe_layers[-1]].ffn_norm)
        norm[-1] *= 1.001
        assert changed(router=router) != fp
        assert changed(ffn_norm=norm) != fp
        assert changed(attn_norm=np.zeros_like(norm)) == fp       # not part of the rule
        assert changed(experts=[]) == fp
    finally:
        w.close()


def test_builder_records_base_model_or_portable(tmp_path, fps, capsys):
    from colibri_core.experts.hotplug.authoring.builder import build_expert, main
    info = build_expert(FRAUD_NPZ, tmp_path / "b.so", 3, "card", "1", base_model=fps["fraud"])
    assert (info.meta.abi_version, info.meta.binding) == (2, "bound")
    assert info.meta.base_model == fps["fraud"]
    info = build_expert(FRAUD_NPZ, tmp_path / "p.so", 3, "card", "1", portable=True)
    assert (info.meta.binding, info.meta.base_model) == ("portable", "")
    # the CLI: --config computes it; without any binding: one line naming the fix
    assert main([str(FRAUD_NPZ), "-o", str(tmp_path / "c.so"), "--layer", "3", "--name", "c",
                 "--version", "1", "--config", "fraud"]) == 0
    out = capsys.readouterr().out
    assert f"base model {fps['fraud']}" in out
    assert read_expert_file(str(tmp_path / "c.so")).meta.base_model == fps["fraud"]
    assert main([str(FRAUD_NPZ), "-o", str(tmp_path / "d.so"), "--layer", "3", "--name", "d",
                 "--version", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no base model" in err[0] and "--portable" in err[0]
    assert main([str(FRAUD_NPZ), "-o", str(tmp_path / "e.so"), "--layer", "3", "--name", "e",
                 "--version", "1", "--base-model", "xyz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "base_model = 'xyz'" in err[0] and "64 hex digits" in err[0]
    assert not (tmp_path / "d.so").exists() and not (tmp_path / "e.so").exists()


def test_mismatch_is_refused_naming_both_fingerprints(tmp_path, fps):
    so = compile_test_expert(tmp_path / "x.so", hidden=128, layer=3, base_model=fps["fraud"])
    with pytest.raises(ModelMismatch) as ex:
        read_expert_file(str(so), 128, {1, 2, 3}, fps["builtin"])
    msg = str(ex.value)
    assert ex.value.reason == "base-model" and "\n" not in msg
    assert fps["fraud"] in msg and fps["builtin"] in msg
    assert read_expert_file(str(so), 128, {1, 2, 3}, fps["fraud"]).meta.binding == "bound"


def test_abi2_without_base_model_or_portable_is_refused(tmp_path):
    from colibri_core.experts.hotplug.errors import ExpertMetadataError
    so = compile_test_expert(tmp_path / "z.so", hidden=64, layer=1, abi=2,
                             base_model="00" * 32)
    with pytest.raises(ExpertMetadataError, match="base_model is all zeros"):
        read_expert_file(str(so))


def test_engine_refuses_foreign_adopts_portable_bound_and_unbound(tmp_path, fps, caplog):
    """The issue's case: docs/HOTPLUG.md's fraud expert dropped into the built-in model.
    Built for the fraud model it is refused with one line naming both fingerprints and
    the text is unchanged; built portable it goes live (that is what happened to every
    expert before); an expert built before ABI 2 goes live with a WARNING, listed
    `unbound`."""
    from colibri_core.engine import Engine
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    d = tmp_path / "experts"
    d.mkdir(mode=0o700)
    with Engine.from_config("builtin") as eng:
        alone = "".join(ev.text for ev in eng.generate(PROMPT, max_new_tokens=12,
                                                      temperature=0.0))
    build_expert(FRAUD_NPZ, d / "fraud_pattern_7.so", 3, "fraud_pattern_7", "2024.06.1",
                 q4_clip="minmax", base_model=fps["fraud"])
    caplog.set_level(logging.INFO, logger="colibri")
    with Engine.from_config("builtin", experts_dir=str(d)) as eng:
        assert eng.model_fingerprint == fps["builtin"]
        assert eng.expert_set_generation == 0 and eng.hotplug.list() == []
        (ref,) = eng.hotplug.refused()
        assert ref["reason"] == "base-model"
        assert fps["fraud"] in ref["message"] and fps["builtin"] in ref["message"]
        text = "".join(ev.text for ev in eng.generate(PROMPT, max_new_tokens=12,
                                                     temperature=0.0))
        assert text == alone
        lines = [r for r in caplog.records if "fraud_pattern_7.so" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    shutil.rmtree(d)
    d.mkdir(mode=0o700)
    build_expert(FRAUD_NPZ, d / "fraud_pattern_7.so", 3, "fraud_pattern_7", "2024.06.1",
                 q4_clip="minmax", portable=True)
    compile_test_expert(d / "mine.so", hidden=128, layer=2, name="mine",
                        base_model=fps["builtin"])
    compile_test_expert(d / "old.so", hidden=128, layer=1, name="old", abi=1)
    caplog.clear()
    with Engine.from_config("builtin", experts_dir=str(d)) as eng:
        rows = {r["name"]: r for r in eng.hotplug.list()}
        assert {n: (r["status"], r["binding"]) for n, r in rows.items()} == {
            "fraud_pattern_7": ("active", "portable"), "mine": ("active", "bound"),
            "old": ("active", "unbound")}
        assert eng.hotplug.refused() == []
        text = "".join(ev.text for ev in eng.generate(PROMPT, max_new_tokens=12,
                                                     temperature=0.0))
        assert text != alone            # a foreign expert computes something else
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "old.so" in warn[0] and "no base model" in warn[0]


def test_bundle_binding(make_manager, folder, tmp_path):
    from hotplug_helpers import drain_until, write_bundle
    fp_a, fp_b = "ab" * 32, "cd" * 32
    base = 'name = "{n}"\nversion = "1"\nlayers = [1]\n'
    write_bundle(tmp_path / "s" / "a.expert", toml=base.format(n="a") + f'base_model = "{fp_a}"\n')
    write_bundle(tmp_path / "s" / "b.expert", toml=base.format(n="b") + f'base_model = "{fp_b}"\n')
    write_bundle(tmp_path / "s" / "p.expert", toml=base.format(n="p") + "portable = true\n")
    write_bundle(tmp_path / "s" / "u.expert", toml=base.format(n="u"))
    write_bundle(tmp_path / "s" / "x.expert", toml=base.format(n="x") + 'base_model = "12"\n')
    mgr, events = make_manager(watch=False, model_fingerprint=fp_a)
    for n in "abpux":
        shutil.move(str(tmp_path / "s" / f"{n}.expert"), folder / f"{n}.expert")
    mgr.start()
    drain_until(mgr, 3)
    assert {r["name"]: r["binding"] for r in mgr.list()} == {
        "a": "bound", "p": "portable", "u": "unbound"}
    refused = {Path(r["path"]).name: r for r in mgr.refused()}
    assert refused["b.expert"]["reason"] == "base-model"
    assert fp_a in refused["b.expert"]["message"] and fp_b in refused["b.expert"]["message"]
    bad = refused["x.expert"]
    assert bad["reason"] == "metadata" and "x.expert/expert.toml" in bad["message"]
    assert "base_model = '12', expected the model's fingerprint" in bad["message"]
