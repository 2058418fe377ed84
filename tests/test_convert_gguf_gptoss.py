"""`colibri convert model.gguf` for llama.cpp's `gpt-oss` architecture (issues 32, 33).

tests/data/gguf/gpt_oss-F32.gguf and gpt_oss-MXFP4_MOE.gguf were written by llama.cpp's own
convert_hf_to_gguf.py and llama-quantize (tests/data/gguf/remake.py) from a tiny random
transformers gpt-oss (2 layers: a sliding window of 4 then full attention, sinks, YaRN,
q/k/v/o biases, the router's bias, expert biases, gate/up past the SwiGLU clamp);
gpt_oss.npz holds transformers' float32 logits and libllama's on each file.

- the F32 file: logits within 1e-4 (max relative) of transformers';
- the MXFP4_MOE file at its default precision: every expert matrix kept byte for byte (the
  GGUF's e2m1 codes and e8m0 exponents, no requantization; dequantized by the gguf package
  and by Colibri, equal), and with the rest at 32 bits the model is transformers' with the
  file's dequantized weights put in (1e-4; also with the experts dequantized to f32); its
  default conversion's logit error within 1.5x llama.cpp's on the same file.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_core.convert import convert, tensor_classes  # noqa: E402
from colibri_core.engine import Engine  # noqa: E402
from colibri_core.format.modelfile import ContainerFile  # noqa: E402
from colibri_core.format.mxfp4 import dequantize_mxfp4  # noqa: E402

DATA = Path(__file__).parent / "data" / "gguf"
L_, E_ = 2, 4


def _logits(out, d, routing="float", activations="float"):
    with Engine.from_model_dir(out, routing=routing, activations=activations) as eng:
        return [np.asarray(eng.next_token_logits(d[f"ids_{i}"].tolist(), all_positions=True),
                           np.float64) for i in range(3)]


def _max_rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _token_error(a, ref) -> float:
    """test_convert_gguf.token_error: median over positions of the relative RMS error."""
    errs = [np.sqrt(((np.asarray(x, np.float64) - r) ** 2).mean(axis=1) / (r ** 2).mean())
            for x, r in zip(a, (np.asarray(r, np.float64) for r in ref))]
    return float(np.median(np.concatenate(errs)))


def test_f32_gguf_matches_transformers(tmp_path):
    out = tmp_path / "f32"
    cfg = convert(DATA / "gpt_oss-F32.gguf", out, bits=None)    # None: per the file
    assert {r["formats"] for r in tensor_classes(out)} == {"f32"}
    assert cfg.attention_window == [4, 0] and cfg.attention_sinks
    assert cfg.rope_scaling.factor == 4.0 and not cfg.rope_scaling.truncate
    d = np.load(DATA / "gpt_oss.npz")
    errs = [_max_rel(g, d[f"hf_{i}"]) for i, g in enumerate(_logits(out, d))]
    print(f"gpt-oss F32 GGUF: max rel logit error vs transformers {max(errs):.2e}")
    assert max(errs) <= 1e-4, errs


def _gguf_tensors(path: Path) -> dict:
    """{GGUF name: (type name, float32 values by the gguf package, raw bytes)}."""
    rd = gguf.GGUFReader(str(path))
    out = {}
    for t in rd.tensors:
        shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
        vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        out[t.name] = (t.tensor_type.name, np.asarray(vals, np.float32), np.asarray(t.data))
    return out


def test_mxfp4_experts_kept_byte_for_byte(tmp_path, monkeypatch):
    from colibri_core.convert import gptoss

    def requantized(*a, **k):
        raise AssertionError("an MXFP4 expert was requantized")
    g = _gguf_tensors(DATA / "gpt_oss-MXFP4_MOE.gguf")
    out = tmp_path / "mx"
    # (requantizing the file's values would give the same codes: the path is checked too)
    monkeypatch.setattr(gptoss, "_store", requantized)
    convert(DATA / "gpt_oss-MXFP4_MOE.gguf", out, bits=None)
    monkeypatch.undo()
    fmts = [r["formats"].split()[0] for r in tensor_classes(out) if r["class"] == "experts"]
    assert fmts == ["mxfp4"]
    for L in range(L_):
        for e in range(E_):
            f = ContainerFile(out / f"expert_{L}_{e}.bin", "mmap")
            for m, name in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                kind, vals, raw = g[f"blk.{L}.ffn_{name}_exps.weight"]
                assert kind == "MXFP4"
                t = f.tensor(m)
                blk = raw[e].reshape(t.rows, -1, 17)                # e8m0, then 16 code bytes
                nb = blk.shape[1]
                assert np.array_equal(np.asarray(t.exps)[:, :nb], blk[:, :, 0])
                codes = np.concatenate([blk[:, :, 1:] & 15, blk[:, :, 1:] >> 4], axis=2)
                packed = (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).reshape(t.rows, -1)
                assert np.array_equal(np.asarray(t.data)[:, :nb * 16], packed)
                assert np.array_equal(dequantize_mxfp4(t), vals[e].astype(np.float64))
                assert np.array_equal(np.asarray(f.tensor(m + ".bias")).ravel(),
                                      g[f"blk.{L}.ffn_{name}_exps.bias"][1][e])
            f.close()


def _remake():
    spec = importlib.util.spec_from_file_location("gguf_remake", DATA / "remake.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _put_gguf_weights(model, g: dict) -> None:
    """The file's dequantized weights (gguf package) into the transformers model, by
    llama.cpp's gpt-oss tensor names."""
    sd, done = model.state_dict(), set()

    def put(name, arr):
        done.add(name)
        with torch.no_grad():
            sd[name].copy_(torch.from_numpy(np.array(arr, np.float32)))
    put("model.embed_tokens.weight", g["token_embd.weight"][1])
    put("lm_head.weight", g["output.weight"][1])
    put("model.norm.weight", g["output_norm.weight"][1])
    for L in range(L_):
        p, b = f"model.layers.{L}.", f"blk.{L}."
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
            for kind in ("weight", "bias"):
                put(f"{p}self_attn.{ours}_proj.{kind}", g[f"{b}attn_{theirs}.{kind}"][1])
        put(p + "self_attn.sinks", g[b + "attn_sinks.weight"][1])
        put(p + "input_layernorm.weight", g[b + "attn_norm.weight"][1])
        put(p + "post_attention_layernorm.weight", g[b + "post_attention_norm.weight"][1])
        put(p + "mlp.router.weight", g[b + "ffn_gate_inp.weight"][1])
        put(p + "mlp.router.bias", g[b + "ffn_gate_inp.bias"][1])
        gu = np.empty(sd[p + "mlp.experts.gate_up_proj"].shape, np.float32)     # [E, H, 2I]
        gu[:, :, 0::2] = g[b + "ffn_gate_exps.weight"][1].transpose(0, 2, 1)
        gu[:, :, 1::2] = g[b + "ffn_up_exps.weight"][1].transpose(0, 2, 1)
        put(p + "mlp.experts.gate_up_proj", gu)
        gub = np.empty(sd[p + "mlp.experts.gate_up_proj_bias"].shape, np.float32)
        gub[:, 0::2], gub[:, 1::2] = g[b + "ffn_gate_exps.bias"][1], g[b + "ffn_up_exps.bias"][1]
        put(p + "mlp.experts.gate_up_proj_bias", gub)
        put(p + "mlp.experts.down_proj", g[b + "ffn_down_exps.weight"][1].transpose(0, 2, 1))
        put(p + "mlp.experts.down_proj_bias", g[b + "ffn_down_exps.bias"][1])
    assert done == set(sd), set(sd) - done           # every weight is the file's


