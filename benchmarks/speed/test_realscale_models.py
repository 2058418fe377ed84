"""benchmarks/speed/_realscale_models.py's drawn weights and routing variants (issue 31):
q4 codes of mean zero (uniform 0..15 about 8 have mean -0.5, a rank-one part that makes
every token of a deep random model route alike), the skewed routers' popularity,
set_routing writing the same routers into a Colibri model and its GGUF, and the
DeepSeek-V2 and gpt-oss layouts at tiny widths (llama.cpp's tools load them where built).

A check of the benchmark's own tool, kept beside it (no test under tests/ imports a
benchmark): `python -m pytest benchmarks/speed/test_realscale_models.py` from the
repository root."""

import numpy as np
import pytest

from benchmarks.common import REPO
from benchmarks.speed import _realscale_models as RM
from benchmarks.speed import _realscale_gptoss as RG
from benchmarks.speed import _realscale_routing as RR

TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 512,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-06,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "use_sliding_window": False, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2}


def test_q4_codes_have_mean_zero_and_the_stated_variance():
    b = RM.Draw(3).nibbles(400, 500)
    v = np.concatenate([(b & 15).ravel(), (b >> 4).ravel()]).astype(np.int64) - 8
    assert v.min() == -7 and v.max() == 7            # code 0 (value -8) never drawn
    assert abs(v.mean()) < 0.01
    assert abs(v.var() - RM.Draw.VAR["q4"]) < 0.05


def test_q4_0_rows_dequantize_to_unit_scale_without_offset():
    from benchmarks.peers._llamacpp_tools import import_gguf
    gguf = import_gguf()
    rows, cols = 64, 2048
    q = RM.q4_0_rows(RM.Draw(5), rows, cols)
    w = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0).reshape(rows, cols)
    assert abs(w.mean()) < 0.02 / np.sqrt(cols)
    assert abs(w.std() * np.sqrt(cols) - 1) < 0.1


def _top_share(R, k, n=4000, top=8, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, R.shape[1])).astype(np.float32)
    sel = np.argpartition(-(x @ R.T), k - 1, axis=1)[:, :k]
    c = np.sort(np.bincount(sel.ravel(), minlength=R.shape[0]))[::-1]
    return c[:top].sum() / c.sum()


def test_skewed_routers_are_the_uniform_rows_scaled_and_concentrate_routing():
    cfg = RM.model_config("qwen3-30b-a3b")
    uni, skw = RR.routers(cfg, "uniform"), RR.routers(cfg, "skewed")
    L = cfg.moe_layers[0]
    ratio = skw[L] / uni[L]
    assert np.allclose(ratio, ratio[:, :1], rtol=1e-5)        # a scale per row
    g = np.sort(ratio[:, 0])[::-1]
    assert np.allclose(g, 1 + RR.SKEW_A / np.arange(1, cfg.num_experts + 1), rtol=1e-5)
    assert _top_share(uni[L], cfg.top_k) < 0.1                 # 8 / 128 = 6.25 %
    assert _top_share(skw[L], cfg.top_k) > 0.3
    with pytest.raises(ValueError):
        RR.routers(cfg, "zipf2")


def test_set_routing_writes_the_same_routers_into_both_files(tmp_path, monkeypatch):
    from benchmarks.peers._llamacpp_tools import import_gguf
    from colibri_core.format.modelfile import ContainerFile
    from colibri_core.model.weights import verify_checksums
    monkeypatch.setitem(RM.SHAPES, "tiny-qwen3", TINY)
    monkeypatch.setitem(RM.GGUF_ARCH, "tiny-qwen3", "qwen3moe")
    monkeypatch.setattr(RM, "SPARE_DISK", 0)
    p = RM.paths("tiny-qwen3", tmp_path)
    RM.write_colibri("tiny-qwen3", p["colibri"])
    RM.write_gguf("tiny-qwen3", p["gguf"])
    for variant in ("skewed", "uniform", "skewed"):
        rs = RR.set_routing("tiny-qwen3", variant, tmp_path)
        assert RR.routing_variant("tiny-qwen3", tmp_path) == variant
        assert verify_checksums(p["colibri"]) == []
        cf = ContainerFile(p["colibri"] / "routing.bin")
        rd = import_gguf().GGUFReader(str(p["gguf"]))
        got = {int(t.name.split(".")[1]): np.asarray(t.data).reshape(16, 256)
               for t in rd.tensors if t.name.endswith("ffn_gate_inp.weight")}
        for L, R in rs.items():
            assert np.array_equal(np.asarray(cf.tensor(f"layer.{L}.router")), R)
            assert np.array_equal(got[L], R)
        cf.close()


