"""benchmarks/speed/_realscale_models.py's drawn weights and routing variants (issue 31):
q4 codes of mean zero (uniform 0..15 about 8 have mean -0.5, a rank-one part that makes
every token of a deep random model route alike), the skewed routers' popularity, and
set_routing writing the same routers into a Colibri model and its GGUF.

A check of the benchmark's own tool, kept beside it (no test under tests/ imports a
benchmark): `python -m pytest benchmarks/speed/test_realscale_models.py` from the
repository root."""

import numpy as np
import pytest

from benchmarks.speed import _realscale_models as RM
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
    from benchmarks.peers._llamacpp_tools import tool
    bench = tool("llama-bench")
    if bench is None:
        pytest.skip("llama-bench is not built (benchmarks/peers/_llamacpp_tools.py builds it)")
    p = subprocess.run([str(bench), "-m", str(tiny_ds2_gguf), "-p", "8", "-n", "4", "-t", "1",
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(p.stdout)
    assert rows and all(r["model_type"].startswith("deepseek2 16B") for r in rows), rows
    assert all(r["avg_ts"] > 0 for r in rows)
