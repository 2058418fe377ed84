"""`colibri convert` for Phi-3.5-MoE (PhimoeForCausalLM, issue 32) against transformers.

A tiny random PhiMoE built by transformers: 3 layers of LayerNorms with weight and bias,
q/k/v/o biases, an lm_head bias, a sliding window of 6, 4 experts routed by the sparse
mixer (router_jitter_noise 0.3, so its masks keep and drop experts) and LongRoPE with
original_max_position_embeddings 16. transformers 5's PhiMoE computes the rotary
frequencies from short_factor at every length (checked below: a 48-token prompt, past 16,
gets the same frequencies) and scales cos/sin by the mscale (equal short and long).

- bits 32, float routing/activations: logits within 1e-4 relative of transformers' on
  prompts of 48, 15, 3 and 1 tokens, 16 greedy tokens identical to its `generate`;
  the numpy reference forward (reference.py) the same within 1e-4;
- each feature switched off in the converted config (LayerNorm, sparse mixer, its eps,
  LongRoPE) or in transformers (the lm_head bias) moves the logits away;
- the default precision's logit error reported;
- routing.sparsemixer equals transformers' sparsemixer on random logits;
- what cannot be run is refused with the field named.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_core.convert import convert  # noqa: E402
from colibri_core.engine import Engine  # noqa: E402
from colibri_core.errors import ConfigError  # noqa: E402

from hf_helpers import assert_float_parity, float_engine, hf_logits, random_model, rel_err  # noqa: E402

PROMPTS = [[int(v) for v in np.random.default_rng(48).integers(0, 200, 48)],
           [5, 17, 42, 9, 88, 5, 61, 100, 3, 77, 120, 150, 1, 2, 99], [150, 1, 2], [7]]
D = 32                                   # head_dim: 16 rope frequencies


def rope_parameters(mscale=1.19, long_mscale=None):
    rng = np.random.default_rng(7)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [float(v) for v in 1.0 + rng.random(D // 2) * 3],
            "long_factor": [float(v) for v in 4.0 + rng.random(D // 2) * 8],
            "short_mscale": mscale, "long_mscale": mscale if long_mscale is None else long_mscale,
            "original_max_position_embeddings": 16}


def make_model(seed: int = 1, **over):
    from transformers import PhimoeConfig, PhimoeForCausalLM
    kw = dict(hidden_size=128, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
              max_position_embeddings=256, attention_bias=True, lm_head_bias=True,
              sliding_window=6, router_jitter_noise=0.3, rope_parameters=rope_parameters())
    kw.update(over)
    return random_model(PhimoeConfig(**kw), PhimoeForCausalLM, seed)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    model = make_model()
    d = tmp_path_factory.mktemp("phimoe")
    model.save_pretrained(d / "hf", safe_serialization=True)
    convert(d / "hf", d / "out32", bits=32)
    return model, d


def test_transformers_uses_short_factor_past_the_original_length(built):
    """What the LongRoPE field reproduces: transformers' frequencies at 48 positions (past
    original_max_position_embeddings = 16) are short_factor's, cos/sin times the mscale."""
    model, _ = built
    rp = model.config.rope_parameters
    x = torch.zeros(1, 48, 128)
    cos, _ = model.model.rotary_emb(x, torch.arange(48)[None])
    inv = 1.0 / (np.asarray(rp["short_factor"]) * 10000.0 ** (np.arange(0, D, 2) / D))
    want = np.cos(np.arange(48)[:, None] * inv) * rp["short_mscale"]
    assert np.allclose(cos[0, :, :D // 2].numpy(), want, atol=1e-4)


def test_float_weights_match_transformers(built):
    model, d = built
    cfg = json.loads((d / "out32" / "config.json").read_text())
    assert cfg["norm_type"] == "layer" and cfg["scoring_func"] == "sparsemixer"
    assert cfg["rope_scaling"]["type"] == "longrope" and cfg["attention_window"] == [6] * 3
    assert_float_parity("phimoe", model, d / "out32", PROMPTS)


def test_published_architecture_name_converts_alike(built, tmp_path):
    """The published Phi-3.5-MoE config.json names `PhiMoEForCausalLM` (its remote code):
    the same conversion as transformers' `PhimoeForCausalLM`."""
    _, d = built
    hf = tmp_path / "hf"
    shutil.copytree(d / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["PhiMoEForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp_path / "out32", bits=32)
    with float_engine(tmp_path / "out32") as a, float_engine(d / "out32") as b:
        assert np.array_equal(a.next_token_logits(PROMPTS[1], all_positions=True),
                              b.next_token_logits(PROMPTS[1], all_positions=True))


def test_reference_forward_matches_transformers(built):
    from colibri_core.forward.reference import ReferenceModel
    model, d = built
    with float_engine(d / "out32") as eng:
        ref = ReferenceModel(eng.model.w, eng.config)
        for ids in PROMPTS[:2]:
            got = ref.forward([np.asarray(ids)], [ref.new_cache(64)], all_logits=True)[0]
            assert rel_err(got, hf_logits(model, ids)) <= 1e-4


@pytest.mark.parametrize("change", ["norm_type", "scoring_func", "router_jitter_eps", "rope_scaling"])
def test_each_feature_moves_the_logits(built, tmp_path, change):
    model, d = built
    out = tmp_path / "m"
    shutil.copytree(d / "out32", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"norm_type": {"norm_type": "rms"}, "scoring_func": {"scoring_func": "softmax"},
                "router_jitter_eps": {"router_jitter_eps": 0.0},
                "rope_scaling": {"rope_scaling": None}}[change])
    (out / "config.json").write_text(json.dumps(cfg))
    with float_engine(out) as eng:
        err = rel_err(eng.next_token_logits(PROMPTS[0], all_positions=True),
                      hf_logits(model, PROMPTS[0]))
    assert err > 1e-2, f"{change} off: logits within {err:.2e} of transformers"


def test_lm_head_bias_is_applied(built):
    import copy
    model, d = built
    plain = copy.deepcopy(model)
    with torch.no_grad():
        plain.lm_head.bias.zero_()
    with float_engine(d / "out32") as eng:
        got = eng.next_token_logits(PROMPTS[1], all_positions=True)
    assert rel_err(got, hf_logits(plain, PROMPTS[1])) > 1e-2
    assert rel_err(got, hf_logits(model, PROMPTS[1])) <= 1e-4


def test_default_precision_error_reported(built):
    model, d = built
    convert(d / "hf", d / "out4")
    with Engine.from_model_dir(d / "out4") as eng:
        errs = [rel_err(eng.next_token_logits(ids, all_positions=True), hf_logits(model, ids))
                for ids in PROMPTS]
    print(f"phimoe: default precision (q4) max relative logit error vs transformers {max(errs):.3f}")
    assert max(errs) < 1.0


def test_sparsemixer_matches_transformers():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer
    from colibri_core.model.routing import route, sparsemixer
    logits = np.random.default_rng(3).normal(0, 1.5, (500, 8)).astype(np.float32)
    logits[:50] = np.abs(logits[:50]) * 0.05 + 2.0      # near-equal positive logits: wide masks
    for eps in (0.01, 0.3):
        w, ids = hf_sparsemixer(torch.from_numpy(logits), jitter_eps=eps, training=False)
        got_ids, got_w = sparsemixer(logits, eps)
        assert np.array_equal(got_ids, ids.numpy())
        assert np.allclose(got_w, w.numpy(), rtol=1e-5)
        r = route(logits, np.full(500, 2), scoring="sparsemixer", norm_topk_prob=False,
                  jitter_eps=eps)
        assert np.array_equal(r.ids, ids.numpy()) and np.allclose(r.weights, w.numpy(), rtol=1e-5)
    assert (got_w.sum(axis=1) < 1.9).any()              # masks took experts out somewhere


def test_refusals_name_the_field():
    from colibri_core.convert.families import model_config_fields
    base = {"architectures": ["PhimoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "num_local_experts": 4, "rope_parameters": rope_parameters()}
    cfg = model_config_fields(base)
    assert cfg["norm_type"] == "layer" and cfg["rope_scaling"]["attention_factor"] == 1.19
    for over, needle in (({"num_experts_per_tok": 3}, "num_experts_per_tok"),
                         ({"rope_parameters": rope_parameters(1.1, 1.3)}, "long_mscale"),
                         ({"rope_parameters": {**rope_parameters(), "short_factor": [1.0] * 4}},
                          "short_factor"),
                         ({"rope_parameters": {"rope_type": "longrope"}}, "short_factor"),
                         ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ConfigError, match=needle):
            model_config_fields({**base, **over})


def test_layernorm_with_mla_refused():
    """The MLA block runs RMSNorms only: a LayerNorm config there is refused at load."""
    from types import SimpleNamespace
    from colibri_core.forward.steptables import check_attention
    model = SimpleNamespace(cfg=SimpleNamespace(attention="mla", norm_type="layer"), act="int8")
    with pytest.raises(ConfigError, match="norm_type 'layer' with attention 'mla'"):
        check_attention(model, SimpleNamespace(index=0, attn=None))


def test_pipeline_equals_reference_for_any_k(built):
    """The C router's sparse mixer against routing.sparsemixer through the numpy reference
    forward, at a request's k of 1 (the first expert only), 2 and 3 (a third slot unused)."""
    from colibri_core.forward.reference import ReferenceModel
    _, d = built
    with float_engine(d / "out32") as eng:
        m = eng.model
        ref = ReferenceModel(m.w, eng.config)
        c, r = m.new_cache(64), ref.new_cache(64)
        a = m.forward([np.asarray(PROMPTS[1])], [c], all_logits=True)[0]
        b = ref.forward([np.asarray(PROMPTS[1])], [r], all_logits=True)[0]
        assert rel_err(a, b) <= 1e-4
        tok = 5
        for k in (1, 3, 2, 1):
            a = m.decode_step(tok, c, k).copy()
            b = ref.forward([np.array([tok])], [r], [k])[0]
            assert rel_err(a, b) <= 1e-4, k
            tok = int(np.argmax(b))