TINY_DS2 = {**RM.SHAPES["deepseek-v2-lite"], "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
            "v_head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512}


@pytest.fixture()
def tiny_ds2_gguf(tmp_path, monkeypatch):
    """DeepSeek-V2-Lite's layout (27 layers: llama.cpp takes that count for the Lite
    variant, without q LoRA) at tiny widths, as write_gguf writes it for `deepseek2`."""
    monkeypatch.setitem(RM.SHAPES, "tiny-ds2", TINY_DS2)
    monkeypatch.setitem(RM.GGUF_ARCH, "tiny-ds2", "deepseek2")
    monkeypatch.setattr(RM, "SPARE_DISK", 0)
    return RM.write_gguf("tiny-ds2", tmp_path / "tiny-ds2.gguf")


def test_deepseek2_gguf_has_llamas_mla_layout(tiny_ds2_gguf):
    """MLA as llama.cpp's converter stores it: one kv head of kv_lora + rope, k_b per head
    [kv_lora, nope] (ggml: nope first), v_b per head [v_head, kv_lora], the MLA head sizes
    apart, the first layer dense, the shared experts one FFN."""
    from benchmarks.peers._llamacpp_tools import import_gguf
    rd = import_gguf().GGUFReader(str(tiny_ds2_gguf))
    kv = {f.name: f.contents() for f in rd.fields.values() if f.name.startswith("deepseek2.")}
    assert kv["deepseek2.attention.head_count_kv"] == 1
    assert kv["deepseek2.attention.key_length"] == 64 + 32
    assert kv["deepseek2.attention.value_length"] == 64
    assert kv["deepseek2.attention.key_length_mla"] == 64
    assert kv["deepseek2.attention.value_length_mla"] == 32
    assert kv["deepseek2.rope.dimension_count"] == 32
    assert kv["deepseek2.leading_dense_block_count"] == 1
    assert kv["deepseek2.expert_shared_count"] == 1
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in rd.tensors}     # ggml order
    assert shapes["blk.1.attn_k_b.weight"] == (32, 64, 2)
    assert shapes["blk.1.attn_v_b.weight"] == (64, 32, 2)
    assert shapes["blk.1.attn_kv_a_mqa.weight"] == (256, 64 + 32)
    assert shapes["blk.0.ffn_gate.weight"] == (256, 512)
    assert "blk.0.ffn_gate_inp.weight" not in shapes
    assert shapes["blk.26.ffn_gate_shexp.weight"] == (256, 64)
    assert shapes["blk.26.ffn_down_exps.weight"] == (64, 256, 8)


def test_llama_cpp_loads_and_runs_the_deepseek2_gguf(tiny_ds2_gguf):
    """llama.cpp's loader accepts it (every tensor it requires, of its shape, and no other)
    and its deepseek2 graph runs a prompt and a few tokens (llama-bench)."""
    import json
    import subprocess
    bench = _llama_tool("llama-bench")
    p = subprocess.run([str(bench), "-m", str(tiny_ds2_gguf), "-p", "8", "-n", "4", "-t", "1",
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout)
    assert rows and all(r["model_type"].startswith("deepseek2 16B") for r in rows), rows
    assert all(r["avg_ts"] > 0 for r in rows)


def _llama_tool(name: str):
    """llama.cpp's built tool `name`; skipped where it is not built, failed under CI."""
    import os
    from benchmarks.peers._llamacpp_tools import tool
    t = tool(name)
    if t is None:
        why = f"{name} is not built (benchmarks/peers/_llamacpp_tools.py builds it)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run llama.cpp on the GGUF")
        pytest.skip(why)
    return t


# gpt-oss-20b's config at tiny widths: 24 layers (llama.cpp names that count 20B), a sliding
# window of 8 (the tests' prompts cross it), MXFP4 widths (multiples of 32)
TINY_OSS = {**RM.SHAPES["gpt-oss-20b"], "hidden_size": 256, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
            "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 4096,
            "sliding_window": 8}


@pytest.fixture()
def tiny_oss(tmp_path, monkeypatch):
    monkeypatch.setitem(RM.SHAPES, "tiny-oss", TINY_OSS)
    monkeypatch.setitem(RM.GGUF_ARCH, "tiny-oss", "gpt-oss")
    monkeypatch.setattr(RM, "SPARE_DISK", 0)
    return RM.paths("tiny-oss", tmp_path)


