"""Tiny random Hugging Face MoE models built locally (no hub), and the way back:
writing Colibri's dequantized weights into a transformers model, so kernel/layout bugs
are separated from quantization loss."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = None
transformers = None

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2")


def _imports():
    global torch, transformers
    if torch is None:
        import torch as _t
        import transformers as _tr
        torch, transformers = _t, _tr
        _t.set_num_threads(2)
    return torch, transformers


def make_hf_model(family: str, seed: int = 0, **over):
    """A small random-weight model of `family` with init scales near 1/sqrt(hidden), so
    router logits are not all near zero. Returns the (eval-mode, float32) model."""
    torch, tr = _imports()
    common = dict(vocab_size=300, hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    if family == "qwen2_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=160,
                  shared_expert_intermediate_size=224, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[0], norm_topk_prob=False)
        kw.update(over)
        cfg, cls = tr.Qwen2MoeConfig(**kw), tr.Qwen2MoeForCausalLM
    elif family == "mixtral":
        kw = dict(common, intermediate_size=200, num_local_experts=4, num_experts_per_tok=2)
        kw.update(over)
        cfg, cls = tr.MixtralConfig(**kw), tr.MixtralForCausalLM
    elif family == "qwen3_moe":
        kw = dict(common, intermediate_size=320, moe_intermediate_size=160, num_experts=6,
                  num_experts_per_tok=2, head_dim=48, norm_topk_prob=True)
        kw.update(over)
        cfg, cls = tr.Qwen3MoeConfig(**kw), tr.Qwen3MoeForCausalLM
    elif family == "olmoe":
        kw = dict(common, intermediate_size=160, num_experts=8, num_experts_per_tok=4)
        kw.update(over)
        cfg, cls = tr.OlmoeConfig(**kw), tr.OlmoeForCausalLM
    elif family in ("deepseek_v3", "deepseek_v2"):
        kw = dict(common, num_key_value_heads=4, intermediate_size=320, moe_intermediate_size=96,
                  n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
                  q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, n_shared_experts=1)
        if family == "deepseek_v3":
            kw.update(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
            kw.update(over)
            cfg, cls = tr.DeepseekV3Config(**kw), tr.DeepseekV3ForCausalLM
        else:
            kw.update(n_shared_experts=2, routed_scaling_factor=1.5)
            kw.update(over)
            cfg, cls = tr.DeepseekV2Config(**kw), tr.DeepseekV2ForCausalLM
    else:
        raise ValueError(family)
    return random_model(cfg, cls, seed)


def random_model(cfg, cls, seed: int):
    """cls(cfg) in eval mode with seeded random weights whose activations stay O(1):
    norms near 1, biases and selection biases small, matrices scaled by their fan-in."""
    torch, _ = _imports()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                fan_in = p.shape[-1]
                p.normal_(0.0, 1.0 / np.sqrt(fan_in))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def save(model, path: Path, dtype=None, fused: bool = False, shards: int = 1) -> Path:
    """save_pretrained (per-expert tensor names, as published checkpoints), optionally in
    bf16/f16. fused=True writes the in-memory state dict instead (transformers 5's fused
    `experts.gate_up_proj` / `down_proj` tensors); shards > 1 splits it with an index."""
    torch, _ = _imports()
    path = Path(path)
    m = model if dtype is None else _copy(model).to(dtype)
    if not fused and shards == 1:
        m.save_pretrained(path, safe_serialization=True)
        return path
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    m.config.architectures = [type(m).__name__]
    m.config.save_pretrained(path)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if not fused:
        sd = _unfused(sd)
    names = sorted(sd)
    parts = [names[i::shards] for i in range(shards)]
    wm = {}
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        save_file({k: sd[k] for k in part}, str(path / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in part})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return path


def _copy(model):
    import copy
    return copy.deepcopy(model)


def _unfused(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            I = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :I].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, I:].contiguous()
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def write_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer.json (256 byte tokens, no merges): deterministic and tiny."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def _deq(t):
    from colibri_core.format.quant import (Q4Tensor, Q6Tensor, Q8Tensor, dequantize_q4, dequantize_q6,
                                    dequantize_q8)
    if isinstance(t, Q4Tensor):
        return dequantize_q4(t)
    if isinstance(t, Q6Tensor):
        return dequantize_q6(t)
    if isinstance(t, Q8Tensor):
        return dequantize_q8(t)
    a = np.asarray(t)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def effective(t, act_scale=None) -> np.ndarray:
    """The float matrix Colibri effectively multiplies by (act scale divided out)."""
    w = _deq(t)
    if act_scale is not None:
        w = w / np.asarray(act_scale, np.float64)[None, :]
    return w


def load_dequantized_into(model, colibri_dir: Path):
    """Copy Colibri's effective weights (dequantized, AWQ scales divided out; norms,
    biases and routers too) back into the Hugging Face `model` (in place)."""
    torch, _ = _imports()
    from colibri_core.model.weights import load_model

    w = load_model(colibri_dir)
    sd = model.state_dict()

    def put(name, arr):
        sd[name].copy_(torch.from_numpy(np.array(arr, np.float32).reshape(sd[name].shape)))

    def put_ffn(prefix, ffn):
        for s, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            put(prefix + f"{n}.weight", effective(getattr(ffn, s), ffn.act_scales.get(s)))

    put("model.embed_tokens.weight", _deq(w.embed))
    put("lm_head.weight", _deq(w.lm_head))
    put("model.norm.weight", w.final_norm)
    for lw in w.layers:
        q = f"model.layers.{lw.index}."
        a = lw.attn
        put(q + "input_layernorm.weight", lw.attn_norm)
        put(q + "post_attention_layernorm.weight", lw.ffn_norm)
        if w.cfg.attention == "mla":
            names = {"wq": "q_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj",
                     "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj", "wo": "o_proj"}
            for s, n in names.items():
                if getattr(a, s) is not None:
                    put(q + f"self_attn.{n}.weight", effective(getattr(a, s), a.act_scales.get(s)))
            put(q + "self_attn.kv_a_layernorm.weight", a.kv_a_norm)
            if a.q_a_norm is not None:
                put(q + "self_attn.q_a_layernorm.weight", a.q_a_norm)
        else:
            for s, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
                put(q + f"self_attn.{n}.weight", effective(getattr(a, s), a.act_scales.get(s)))
            for s, n in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                if getattr(a, s) is not None:
                    put(q + f"self_attn.{n}.bias", getattr(a, s))
            if a.q_norm is not None:
                put(q + "self_attn.q_norm.weight", a.q_norm)
                put(q + "self_attn.k_norm.weight", a.k_norm)
        if lw.kind == "dense":
            put_ffn(q + "mlp.", lw.dense)
            continue
        put(q + "mlp.gate.weight", lw.router)
        if lw.router_bias is not None:
            put(q + "mlp.gate.e_score_correction_bias", lw.router_bias)
        gu = sd[q + "mlp.experts.gate_up_proj"]
        dn = sd[q + "mlp.experts.down_proj"]
        put_fused_experts(gu, dn, lw.experts)
        if lw.shared is not None:
            name = "shared_expert." if q + "mlp.shared_expert.gate_proj.weight" in sd else "shared_experts."
            put_ffn(q + "mlp." + name, lw.shared)
            if lw.shared_gate is not None:
                put(q + "mlp.shared_expert_gate.weight", lw.shared_gate)
    w.close()
    return model


def hf_logits(model, ids) -> np.ndarray:
    torch, _ = _imports()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double().numpy()


def hf_greedy(model, ids, n: int) -> list[int]:
    torch, _ = _imports()
    x = torch.tensor([list(ids)])
    with torch.no_grad():     # an explicit mask: a BOS equal to pad_token_id is not padding
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0][len(ids):].tolist()


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def perplexity(logits: np.ndarray, ids) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1] ([n, V] rows for each position)."""
    lg = np.asarray(logits, np.float64)[:-1]
    lg = lg - lg.max(axis=1, keepdims=True)
    lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
    return float(np.exp(-lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


def selection_gap(logits: np.ndarray, cfg, bias, k: int) -> float:
    """How close one token's expert choice is to flipping, in the router's own selection
    space: logits (softmax routers) or sigmoid + correction bias (DeepSeek-V3); with
    group-limited routing, the smaller of the group-choice gap and the expert gap."""
    v = np.asarray(logits, np.float64)
    if cfg.scoring_func == "sigmoid":
        v = 1.0 / (1.0 + np.exp(-v))
    elif cfg.select_bias_on_probs:               # ERNIE-4.5: softmax probabilities + bias
        v = np.exp(v - v.max()) / np.exp(v - v.max()).sum()
    if bias is not None:
        v = v + np.asarray(bias, np.float64)
    gaps = []
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        g = v.reshape(cfg.n_group, -1)
        gs = np.sort(g, axis=1)[:, -2:].sum(1) if cfg.scoring_func == "sigmoid" else g.max(1)
        order = np.argsort(-gs, kind="stable")
        srt = gs[order]
        gaps.append(srt[cfg.topk_group - 1] - srt[cfg.topk_group])
        keep = np.zeros(cfg.n_group, bool)
        keep[order[:cfg.topk_group]] = True
        v = np.where(np.repeat(keep, v.size // cfg.n_group), v, -np.inf)
    srt = np.sort(v)[::-1]
    if k < len(srt) and np.isfinite(srt[k]):
        gaps.append(srt[k - 1] - srt[k])
    return float(min(gaps)) if gaps else float("inf")


def routing_flips(fast, ref) -> list[tuple[int, int, float]]:
    """Tokens whose expert set differs between two engines' last forward, with the
    reference's selection gap (see selection_gap)."""
    cfg = ref.model_cfg
    bias = {lw.index: lw.router_bias for lw in ref.weights.layers}
    flips = []
    for a, b in zip(ref.model.last_routing, fast.model.last_routing):
        for t in range(a.routing.ids.shape[0]):
            if set(a.routing.ids[t]) != set(b.routing.ids[t]):
                k = int((a.routing.ids[t] >= 0).sum())
                flips.append((a.layer, t, selection_gap(a.logits[t], cfg, bias.get(a.layer), k)))
    return flips


def tie_threshold(cfg) -> float:
    """A 'near tie' for check_fast_path: 0.1 in logits, 0.05 in sigmoid units."""
    return 0.05 if cfg.scoring_func == "sigmoid" or cfg.select_bias_on_probs else 0.1


def check_fast_path(fast, ref, ids, case, bound=0.05):
    """The default fast path (int8 activations, fixed-point routing) within `bound` of
    the float path, unless int8 noise flipped an expert choice at a router near-tie,
    which is reported with its gap instead of hidden. Returns (error, flips)."""
    err = rel_err(fast.next_token_logits(ids, all_positions=True),
                  ref.next_token_logits(ids, all_positions=True))
    flips = routing_flips(fast, ref)
    tie = tie_threshold(ref.model_cfg)
    if not flips:
        assert err <= bound, f"{case} {ids}: int8/fixed-point path vs float path {err:.3f}"
    else:
        print(f"{case} {ids}: routing flips at near-ties (layer, token, gap) {flips}, "
              f"logit error {err:.3f}")
        # A flip changes the hidden state of later layers (and, through attention, later
        # tokens), so only the flips of the first layer that has any must be near-ties.
        first = min(L for L, _, _ in flips)
        assert all(gap < tie for L, _, gap in flips if L == first), \
            f"{case}: routing flip away from a near-tie {flips}"
    return err, flips


def float_engine(out):
    """The converted model with float routing and activations: what parity is checked on."""
    from colibri_core.engine import Engine
    return Engine.from_model_dir(out, routing="float", activations="float")


def put_fused_experts(gu, dn, experts) -> None:
    """Write experts' effective (dequantized, activation-scaled) w1|w3 and w2 into
    transformers' fused `gate_up_proj` / `down_proj` tensors, expert by expert."""
    torch, _ = _imports()
    for ex in experts:
        f, s = ex.ffn, ex.ffn.act_scales
        g = np.concatenate([effective(f.w1, s.get("w1")), effective(f.w3, s.get("w3"))], axis=0)
        gu[ex.index].copy_(torch.from_numpy(g.astype(np.float32)))
        dn[ex.index].copy_(torch.from_numpy(effective(f.w2, s.get("w2")).astype(np.float32)))


def assert_float_parity(case: str, model, out, prompts) -> None:
    """The converted model at 32 bits, float routing and activations: logits within 1e-4
    relative of transformers' on every prompt, and 16 greedy tokens through the KV cache
    equal to transformers' on the first."""
    with float_engine(out) as eng:
        errs = [rel_err(eng.next_token_logits(ids, all_positions=True), hf_logits(model, ids))
                for ids in prompts]
        print(f"{case}: 32-bit max relative logit error {max(errs):.2e}")
        assert max(errs) <= 1e-4, f"{case}: relative logit error {max(errs):.2e}"
        greedy_match(eng, model, prompts[0], 16)


def greedy_match(eng, model, ids, n=16) -> list[int]:
    """Colibri's greedy tokens (prefill + decode through its KV cache) equal transformers'
    (fails with the reference's top-1/top-2 gap at the first divergence). Colibri stops
    at an EOS token, which must then be transformers' next token. Returns Colibri's tokens."""
    gen = eng.generate(list(ids), max_new_tokens=n, temperature=0).run()
    ours = gen.token_ids
    ref = hf_greedy(model, ids, n)
    if len(ours) < n:                    # stopped at EOS: transformers' next token is EOS
        assert gen.stop_reason == "eos", gen.stop_reason
        assert ours == ref[:len(ours)] and ref[len(ours)] in eng.model_cfg.eos_token_ids, (ours, ref)
    ref = ref[:len(ours)]
    if ours != ref:
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        logits = hf_logits(model, list(ids) + ref[:i])[-1]
        top2 = np.sort(logits)[-2:]
        raise AssertionError(f"greedy tokens differ at step {i}: ours {ours[i]} vs ref {ref[i]}; "
                             f"reference top-1/top-2 gap {top2[1] - top2[0]:.2e}")
    return ours


def pack_awq(q: np.ndarray) -> np.ndarray:
    """uint values 0..15 [n, m] -> AutoAWQ GEMM-packed int32 [n, m/8]."""
    from colibri_core.convert.awq import AWQ_ORDER
    n, m = q.shape
    v = q.reshape(n, m // 8, 8).astype(np.uint32)
    out = np.zeros((n, m // 8), np.uint32)
    for j, col in enumerate(AWQ_ORDER):
        out |= v[:, :, col] << np.uint32(4 * j)
    return out.view(np.int32)


def save_awq(model, path: Path, group: int = 64) -> dict:
    """A synthetic AutoAWQ (GEMM, 4-bit, zero point) checkpoint of `model`: every linear
    of the decoder layers except routers/gates is RTN-quantized and packed as AutoAWQ
    does (scales in f16). Returns {linear prefix: (q [out,in], zeros, scales f32)}."""
    torch, _ = _imports()
    from safetensors.torch import save_file
    from colibri_core.format.quant import quantize_q4, unpack_nibbles
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = _unfused({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    out, packed = {}, {}
    for k, v in sd.items():
        linear = (k.endswith(".weight") and ".layers." in k and v.ndim == 2
                  and not k.endswith("mlp.gate.weight") and "shared_expert_gate" not in k)
        if not linear:
            out[k] = v
            continue
        prefix = k[: -len(".weight")]
        t = quantize_q4(v.double().numpy(), group)
        s16 = t.scales.astype(np.float16)
        q = unpack_nibbles(t.data)[:, : t.cols]
        out[prefix + ".qweight"] = torch.from_numpy(pack_awq(np.ascontiguousarray(q.T)))
        out[prefix + ".qzeros"] = torch.from_numpy(pack_awq(np.ascontiguousarray(t.zeros.T)))
        out[prefix + ".scales"] = torch.from_numpy(np.ascontiguousarray(s16.T))
        packed[prefix] = (q, t.zeros, s16.astype(np.float32))
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return packed


# ----------------------------------------------------------------------------- AWQ material
# Shared by tests/test_convert_families.py and benchmarks/accuracy/convert_report.py.

AWQ_OUTLIERS = [3, 77, 150, 290]


def inject_outliers(model, F=20.0):
    """Activation outliers at every linear input: a few channels of each RMSNorm weight
    (inputs of q/k/v, router and experts' gate/up) and a few rows of the up / value
    projections (inputs of the down / output projections) scaled up by F."""
    import torch
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
                v[AWQ_OUTLIERS] *= F
            elif k.endswith("experts.gate_up_proj"):
                i = v.shape[1] // 2
                v[:, i + 1:i + 4] *= F
            elif k.endswith(("up_proj.weight", "v_proj.weight")):
                v[1:4] *= F
    return model


CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route every "
    "token to a few experts; the router picks them with a learned linear layer. "
    "Quantization stores weights in four bits, and activation-aware scaling protects the "
    "channels that carry large activations. In 1969 the first message crossed the network; "
    "numbers such as 3.14159 or 2.71828 appear in many formulas. ") * 3
HELD_OUT = ("Once upon a time a small engine read its weights from disk, mapped them into "
            "memory and answered questions about fraud patterns, one token after another.")


def mean_kl(lg, ref):
    """Mean over positions of KL(softmax(ref) || softmax(lg)), rows of logits."""
    def lsm(a):
        a = a - a.max(1, keepdims=True)
        return a - np.log(np.exp(a).sum(1, keepdims=True))
    lp, lq = lsm(np.asarray(ref, np.float64)), lsm(np.asarray(lg, np.float64))
    return float((np.exp(lp) * (lp - lq)).sum(1).mean())


def write_tiny_checkpoint(path: Path, tokenizer: bool = True) -> Path:
    """A tiny Qwen2-MoE checkpoint as a user would download it: safetensors, config.json
    and, with `tokenizer`, the tokenizer and chat-template files that `colibri convert`
    copies (tokenizer.json, tokenizer_config.json, chat_template.jinja,
    special_tokens_map.json, generation_config.json)."""
    path = Path(path)
    save(make_hf_model("qwen2_moe"), path)
    if tokenizer:
        write_tokenizer(path)
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"add_bos_token": False, "model_max_length": 256, "eos_token": "!"}))
        (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "!"}))
        (path / "chat_template.jinja").write_text(
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
        (path / "generation_config.json").write_text(json.dumps(
            {"do_sample": True, "temperature": 0.7, "top_p": 0.9}))
    else:
        for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "special_tokens_map.json", "generation_config.json"):
            (path / n).unlink(missing_ok=True)
    return path
