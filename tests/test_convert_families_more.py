"""`colibri convert` for the families of issue 32 (Granite MoE, GLM-4.5, ERNIE-4.5-MoE), proven against
transformers' logits as tests/test_convert_families.py proves the first six.

Tiny random models (hidden 320: two full groups of 128 and a partial one) with every feature
of the family on (hf_helpers_more.make_more_model): Granite's embedding / attention /
residual / logit multipliers away from 1, with and without its shared expert, tied
embeddings, YaRN; GLM-4.5's partial rotary (half the head), q/k/v biases, q/k norms, sigmoid
routing with the correction bias and expert groups, shared expert, a dense first layer,
and YaRN rope scaling over the partial rotary dims; ERNIE-4.5's interleaved rope pairs, its
correction bias added to the softmax probabilities, shared experts, dense layers by
moe_layer_start_index / interval, tied embeddings; YaRN over the interleaved pairs.

- bits 32, float routing/activations: max relative logit error <= 1e-4 over prompts of
  15, 3, 1 and 48 tokens, and 16 greedy tokens identical to transformers' `generate`
  through Colibri's KV cache;
- bits 4 against transformers running Colibri's dequantized weights: <= 1e-3 and the
  same greedy tokens; the default fast path within 0.05 of the float path (routing
  flips at near-ties reported); the 4-bit loss against the original weights printed (-s).
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_core.convert import convert
from colibri_core.engine import Engine

from hf_helpers import (assert_float_parity, check_fast_path, float_engine, greedy_match,
                        hf_logits, rel_err, save)
from hf_helpers_more import assert_refused_at_convert, load_dequantized_more, make_more_model

H = 320
PROMPTS = [[5, 17, 42, 9, 88, 5, 61, 200, 3, 77, 120, 250, 1, 2, 99], [250, 1, 2], [7],
           [int(v) for v in np.random.default_rng(48).integers(0, 300, 48)]]
YARN_FULL = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10000.0}
YARN = dict(YARN_FULL, partial_rotary_factor=0.5)

# name: (family, overrides, how the checkpoint is saved)
CASES = {
    "granitemoe_tied_yarn": ("granitemoe", {"tie_word_embeddings": True, "rope_parameters": YARN_FULL}, {}),
    "granitemoeshared": ("granitemoeshared", {}, {}),
    "granitemoeshared_fused": ("granitemoeshared", {"num_key_value_heads": 4}, {"fused": True}),
    "glm4_moe": ("glm4_moe", {}, {}),
    "glm4_moe_yarn_plain": ("glm4_moe", {"rope_parameters": YARN, "attention_bias": False,
                                         "use_qk_norm": False, "n_group": 1, "topk_group": 1,
                                         "norm_topk_prob": False}, {"fused": True}),
    "ernie4_5_moe": ("ernie4_5_moe", {}, {}),
    "ernie4_5_moe_interval": ("ernie4_5_moe", {"moe_layer_interval": 2, "moe_layer_start_index": 0,
                                               "moe_num_shared_experts": 0, "num_hidden_layers": 4,
                                               "tie_word_embeddings": False,
                                               "rope_parameters": YARN_FULL}, {"fused": True}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models, dirs = {}, {}

    def get(case: str, bits: int = 32, dtype: str = "f32"):
        fam, over, how = CASES[case]
        if case not in models:
            models[case] = make_more_model(fam, seed=1, hidden_size=H, **over)
        key = (case, dtype)
        if key not in dirs:
            import torch
            dirs[key] = tmp_path_factory.mktemp(f"{case}_{dtype}")
            save(models[case], dirs[key] / "hf", dtype={"f32": None, "bf16": torch.bfloat16}[dtype],
                 **how)
        d = dirs[key]
        out = d / f"out{bits}"
        if not out.exists():
            convert(d / "hf", out, bits=bits)
        return models[case], d / "hf", out
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_float_weights_match_transformers(built, case):
    model, _, out = built(case, 32)
    assert_float_parity(case, model, out, PROMPTS)


def test_converted_config_carries_the_family_features(built):
    """What the converter read: the multipliers, the partial rotary dims, the routing."""
    from colibri_core.config import load_model_config
    _, _, out = built("granitemoeshared", 32)
    c = load_model_config(out / "config.json")
    assert (c.embedding_multiplier, c.attention_multiplier, c.residual_multiplier,
            c.logits_scaling) == (12.0, 0.03, 0.22, 6.0)
    assert c.shared_expert_intermediate_size == 224 and c.norm_topk_prob and not c.shared_expert_gate
    _, _, out = built("glm4_moe", 32)
    c = load_model_config(out / "config.json")
    assert (c.rotary_dim, c.head_size, c.scoring_func, c.n_group, c.topk_group) == \
        (32, 64, "sigmoid", 4, 2)
    assert c.layer_types == ["dense", "moe", "moe"] and c.qk_norm == "per_head" and c.attention_bias


QUANT = [("granitemoeshared", 4, "f32"), ("glm4_moe", 4, "f32"), ("ernie4_5_moe", 4, "f32"),
         ("ernie4_5_moe", 16, "bf16")]


@pytest.mark.parametrize("case,bits,dtype", QUANT, ids=[f"{c}-{b}-{d}" for c, b, d in QUANT])
def test_quantized_matches_dequantized_transformers(built, case, bits, dtype):
    model, _, out = built(case, bits, dtype)
    fam, over, _ = CASES[case]
    deq = load_dequantized_more(make_more_model(fam, seed=1, hidden_size=H, **over), out)
    with float_engine(out) as eng:
        ours = [eng.next_token_logits(ids, all_positions=True) for ids in PROMPTS]
        errs = [rel_err(o, hf_logits(deq, ids)) for o, ids in zip(ours, PROMPTS)]
        assert max(errs) <= 1e-3, f"{case}: {bits}-bit float path vs dequantized reference {max(errs):.2e}"
        greedy_match(eng, deq, PROMPTS[0], 16)
    loss = max(rel_err(o, hf_logits(model, ids)) for o, ids in zip(ours, PROMPTS))
    print(f"{case} {bits}-bit ({dtype} checkpoint): vs dequantized {max(errs):.2e}; loss vs "
          f"original weights: max rel logit error {loss:.3f}")
    with float_engine(out) as ref, Engine.from_model_dir(out) as fast:
        for ids in PROMPTS[:2]:
            check_fast_path(fast, ref, ids, f"{case}-{bits}")


def test_bits16_keeps_the_checkpoint_bits_in_ernie_row_order(built):
    """--bits 16 of a bf16 ERNIE checkpoint: the same bits, q/k rows in the rotate-half
    order (each head's even rows, then its odd rows), every other matrix as stored."""
    from colibri_core.convert.safetensors_reader import Checkpoint
    from colibri_core.model.weights import load_model
    _, hf, out = built("ernie4_5_moe", 16, "bf16")
    ck, w = Checkpoint(hf), load_model(out)
    try:
        D, a = w.cfg.head_size, w.layers[1].attn
        for got, n in ((a.wq, "q_proj"), (a.wk, "k_proj")):
            src = ck.raw(f"model.layers.1.self_attn.{n}.weight")
            heads = src.reshape(-1, D, src.shape[1])
            want = np.concatenate([heads[:, 0::2], heads[:, 1::2]], axis=1).reshape(src.shape)
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(a.wv, ck.raw("model.layers.1.self_attn.v_proj.weight"))
        np.testing.assert_array_equal(w.layers[1].router_bias,
                                      ck.get("model.layers.1.mlp.moe_statics.e_score_correction_bias")[0])
    finally:
        w.close()


def test_awq_calibration_on_a_granite_checkpoint(tmp_path):
    """--calibration on Granite runs end to end (its calibration forward scales the embedding
    and the residual branches as the model does) and the AWQ-scaled 4-bit model matches
    transformers on its own dequantized weights (the scales applied exactly)."""
    from hf_helpers import CALIBRATION_TEXT, write_tokenizer
    model = make_more_model("granitemoeshared", seed=2, hidden_size=H)
    save(model, tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    (tmp_path / "cal.txt").write_text(CALIBRATION_TEXT)
    cfg = convert(tmp_path / "hf", tmp_path / "awq", bits=4, calibration=tmp_path / "cal.txt")
    assert cfg.quantization["method"] == "awq"
    deq = load_dequantized_more(make_more_model("granitemoeshared", seed=2, hidden_size=H),
                                tmp_path / "awq")
    with float_engine(tmp_path / "awq") as eng:
        for ids in PROMPTS:
            assert rel_err(eng.next_token_logits(ids, all_positions=True), hf_logits(deq, ids)) <= 1e-3


REFUSALS = [
    ("granitemoeshared", {"attention_bias": True}, "attention_bias=true for Granite"),
    ("glm4_moe", {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "num_local_experts": 8}, "partial_rotary_factor=0.5"),
    ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("ernie4_5_moe", {"use_bias": True}, "use_bias=true for ERNIE-4.5"),
]


@pytest.mark.parametrize("case,patch,needle", REFUSALS, ids=[n for _, _, n in REFUSALS])
def test_unsupported_options_are_refused_in_one_line(built, tmp_path, case, patch, needle):
    _, hf, _ = built(case, 32)
    assert_refused_at_convert(hf, tmp_path, patch, needle)


def test_verify_greedy_with_a_token_equal_to_the_pad_id(built, tmp_path):
    """`colibri verify` compares greedy tokens with transformers' generate under an explicit
    attention mask: a prompt token 0 (its pad_token_id) is not padding (it was, and a
    correct conversion showed 0/8 identical tokens)."""
    import io
    from colibri_core.convert.verify import verify
    model, hf, out = built("glm4_moe", 32)
    (tmp_path / "p.txt").write_text(" ".join(map(str, PROMPTS[0] + [0])) + "\n0 5 17 0 9\n")
    res = verify(hf, out, tmp_path / "p.txt", n_new=8, routing="float", activations="float",
                 out=io.StringIO(), reference=model)
    assert [(r.greedy_same, r.greedy_total) for r in res] == [(8, 8), (8, 8)]
    assert max(r.max_rel_err for r in res) <= 1e-4