def test_mxfp4_gguf_is_the_files_model(tmp_path):
    """Experts kept (MXFP4), everything else at 32 bits: transformers running the file's
    dequantized weights, within 1e-4; the default conversion within 1.5x llama.cpp's error."""
    rm = _remake()
    fam, widths, over, _ = rm.CASES["gpt_oss"]
    model = rm.make_model(fam, widths, over)         # its config; the weights are replaced
    d = np.load(DATA / "gpt_oss.npz")
    _put_gguf_weights(model, _gguf_tensors(DATA / "gpt_oss-MXFP4_MOE.gguf"))
    hf_logits = rm._helpers()[0].hf_logits
    want = [hf_logits(model, d[f"ids_{i}"].tolist()) for i in range(3)]
    # the experts kept (MXFP4 kernel), then dequantized (f32): the same model
    for name, tb in (("mx32", {"experts": 4}), ("f32", None)):
        convert(DATA / "gpt_oss-MXFP4_MOE.gguf", tmp_path / name, bits=32, tensor_bits=tb)
        got = _logits(tmp_path / name, d)
        errs = [_max_rel(got[i], want[i]) for i in range(3)]
        assert max(errs) <= 1e-4, (name, errs)
    out = tmp_path / "default"
    convert(DATA / "gpt_oss-MXFP4_MOE.gguf", out, bits=None)
    ref = [d[f"hf_{i}"] for i in range(3)]
    ours = _token_error(_logits(out, d, "fixed", "int8"), ref)
    llama = _token_error([d[f"MXFP4_MOE__{i}"] for i in range(3)], ref)
    print(f"gpt-oss MXFP4_MOE GGUF: logit error {ours:.4f}, llama.cpp {llama:.4f}, "
          f"ratio {ours / llama:.2f}; as the file's model {max(errs):.2e}")
    assert ours <= 1.5 * llama