def test_gptoss_mxfp4_draws_keep_unit_scale_in_both_layouts():
    """Each layout dequantized by its own reader (Colibri's format/mxfp4.py, gguf's
    quants): mean 0, rows of norm 1 x sqrt(fan-in)."""
    from benchmarks.peers._llamacpp_tools import import_gguf
    from colibri_core.format.mxfp4 import dequantize_mxfp4
    gguf = import_gguf()
    rows, cols = 64, 2880
    for w in (dequantize_mxfp4(RG.mxfp4(RM.Draw(5), rows, cols)),
              gguf.quants.dequantize(RG.mxfp4_rows(RM.Draw(5), rows, cols),
                                     gguf.GGMLQuantizationType.MXFP4).reshape(rows, cols),
              gguf.quants.dequantize(RG.q8_0_rows(RM.Draw(5), rows, cols),
                                     gguf.GGMLQuantizationType.Q8_0).reshape(rows, cols)):
        assert abs(w.mean()) < 0.02 / np.sqrt(cols)
        assert abs(w.std() * np.sqrt(cols) - 1) < 0.05


def test_gptoss_colibri_model_is_the_converters_and_runs(tiny_oss):
    """What `colibri convert` makes of gpt-oss: MXFP4 experts with biases, attention biases
    and sinks, the router's logit bias, alternating sliding windows; it loads, and 24 prompt
    tokens (past the window of 8) then 8 greedy steps give finite logits of a sane spread."""
    from colibri_core.engine import Engine
    from colibri_core.format.modelfile import ContainerFile
    mdir = RM.write_colibri("tiny-oss", tiny_oss["colibri"])
    cfg = RM.model_config("tiny-oss")
    assert cfg.attention_window == [8, 0] * 12 and cfg.attention_sinks
    on_disk = sum(p.stat().st_size for p in mdir.iterdir() if p.suffix == ".bin")
    assert on_disk <= RM.colibri_bytes(cfg) <= on_disk + (128 << 10)
    ex = ContainerFile(mdir / "expert_3_5.bin")
    assert {n: s.dtype for n, s in ex.sections.items()} == {
        "w1": "mxfp4", "w3": "mxfp4", "w2": "mxfp4", "w1.bias": "f32", "w3.bias": "f32",
        "w2.bias": "f32"}
    ex.close()
    main, rt = ContainerFile(mdir / "model.bin"), ContainerFile(mdir / "routing.bin")
    assert {f"layer.1.{n}" for n in ("bq", "bk", "bv", "bo", "sinks")} <= set(main.sections)
    assert (main.sections["layer.1.wq"].dtype, main.sections["layer.1.wk"].dtype) == ("q4", "q8")
    assert "layer.23.router_logit_bias" in rt.sections
    main.close()
    rt.close()
    eng = Engine.from_model_dir(mdir, threads=1)
    cache = eng.model.new_cache(40)
    lg = eng.model.forward([np.arange(1, 25)], [cache])
    for _ in range(8):
        assert np.isfinite(lg[0]).all() and 0.1 < lg[0].std() < 100
        lg = eng.model.forward([np.array([int(np.argmax(lg[0]))])], [cache])
    eng.close()


def test_set_routing_keeps_gptoss_router_biases(tiny_oss):
    from colibri_core.format.modelfile import ContainerFile
    RM.write_colibri("tiny-oss", tiny_oss["colibri"])
    rb = tiny_oss["colibri"] / "routing.bin"

    def bias():
        cf = ContainerFile(rb)
        b = np.array(cf.tensor("layer.7.router_logit_bias"))
        cf.close()
        return b
    before = bias()
    RR.set_routing("tiny-oss", "skewed", tiny_oss["colibri"].parent)
    assert np.array_equal(bias(), before)


