"""DeepSeek-V2-Lite's shape as a Q4_0 GGUF for llama.cpp's `deepseek2` graph
(_realscale_models.write_gguf's tensors and keys for that architecture), named and shaped
as llama.cpp's own converter writes the published checkpoint (conversion/deepseek.py of the
vendored llama.cpp: MLA stored as MQA, kv_b split into k_b and v_b).
`benchmarks/speed/test_realscale_models.py` loads a tiny one with `llama-bench`."""
from __future__ import annotations

import numpy as np

from benchmarks.speed._realscale_models import Draw, q4_0_rows, q6_k_rows


def gguf_tensors(cfg, dr: Draw, f32, q4):
    """llama.cpp's `deepseek2` graph as its converter writes DeepSeek-V2-Lite (no q LoRA):
    MLA with kv_b split into k_b (per head [kv_lora, nope], transposed) and v_b (per head
    [v_head, kv_lora]), a leading dense layer, shared experts as one FFN of n_shared x I."""
    H, V, I, E = cfg.hidden_size, cfg.vocab_size, cfg.expert_intermediate, cfg.num_experts
    nh, R = cfg.num_heads, cfg.kv_lora_rank
    nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    S = cfg.shared_expert_intermediate_size

    def q4s(n: int, rows: int, cols: int):          # n stacked [rows, cols] Q4_0 matrices
        return lambda: np.stack([q4_0_rows(dr, rows, cols) for _ in range(n)])
    for L, kind in enumerate(cfg.layer_types):
        b = f"blk.{L}."
        yield b + "attn_norm.weight", "F32", (H,), f32(H)
        yield b + "attn_q.weight", "Q4_0", (nh * (nope + rope), H), q4(nh * (nope + rope), H)
        yield b + "attn_kv_a_mqa.weight", "Q4_0", (R + rope, H), q4(R + rope, H)
        yield b + "attn_kv_a_norm.weight", "F32", (R,), f32(R)
        yield b + "attn_k_b.weight", "Q4_0", (nh, R, nope), q4s(nh, R, nope)
        yield b + "attn_v_b.weight", "Q4_0", (nh, vd, R), q4s(nh, vd, R)
        yield b + "attn_output.weight", "Q4_0", (H, nh * vd), q4(H, nh * vd)
        yield b + "ffn_norm.weight", "F32", (H,), f32(H)
        if kind == "dense":
            F = cfg.intermediate_size
            yield b + "ffn_gate.weight", "Q4_0", (F, H), q4(F, H)
            yield b + "ffn_down.weight", "Q4_0", (H, F), q4(H, F)
            yield b + "ffn_up.weight", "Q4_0", (F, H), q4(F, H)
            continue
        yield b + "ffn_gate_inp.weight", "F32", (E, H), (lambda: dr.router(E, H))
        for part, (r, c) in (("gate", (I, H)), ("down", (H, I)), ("up", (I, H))):
            yield f"{b}ffn_{part}_exps.weight", "Q4_0", (E, r, c), q4s(E, r, c)
        yield b + "ffn_gate_shexp.weight", "Q4_0", (S, H), q4(S, H)
        yield b + "ffn_down_shexp.weight", "Q4_0", (H, S), q4(H, S)
        yield b + "ffn_up_shexp.weight", "Q4_0", (S, H), q4(S, H)
    yield "output_norm.weight", "F32", (H,), f32(H)
    yield "output.weight", "Q6_K", (V, H), (lambda: q6_k_rows(dr, V, H))


def gguf_metadata(w, gguf, cfg, hf: dict) -> None:
    """The keys llama.cpp's converter writes for DeepSeek-V2 (MLA as MQA: one kv head of
    kv_lora + rope; the MLA head sizes apart; yarn's log multiplier as 0.1 x mscale_all_dim)."""
    R, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(cfg.layer_types.index("moe"))
    w.add_kv_lora_rank(R)
    w.add_key_length(R + rope)
    w.add_value_length(R)
    w.add_key_length_mla(cfg.qk_nope_head_dim + rope)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_shared_count(hf["n_shared_experts"])
    w.add_expert_weights_scale(float(hf["routed_scaling_factor"]))
    w.add_rope_dimension_count(rope)
    rs = hf.get("rope_scaling")
    if rs:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rs["mscale_all_dim"]))
