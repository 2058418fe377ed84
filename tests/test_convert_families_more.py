"""`colibri convert` for the families of issue 32 (Granite MoE, GLM-4.5, ERNIE-4.5-MoE), proven against
transformers' logits as tests/test_convert_families.py proves the first six.

Tiny random models (hidden 320: two full groups of 128 and a partial one) with every feature
of the family on (hf_helpers_more.make_more_model): Granite's embedding / attention /
residual / logit multipliers away from 1, with and without its shared expert, tied
embeddings; GLM-4.5's partial rotary (half the head), q/k/v biases, q/k norms, sigmoid
routing with the correction bias and expert groups, shared expert, a dense first layer,
and YaRN rope scaling over the partial rotary dims; ERNIE-4.5's interleaved rope pairs, its
correction bias added to the softmax probabilities, shared experts, dense layers by
moe_layer_start_index / interval, tied embeddings.

- bits 32, float routing/activations: max relative logit error <= 1e-4 over prompts of
  15, 3, 1 and 48 tokens, and 16 greedy tokens identical to transformers' `generate`
  through Colibri's KV cache;
- bits 4 against transformers running Colibri's dequantized weights: <= 1e-3 and the
  same greedy tokens; the default fast path within 0.05 of the float path (routing
  flips at near-ties reported); the 4-bit loss against the original weights printed (-s).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_core.convert import convert
from colibri_core.engine import Engine
from colibri_core.errors import ConfigError

from hf_helpers import check_fast_path, greedy_match, hf_logits, rel_err, save
from hf_helpers_more import load_dequantized_more, make_more_model

H = 320
PROMPTS = [[5, 17, 42, 9, 88, 5, 61, 200, 3, 77, 120, 250, 1, 2, 99], [250, 1, 2], [7],
           [int(v) for v in np.random.default_rng(48).integers(0, 300, 48)]]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}

# name: (family, overrides, how the checkpoint is saved)
CASES = {
    "granitemoe_tied": ("granitemoe", {"tie_word_embeddings": True}, {}),
    "granitemoeshared": ("granitemoeshared", {}, {}),
    "granitemoeshared_fused": ("granitemoeshared", {"num_key_value_heads": 4}, {"fused": True}),
    "glm4_moe": ("glm4_moe", {}, {}),
    "glm4_moe_yarn_plain": ("glm4_moe", {"rope_parameters": YARN, "attention_bias": False,
                                         "use_qk_norm": False, "n_group": 1, "topk_group": 1,
                                         "norm_topk_prob": False}, {"fused": True}),
    "ernie4_5_moe": ("ernie4_5_moe", {}, {}),
    "ernie4_5_moe_interval": ("ernie4_5_moe", {"moe_layer_interval": 2, "moe_layer_start_index": 0,
                                               "moe_num_shared_experts": 0, "num_hidden_layers": 4,
                                               "tie_word_embeddings": False}, {"fused": True}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models, dirs = {}, {}

    def get(case: str, bits: int = 32):
        fam, over, how = CASES[case]
        if case not in models:
            models[case] = make_more_model(fam, seed=1, hidden_size=H, **over)
        if case not in dirs:
            dirs[case] = tmp_path_factory.mktemp(case)
            save(models[case], dirs[case] / "hf", **how)
        d = dirs[case]
        out = d / f"out{bits}"
        if not out.exists():
            convert(d / "hf", out, bits=bits)
        return models[case], d / "hf", out
    return get


def _float_engine(out):
    return Engine.from_model_dir(out, routing="float", activations="float")


@pytest.mark.parametrize("case", list(CASES))
def test_float_weights_match_transformers(built, case):
    model, _, out = built(case, 32)
    with _float_engine(out) as eng:
        errs = [rel_err(eng.next_token_logits(ids, all_positions=True), hf_logits(model, ids))
                for ids in PROMPTS]
        print(f"{case}: 32-bit max relative logit error {max(errs):.2e}")
        assert max(errs) <= 1e-4, f"{case}: relative logit error {max(errs):.2e}"
        greedy_match(eng, model, PROMPTS[0], 16)


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


QUANT = ["granitemoeshared", "glm4_moe", "ernie4_5_moe"]


@pytest.mark.parametrize("case", QUANT)
def test_4bit_matches_dequantized_transformers(built, case):
    model, _, out = built(case, 4)
    fam, over, _ = CASES[case]
    deq = load_dequantized_more(make_more_model(fam, seed=1, hidden_size=H, **over), out)
    with _float_engine(out) as eng:
        ours = [eng.next_token_logits(ids, all_positions=True) for ids in PROMPTS]
        errs = [rel_err(o, hf_logits(deq, ids)) for o, ids in zip(ours, PROMPTS)]
        assert max(errs) <= 1e-3, f"{case}: 4-bit float path vs dequantized reference {max(errs):.2e}"
        greedy_match(eng, deq, PROMPTS[0], 16)
    loss = max(rel_err(o, hf_logits(model, ids)) for o, ids in zip(ours, PROMPTS))
    print(f"{case} 4-bit: vs dequantized {max(errs):.2e}; loss vs original weights: max rel "
          f"logit error {loss:.3f}")
    with _float_engine(out) as ref, Engine.from_model_dir(out) as fast:
        for ids in PROMPTS[:2]:
            check_fast_path(fast, ref, ids, f"{case}-4")


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
    d = tmp_path / "hf"
    shutil.copytree(hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not supported") as e:
        convert(d, tmp_path / "out")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