def test_gptoss_gguf_has_llamas_layout(tiny_oss):
    """llama.cpp's `gpt-oss` tensors (src/models/openai-moe.cpp's load_arch_tensors) and
    keys (its converter's), ggml-order shapes, the types of ggml-org's MXFP4 release."""
    from benchmarks.peers._llamacpp_tools import import_gguf
    gguf = import_gguf()
    path = RM.write_gguf("tiny-oss", tiny_oss["gguf"])
    assert path.name == "tiny-oss-mxfp4.gguf"
    cfg = RM.model_config("tiny-oss")
    assert RM.gguf_bytes(cfg) - (1 << 20) <= path.stat().st_size <= RM.gguf_bytes(cfg)
    rd = gguf.GGUFReader(str(path))
    kv = {f.name: f.contents() for f in rd.fields.values() if f.name.startswith("gpt-oss.")}
    assert kv["gpt-oss.attention.sliding_window"] == 8
    assert kv["gpt-oss.expert_feed_forward_length"] == 128
    assert (kv["gpt-oss.attention.key_length"], kv["gpt-oss.attention.head_count_kv"]) == (64, 2)
    assert kv["gpt-oss.rope.scaling.factor"] == 32 and kv["gpt-oss.rope.scaling.type"] == "yarn"
    assert kv["gpt-oss.rope.scaling.original_context_length"] == 4096
    assert rd.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    got = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in rd.tensors}
    b = "blk.23."
    want = {"token_embd.weight": ("Q8_0", (256, 512)), "output.weight": ("Q8_0", (256, 512)),
            "output_norm.weight": ("F32", (256,)), b + "attn_norm.weight": ("F32", (256,)),
            b + "post_attention_norm.weight": ("F32", (256,)),
            b + "attn_q.weight": ("Q8_0", (256, 256)), b + "attn_q.bias": ("F32", (256,)),
            b + "attn_k.weight": ("Q8_0", (256, 128)), b + "attn_k.bias": ("F32", (128,)),
            b + "attn_v.weight": ("Q8_0", (256, 128)), b + "attn_v.bias": ("F32", (128,)),
            b + "attn_output.weight": ("Q8_0", (256, 256)), b + "attn_output.bias": ("F32", (256,)),
            b + "attn_sinks.weight": ("F32", (4,)), b + "ffn_gate_inp.weight": ("F32", (256, 8)),
            b + "ffn_gate_inp.bias": ("F32", (8,)),
            b + "ffn_gate_exps.weight": ("MXFP4", (256, 128, 8)),
            b + "ffn_gate_exps.bias": ("F32", (128, 8)),
            b + "ffn_up_exps.weight": ("MXFP4", (256, 128, 8)),
            b + "ffn_up_exps.bias": ("F32", (128, 8)),
            b + "ffn_down_exps.weight": ("MXFP4", (128, 256, 8)),
            b + "ffn_down_exps.bias": ("F32", (256, 8))}
    assert {k: got.get(k) for k in want} == want
    assert len(got) == 3 + 24 * 19                  # and no other tensor
    # the tensors' names and types, and the keys, of a file llama.cpp's converter and
    # llama-quantize MXFP4_MOE made (tests/data/gguf/remake.py; two layers)
    ref = gguf.GGUFReader(str(REPO / "tests/data/gguf/gpt_oss-MXFP4_MOE.gguf"))
    kinds = lambda r: {(t.name, t.tensor_type.name) for t in r.tensors                # noqa: E731
                       if not t.name.startswith("blk.") or t.name.startswith("blk.1.")}
    assert kinds(rd) == kinds(ref)
    ref_kv = {f.name for f in ref.fields.values() if f.name.startswith("gpt-oss.")}
    assert set(kv) - ref_kv == {"gpt-oss.rope.dimension_count", "gpt-oss.vocab_size"}
    assert ref_kv <= set(kv)


def test_llama_cpp_loads_and_runs_the_gptoss_gguf(tiny_oss):
    """llama.cpp's loader takes it and its gpt-oss graph (sinks, sliding window, MXFP4
    experts) runs 16 prompt tokens, past the window of 8, and 4 more (llama-bench)."""
    import json
    import subprocess
    bench = _llama_tool("llama-bench")
    path = RM.write_gguf("tiny-oss", tiny_oss["gguf"])
    p = subprocess.run([str(bench), "-m", str(path), "-p", "16", "-n", "4", "-t", "1",
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout)
    assert rows and all(r["model_type"] == "gpt-oss 20B MXFP4 MoE" for r in rows), rows
    assert all(r["avg_ts"] > 0 for r in rows)


def test_gptoss_floors_count_mxfp4_bytes(tiny_oss):
    """bench_realscale's floors: llama.cpp's from the GGUF's own tensor sizes (the reader's
    n_bytes), Colibri's routed expert as its MXFP4 parts (codes, exponents) and biases."""
    from benchmarks.peers._llamacpp_tools import import_gguf
    from benchmarks.speed._pipeline_inputs import weights_per_token
    from benchmarks.speed.bench_realscale import gguf_floor_bytes
    cfg = RM.model_config("tiny-oss")
    rd = import_gguf().GGUFReader(str(RM.write_gguf("tiny-oss", tiny_oss["gguf"])))
    want = sum(int(t.n_bytes) / (512 if t.name == "token_embd.weight" else
                                 4 if "_exps" in t.name else 1) for t in rd.tensors)
    assert gguf_floor_bytes(cfg) == pytest.approx(want)
    H, I = 256, 128
    one = 2 * I * (H // 2 + H // 32) + H * (I // 2 + I // 32) + 4 * (2 * I + H)
    wpt = weights_per_token(RM.write_colibri("tiny-oss", tiny_oss["colibri"]))
    assert wpt["routed_expert"]["bytes"] == one
    assert wpt["parts"]["routed"]["bytes"] == one * 2 * 24
