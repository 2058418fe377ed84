"""`colibri expert build`: .npz -> INT4 .so whose weights and forward match the float model."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colibri_core.experts.hotplug import HotplugManager
from colibri_core.experts.hotplug.authoring.builder import build_expert, main
from colibri_core.experts.hotplug.errors import ExpertBuildError
from colibri_core.experts.hotplug.meta import read_expert_file
from colibri_core.experts.hotplug.probe import run_probe
from colibri_core.format.quant import dequantize_q4, quantize_q4

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

REPO = Path(__file__).resolve().parent.parent
H, I, G = 96, 80, 64          # neither a multiple of G: exercises the padded last group


def silu(v):
    return v / (1.0 + np.exp(-v))


def ffn_ref(x, w1, w3, w2):
    """float64 reference: silu(x W1^T) * (x W3^T) W2^T."""
    x = x.astype(np.float64)
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    rng = np.random.default_rng(7)
    w = {"w1": rng.standard_normal((I, H)) * 0.2, "w3": rng.standard_normal((I, H)) * 0.2,
         "w2": rng.standard_normal((H, I)) * 0.2, "router_row": rng.standard_normal(H),
         "router_bias": np.float32(-0.75)}
    path = tmp_path_factory.mktemp("npz") / "fraud.npz"
    np.savez(path, **{k: np.asarray(v, np.float32) for k, v in w.items()})
    return path, {k: np.asarray(v, np.float32).astype(np.float64) for k, v in w.items()}


@pytest.fixture(scope="module")
def built(weights, tmp_path_factory):
    npz, _ = weights
    out = tmp_path_factory.mktemp("so") / "fraud.so"
    info = build_expert(npz, out, [1, 3], "fraud_pattern_7", "2024.06.1", group_size=G,
                        portable=True)
    return out, info


def test_metadata_and_symbols(built):
    out, info = built
    m = info.meta
    assert (m.name, m.version, m.layers) == ("fraud_pattern_7", "2024.06.1", (1, 3))
    assert (m.hidden_size, m.intermediate_size, m.group_size) == (H, I, G)
    assert m.has_q4 and m.thread_safe and m.router_bias == pytest.approx(-0.75)
    assert m.target.startswith("x86_64 gcc") or "gcc" in m.target
    assert "-O3" in m.target and "-fPIC" in m.target
    assert m.target.endswith(" q4-clip=mse")                       # the builder's default
    assert all(p.offset % 64 == 0 for p in info.q4.values())       # .balign 64
    # The data is embedded with .incbin, not compiled from C arrays.
    assert run_probe(str(out), H, 5.0)["ok"]


def test_hot_expert_weights_and_forward_match_the_npz(built, weights, tmp_path):
    out, _ = built
    _, w = weights
    experts = tmp_path / "experts"
    experts.mkdir()
    shutil.copy(out, experts / "fraud.so")
    mgr = HotplugManager(experts, H, {1, 3}, first_slot=8, state_dir=tmp_path / "state",
                         settle_s=0.01, watch=False)
    mgr.start()
    try:
        assert mgr.wait_idle(20)
        (change,) = mgr.drain()
        e = change.expert
        assert change.kind == "add" and e.slot == 8 and e.layers == (1, 3)
        # Zero-copy views into the staged file.
        for t in (e.q4.w1, e.q4.w3, e.q4.w2):
            assert not t.data.flags.owndata and not t.data.flags.writeable
        assert not e.router_row.flags.owndata and e.router_row.dtype == np.float32
        np.testing.assert_array_equal(e.router_row, w["router_row"].astype(np.float32))
        assert e.router_bias == pytest.approx(-0.75)
        # Weights: exactly what quantize_q4 makes (default rule: mse clipping); no more
        # squared error than min/max RTN of the npz, whose values are within half a step.
        for name, t in (("w1", e.q4.w1), ("w3", e.q4.w3), ("w2", e.q4.w2)):
            ref = quantize_q4(w[name], G)
            np.testing.assert_array_equal(t.data, ref.data)
            np.testing.assert_array_equal(t.scales, ref.scales)
            np.testing.assert_array_equal(t.zeros, ref.zeros)
            deq = dequantize_q4(t)
            rtn = quantize_q4(w[name], G, clip="minmax")
            deq_rtn = dequantize_q4(rtn)
            half_step = np.repeat(rtn.scales.astype(np.float64), G, axis=1)[:, : t.cols] / 2
            assert np.all(np.abs(deq_rtn - w[name]) <= half_step * (1 + 1e-5) + 1e-7)
            assert ((deq - w[name]) ** 2).sum() <= ((deq_rtn - w[name]) ** 2).sum()
        # forward (the C fallback): equal to the dequantized reference up to float rounding,
        # and within the INT4 error of the float weights.
        x = np.random.default_rng(1).standard_normal((7, H)).astype(np.float32)
        y = np.full_like(x, np.nan)
        e.forward(x, y)
        deq_ref = ffn_ref(x, *(dequantize_q4(t) for t in (e.q4.w1, e.q4.w3, e.q4.w2)))
        float_ref = ffn_ref(x, w["w1"], w["w3"], w["w2"])
        np.testing.assert_allclose(y, deq_ref, rtol=1e-4, atol=1e-4 * np.abs(deq_ref).max())
        int4_err = np.linalg.norm(deq_ref - float_ref) / np.linalg.norm(float_ref)
        assert int4_err < 0.2                          # 4-bit RTN over three matrices
        assert np.linalg.norm(y - float_ref) / np.linalg.norm(float_ref) < int4_err + 1e-3
        y1 = np.empty((1, H), np.float32)
        e.forward(x[3:4], y1)                          # rows are independent
        np.testing.assert_allclose(y1[0], y[3], rtol=1e-6, atol=1e-6)
    finally:
        mgr.close()


def test_cli_main_and_errors(weights, tmp_path, capsys):
    npz, _ = weights
    out = tmp_path / "cli.so"
    rc = main([str(npz), "-o", str(out), "--layer", "2", "--name", "cli_expert",
               "--version", "0.1", "--group-size", "64", "--router-bias", "1.5",
               "--keep-sources", str(tmp_path / "src"), "--portable"])
    assert rc == 0 and "built" in capsys.readouterr().out
    info = read_expert_file(str(out), H, {2})
    assert info.meta.router_bias == 1.5 and info.meta.layers == (2,)
    asm = (tmp_path / "src" / "expert_data.S").read_text()
    assert ".incbin" in asm and "colibri_w2_zeros" in asm
    np.savez(tmp_path / "bad.npz", w1=np.zeros((4, 8)))
    assert main([str(tmp_path / "bad.npz"), "-o", str(tmp_path / "b.so"), "--layer", "1",
                 "--name", "b", "--version", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and len(err.strip().splitlines()) == 1
    assert "missing arrays ['w3', 'w2', 'router_row']" in err
    with pytest.raises(ExpertBuildError, match="name 'bad name'"):
        build_expert(npz, tmp_path / "c.so", 1, "bad name", "1")


def test_q4_clip_is_the_setting_given_and_recorded(weights, tmp_path):
    """The rounding is the one asked for (its bytes equal quantize_q4 with that clip, and
    differ from the other clip's), and the metadata's target records it."""
    npz, w = weights
    parts = {}
    for clip in ("minmax", "mse"):
        info = build_expert(npz, tmp_path / f"{clip}.so", 1, "c", "1", group_size=G, portable=True,
                            q4_clip=clip)
        assert info.meta.target.endswith(f" q4-clip={clip}")
        raw = (tmp_path / f"{clip}.so").read_bytes()
        got = {k: raw[p.offset:p.offset + p.nbytes] for k, p in info.q4.items()}
        for m in ("w1", "w3", "w2"):
            ref = quantize_q4(w[m], G, clip=clip)
            assert got[f"{m}.scales"] == np.ascontiguousarray(ref.scales, "<f4").tobytes()
            assert got[f"{m}.data"] == np.ascontiguousarray(ref.data, np.uint8).tobytes()
        parts[clip] = got
    assert parts["minmax"]["w1.scales"] != parts["mse"]["w1.scales"]
    with pytest.raises(ExpertBuildError, match="q4 clip 'awq', expected one of mse, minmax"):
        build_expert(npz, tmp_path / "x.so", 1, "c", "1", q4_clip="awq")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_example_expert_builds_with_its_makefile(tmp_path):
    subprocess.run(["make", "-s", "-C", str(REPO / "experts_so"), f"OUT={tmp_path}",
                    "HIDDEN=128", "LAYER=5", "CC=gcc"], check=True, capture_output=True)
    so = tmp_path / "example_expert.so"
    info = read_expert_file(str(so), 128, {5})
    assert info.meta.name == "example_fraud" and info.meta.thread_safe
    assert run_probe(str(so), 128, 5.0)["ok"]
