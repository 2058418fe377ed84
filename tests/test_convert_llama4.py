"""`colibri convert` for Llama 4's text model (`Llama4ForCausalLM`, issue 32), proven against
transformers' logits as tests/test_convert_families_more.py proves the other families.

Tiny random models with every feature on: MoE layers interleaved with dense ones (the
dense FFN of intermediate_size_mlp), the shared expert, sigmoid top-k routing whose weight
multiplies the expert's input, chunked attention (attention_chunk_size 16: a 48-token
prompt crosses two chunk borders), a NoPE layer with the temperature tuning (floor_scale 4,
so the factor changes within the prompt), the weightless q/k norm after rope, the
interleaved rope pairs (the converter reorders q/k rows); the second case top-2 routing,
q/k/v/o biases, no q/k norm, moe_layers listed and llama3 rope scaling (a blended band
within the test's positions); the third Llama-4-Scout's llama3 rope (factor 16).

- bits 32, float routing/activations: max relative logit error <= 1e-4 over prompts of
  15, 3, 1 and 48 tokens, and 16 greedy tokens identical to transformers' `generate`
  through Colibri's KV cache, from the 15- and the 48-token prompt (positions past 60);
- bits 4 against transformers running Colibri's dequantized weights: <= 1e-3 and the same
  16 greedy tokens from the 48-token prompt; the default fast path (int8 activations,
  fixed-point routing) within 0.05 of the float path;
- what cannot run is refused at convert time in one line naming the field.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_core.convert import convert
from colibri_core.engine import Engine

import hf_helpers
from hf_helpers import assert_float_parity, check_fast_path, float_engine, greedy_match, save
from hf_helpers_more import assert_refused_at_convert, interleave, put_head_and_norms

PROMPTS = [[5, 17, 42, 9, 88, 5, 61, 200, 3, 77, 120, 250, 1, 2, 99], [250, 1, 2], [7],
           [int(v) for v in np.random.default_rng(48).integers(0, 300, 48)]]

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
CASES = {
    "llama4": {},
    "llama4_top2_bias": dict(num_experts_per_tok=2, attention_bias=True, use_qk_norm=False,
                             moe_layers=[0, 2, 3], no_rope_layers=[1, 0, 1, 1],
                             rope_parameters=LLAMA3_ROPE),
    # Llama-4-Scout's rope: factor 16, equal low and high factors (no blended band)
    "llama4_scout_rope": dict(rope_parameters=dict(LLAMA3_ROPE, factor=16.0, high_freq_factor=1.0)),
}


def make_llama4(seed: int = 1, **over):
    torch, tr = hf_helpers._imports()
    kw = dict(vocab_size=300, hidden_size=320, intermediate_size=96, intermediate_size_mlp=320,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
              attention_chunk_size=16, floor_scale=4, attn_scale=0.1,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    kw.update(over)
    return hf_helpers.random_model(tr.Llama4TextConfig(**kw), tr.Llama4ForCausalLM, seed)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    models, dirs = {}, {}

    def get(case: str, bits: int = 32):
        if case not in models:
            models[case] = make_llama4(**CASES[case])
            dirs[case] = tmp_path_factory.mktemp(case)
            save(models[case], dirs[case] / "hf")
        out = dirs[case] / f"out{bits}"
        if not out.exists():
            convert(dirs[case] / "hf", out, bits=bits)
        return models[case], dirs[case] / "hf", out
    return get


@pytest.mark.parametrize("case", list(CASES))
def test_float_weights_match_transformers(built, case):
    model, _, out = built(case, 32)
    assert_float_parity(case, model, out, PROMPTS)
    with float_engine(out) as eng:                 # decoding across chunk borders
        greedy_match(eng, model, PROMPTS[3], 16)


def test_multimodal_checkpoint_converts_its_text_model(tmp_path):
    """Llama4ForConditionalGeneration (the published Scout / Maverick layout): the text
    model under language_model., its config under text_config; the vision tower is left
    out. Parity with the multimodal model run on text."""
    torch, tr = hf_helpers._imports()
    text = dict(vocab_size=300, hidden_size=320, intermediate_size=96, intermediate_size_mlp=320,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                num_local_experts=8, interleave_moe_layer_step=2, attention_chunk_size=16,
                floor_scale=4, max_position_embeddings=256, rms_norm_eps=1e-6)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=32)
    cfg = tr.Llama4Config(text_config=text, vision_config=vision)
    cfg.text_config._attn_implementation = "eager"
    model = hf_helpers.random_model(cfg, tr.Llama4ForConditionalGeneration, 3)
    save(model, tmp_path / "hf")
    c = convert(tmp_path / "hf", tmp_path / "out", bits=32)
    assert c.architecture == "llama4" and c.num_layers == 4
    assert_float_parity("llama4 multimodal", model, tmp_path / "out", PROMPTS)


def test_converted_config_carries_the_family_features(built):
    from colibri_core.config import load_model_config
    _, _, out = built("llama4", 32)
    c = load_model_config(out / "config.json")
    assert c.layer_types == ["dense", "moe", "dense", "moe"] and c.routing_scales_input
    assert (c.scoring_func, c.norm_topk_prob, c.top_k, c.qk_norm) == ("sigmoid", False, 1, "l2")
    assert c.attention_chunk == [16, 16, 16, 0] and c.nope_layers == [3]
    assert (c.attn_temperature_floor, c.attn_temperature_scale) == (4, 0.1)
    assert (c.intermediate_size, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (320, 96, 96) and not c.shared_expert_gate


def load_dequantized_llama4(model, colibri_dir):
    """Colibri's effective (dequantized) weights written back into the transformers model:
    q/k rows (and biases) back in the interleaved order, the experts transposed back."""
    torch, _ = hf_helpers._imports()
    from colibri_core.model.weights import load_model
    from hf_helpers import effective
    w = load_model(colibri_dir)
    sd, D = model.state_dict(), w.cfg.head_size

    def put(name, arr):
        sd[name].copy_(torch.from_numpy(np.array(arr, np.float32).reshape(sd[name].shape)))

    def ffn(prefix, f):
        for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            put(prefix + n + ".weight", effective(getattr(f, s), f.act_scales.get(s)))

    put_head_and_norms(put, w)
    for lw in w.layers:
        q, a = f"model.layers.{lw.index}.", lw.attn
        for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            m = effective(getattr(a, s), a.act_scales.get(s))
            put(q + f"self_attn.{n}.weight", interleave(m, D) if s in ("wq", "wk") else m)
        for s, n in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj"), ("bo", "o_proj")):
            if getattr(a, s) is not None:
                v = getattr(a, s)
                put(q + f"self_attn.{n}.bias", interleave(v, D) if s in ("bq", "bk") else v)
        f = q + "feed_forward."
        if lw.kind == "dense":
            ffn(f, lw.dense)
            continue
        put(f + "router.weight", lw.router)
        ffn(f + "shared_expert.", lw.shared)
        for ex in lw.experts:
            e, s = ex.ffn, ex.ffn.act_scales
            gu = np.concatenate([effective(e.w1, s.get("w1")), effective(e.w3, s.get("w3"))])
            sd[f + "experts.gate_up_proj"][ex.index].copy_(torch.from_numpy(gu.T.astype(np.float32)))
            sd[f + "experts.down_proj"][ex.index].copy_(
                torch.from_numpy(effective(e.w2, s.get("w2")).T.astype(np.float32)))
    w.close()
    return model


@pytest.mark.parametrize("case", ["llama4", "llama4_top2_bias"])
def test_quantized_matches_dequantized_transformers(built, case):
    """4 bits against transformers running Colibri's dequantized weights: the quantized
    kernels, the int8 K/V projections and the routing at 4 bits, all else equal."""
    model, _, out = built(case, 4)
    deq = load_dequantized_llama4(make_llama4(**CASES[case]), out)
    with float_engine(out) as eng:
        errs = [hf_helpers.rel_err(eng.next_token_logits(ids, all_positions=True),
                                   hf_helpers.hf_logits(deq, ids)) for ids in PROMPTS]
        assert max(errs) <= 1e-3, f"{case}: 4-bit float path vs dequantized reference {max(errs):.2e}"
        greedy_match(eng, deq, PROMPTS[3], 16)
    loss = max(hf_helpers.rel_err(hf_helpers.hf_logits(model, ids), hf_helpers.hf_logits(deq, ids))
               for ids in PROMPTS)
    print(f"{case} 4-bit: vs dequantized {max(errs):.2e}; loss vs the original weights {loss:.3f}")


def test_quantized_fast_path_near_the_float_path(built):
    _, _, out = built("llama4", 4)
    with float_engine(out) as ref, Engine.from_model_dir(out) as fast:
        for ids in (PROMPTS[0], PROMPTS[3]):
            check_fast_path(fast, ref, ids, "llama4-4")


REFUSALS = [
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types ['sliding_attention']"),
    ({"attention_chunk_size": None}, "attention_chunk_size=None"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}},
     "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
]


@pytest.mark.parametrize("patch,needle", REFUSALS, ids=[n for _, n in REFUSALS])
def test_unsupported_options_are_refused_in_one_line(built, tmp_path, patch, needle):
    _, hf, _ = built("llama4", 32)
    assert_refused_at_convert(hf, tmp_path, patch, needle)
