"""gpt-oss's MoE block (issue 32): the router's logit bias, softmax over the top-k logits,
experts with gate/up and down biases and the clamped SwiGLU (ffn_act "swiglu_clamped").

The numpy reference's block against transformers' GptOssMLP (the same weights, de-interleaved
gate/up rows), then the C pipeline against that reference over a whole (one-layer) model:
f32 experts with float activations (the 32-bit parity path) and MXFP4 experts with int8
activations (the default precision) on every kernel backend."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

from colibri_core.config import EngineConfig, load_model_config  # noqa: E402
from colibri_core.engine import Engine  # noqa: E402
from colibri_core.format.modelfile import ContainerFile  # noqa: E402
from colibri_core.format.mxfp4 import quantize_mxfp4  # noqa: E402
from colibri_core.format.quant import quantize_q4  # noqa: E402
from colibri_core.model.testing import write_random_model  # noqa: E402
from colibri_core.model.weights import FFNWeights, write_model_dir  # noqa: E402

H, I, E, K = 64, 96, 4, 2


def _mlp(seed: int = 0):
    from transformers import GptOssConfig
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                       num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=100)
    torch.manual_seed(seed)
    mlp = gpt_oss.GptOssMLP(cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():              # biases too: every term reaches the output
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5))
        mlp.experts.gate_up_proj.mul_(3.0)      # pre-activations past the clamp at 7
    return cfg, mlp


def _model_dir(tmp_path, mlp, mx):
    """A one-layer model whose MoE block holds mlp's weights (attention: random); experts
    MXFP4 (mx True), float32 (False) or "mixed": the even experts MXFP4, the odd ones q4 at
    group 64 (the same activation group: one step runs both kinds of rows)."""
    base = tmp_path / "base"
    write_random_model(base, seed=1, vocab=100, hidden=H, layers=("moe",), experts=E, top_k=K,
                       moe_inter=I, shared=0, heads=4, kv_heads=2, group=64)
    cfg = load_model_config(base / "config.json").model_copy(update=dict(
        ffn_act="swiglu_clamped", swiglu_limit=mlp.experts.limit,
        swiglu_alpha=mlp.experts.alpha, norm_topk_prob=True))
    f = ContainerFile(base / "model.bin", "mmap")
    main = [(n, f.tensor(n)) for n in f.sections]
    ex = mlp.experts
    gu, gub = ex.gate_up_proj.detach().numpy(), ex.gate_up_proj_bias.detach().numpy()
    dn, dnb = ex.down_proj.detach().numpy(), ex.down_proj_bias.detach().numpy()
    def mat(a, e):
        if mx == "mixed" and e % 2:
            return quantize_q4(np.ascontiguousarray(a, np.float32), 64)
        return quantize_mxfp4(a) if mx else np.ascontiguousarray(a, np.float32)
    experts = [(0, e, FFNWeights(mat(gu[e][:, 0::2].T, e), mat(gu[e][:, 1::2].T, e),
                                 mat(dn[e].T, e),
                                 biases={"w1": gub[e][0::2], "w3": gub[e][1::2], "w2": dnb[e]}))
               for e in range(E)]
    routing = [("layer.0.router", mlp.router.weight.detach().numpy().astype(np.float32)),
               ("layer.0.router_logit_bias", mlp.router.bias.detach().numpy().astype(np.float32))]
    out = tmp_path / {True: "mx", False: "f32", "mixed": "mixed"}[mx]
    write_model_dir(out, cfg, main, routing, experts)
    f.close()
    return out


def test_reference_block_matches_transformers(tmp_path):
    _, mlp = _mlp()
    x = torch.randn(1, 23, H) * 2
    with torch.no_grad():
        want = mlp(x)[0][0].double().numpy()
    with Engine(_model_dir(tmp_path, mlp, mx=False),
                EngineConfig(activations="float", routing="float")) as eng:
        ref = eng.model.ref
        lw = ref.w.layers[0]
        got = ref._moe(lw, x[0].numpy().astype(np.float32), np.full(23, K), ref.expert_set)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # the clamp is reached (else a plain SwiGLU would pass too)
    with torch.no_grad():
        gate = (x[0] @ mlp.experts.gate_up_proj[0])[:, ::2]
    assert (gate > mlp.experts.limit).any()


def _backends():
    from colibri_core import kernels as K
    return K.available_backends()


@pytest.mark.parametrize("mx,backend", [(False, "auto"), ("mixed", "auto")] +
                         [(True, b) for b in _backends()])
def test_pipeline_matches_the_reference(tmp_path, mx, backend):
    from colibri_core import kernels as K
    K.set_backend(backend)
    try:
        _pipeline_vs_reference(tmp_path, mx)
    finally:
        K.set_backend("auto")


def _pipeline_vs_reference(tmp_path, mx):
    _, mlp = _mlp(seed=2)
    act = "int8" if mx else "float"
    prompts = [np.random.default_rng(3).integers(0, 100, n) for n in (21, 5, 1)]
    with Engine(_model_dir(tmp_path, mlp, mx), EngineConfig(activations=act, routing="float",
                                                            threads=2)) as eng:
        m = eng.model
        got = m.forward(prompts, [m.new_cache(64) for _ in prompts], all_logits=True)
        want = m.ref.forward(prompts, [m.ref.new_cache(64) for _ in prompts], all_logits=True)
        # and without the biases the logits move far past the bound
        for ex in m.ref.w.layers[0].experts:
            ex.ffn.biases, keep = {}, ex.ffn.biases
        nob = m.ref.forward(prompts[:1], [m.ref.new_cache(64)], all_logits=True)[0]
    for g, w in zip(got, want):
        assert np.abs(g - w).max() / np.abs(w).max() < (1e-4 if not mx else 2e-3)
    assert np.abs(nob - want[0]).max() / np.abs(want[0]).max() > 1e-2


def test_fingerprint_holds_the_router_logit_bias(tmp_path):
    """A hot-plugged expert's base model: another router bias is another model."""
    from colibri_core.model.fingerprint import fingerprint_of_dir
    _, mlp = _mlp()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = fingerprint_of_dir(_model_dir(tmp_path / "a", mlp, mx=False))
    with torch.no_grad():
        mlp.router.bias[1] += 0.25
    assert fingerprint_of_dir(_model_dir(tmp_path / "b", mlp, mx=False)) != a
