#!/usr/bin/env python3
"""Train Colibri's small built-in demo MoE model and write a Hugging Face checkpoint.

What it does
------------
1. Builds an English corpus fully offline from the running Python's stdlib
   (scripts/builtin_corpus.py): the pydoc documentation topics
   (``pydoc_data.topics.topics``, ~465 KB), one document each, plus every
   stdlib module's docstrings (parsed with ``ast``, nothing is imported; tests,
   idlelib tests, lib2to3 and site-packages are skipped) as one document per
   module, so documents are long enough for a 2,048-token context to matter.
   Documents are split train/validation with a content hash (crc32 % 20 == 0 ->
   validation, i.e. ~5% held out), so the split does not depend on the seed.
2. Trains a byte-level BPE tokenizer (``tokenizers``, vocab 1024) on the
   training split only.  Special token ``<|endoftext|>`` has id 0 and serves as
   bos / eos / pad.  Byte-level pre-tokenizer + ByteLevel decoder, so decoding
   reproduces spaces and newlines exactly.
3. Trains ``transformers.Qwen2MoeForCausalLM`` (4 layers, layer 0 dense, layers
   1-3 MoE with 8 routed experts, top-2, plus a sigmoid-gated shared expert)
   with AdamW + warmup/cosine, including the router load-balancing aux loss.
4. Saves ``model.save_pretrained(out, safe_serialization=True)``, the
   tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` via
   ``PreTrainedTokenizerFast``), ``generation_config.json`` and
   ``training_info.json`` (steps, losses, time, seed, corpus sizes, samples).

Rerun
-----
    python scripts/train_builtin.py --out build/builtin_hf --steps 2000 --seed 0

(the committed model: 2,000 steps of 2 x 2,048 tokens; about 13 minutes on 2 idle cores)

``--minutes`` is a wall-clock budget: the script times a few calibration steps
and then fixes the total number of optimizer steps (so the LR schedule is
well defined).  Given the same ``--steps`` and ``--seed`` a run is
bit-for-bit reproducible on the same machine/torch build; the step count of a
``--minutes`` run is recorded in ``training_info.json``, so to reproduce
exactly pass it back with ``--steps N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from builtin_corpus import EOS, build_corpus, encode_stream, split_docs  # noqa: E402

# The model was trained on plain documentation, not dialogues: the template only lays a
# conversation out as text (`colibri serve`'s chat route renders it).
CHAT_TEMPLATE = """{#- The built-in model was trained on plain documentation text, not on dialogues: this
    template only lays the conversation out as text, one "role: content" line each. -#}
{% for message in messages %}
{{ message['role'] }}: {{ message['content'] if message['content'] is string else message['content'] | map(attribute='text') | join('') }}
{% endfor %}
{% if add_generation_prompt %}
assistant:
{%- endif %}
"""

# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(train_docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],  # -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes always present
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    assert tok.token_to_id(EOS) == 0
    return tok


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def make_config(vocab_size: int, eos_id: int, seq_len: int):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,  # dense FFN (layer 0)
        num_hidden_layers=4,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
        norm_topk_prob=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=max(256, seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_sliding_window=False,
        qkv_bias=True,  # Qwen2 attention has q/k/v biases (default of the architecture)
        attention_dropout=0.0,
        output_router_logits=False,  # turned on explicitly in the training forward
        router_aux_loss_coef=0.01,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
    )


@torch.no_grad()
def init_params(model, num_layers: int, hidden: int, std: float = 0.02) -> None:
    """Explicit init of every parameter (do not rely on the transformers init path).

    normal(0, 0.02) for embeddings / linear / fused expert weights, residual output
    projections (o_proj, down_proj) scaled by 1/sqrt(2*num_layers), router
    normal(0, 1/sqrt(hidden)), biases 0, RMSNorm weights 1.
    """
    out_std = std / math.sqrt(2 * num_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif name.endswith("mlp.gate.weight"):  # router [E, H]
            p.normal_(0.0, 1.0 / math.sqrt(hidden))
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight") or name.endswith(
            "experts.down_proj"
        ):
            p.normal_(0.0, out_std)
        else:  # embeddings, q/k/v, gate/up, fused gate_up, shared_expert_gate, lm_head
            p.normal_(0.0, std)


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def with_bos(x: torch.Tensor, bos_id: int) -> torch.Tensor:
    """[B, T-1] tokens -> [B, T] with bos_id in front of each row."""
    return torch.cat([torch.full((x.shape[0], 1), bos_id, dtype=x.dtype), x], 1).contiguous()


def forward_losses(model, x: torch.Tensor, y: torch.Tensor):
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), dtype=ce.dtype)
    return ce, aux


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq_len: int, batch: int, max_windows: int | None = None):
    """Mean CE over non-overlapping windows of the stream (+ expert usage counts per MoE layer)."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    data = torch.from_numpy(stream[: n * seq_len + 1].astype(np.int64))
    tot, cnt = 0.0, 0
    usage = None
    for i in range(0, n, batch):
        idx = torch.arange(i, min(n, i + batch))
        starts = idx * seq_len
        y = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        x = with_bos(y[:, :-1], model.config.bos_token_id)
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1), reduction="sum")
        tot += ce.item()
        cnt += y.numel()
        if out.router_logits:
            k = model.config.num_experts_per_tok
            cur = [
                torch.bincount(rl.topk(k, dim=-1).indices.reshape(-1), minlength=model.config.num_experts)
                for rl in out.router_logits
            ]
            usage = cur if usage is None else [a + b for a, b in zip(usage, cur)]
    model.train()
    return tot / max(1, cnt), [u.tolist() for u in usage] if usage else []


def generate_samples(model, tok, prompts, max_new_tokens=80, seed=0):
    model.eval()
    res = {}
    for p in prompts:
        ids = torch.tensor([[model.config.bos_token_id] + tok.encode(p, add_special_tokens=False).ids])
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            torch.manual_seed(seed)
            s = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)
        res[p] = {
            "greedy": tok.decode(g[0].tolist(), skip_special_tokens=False),
            "sampled": tok.decode(s[0].tolist(), skip_special_tokens=False),
        }
    model.train()
    return res


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="build/builtin_hf")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (ignored with --steps)")
    ap.add_argument("--steps", type=int, default=0, help="exact number of optimizer steps (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=2048, help="training window = the model's context")
    ap.add_argument("--batch", type=int, default=2, help="windows per step (2 x 2048 = 4096 tokens)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250, help="quick val on 64 windows every N steps (0=off)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-docstrings", action="store_true", help="use only pydoc topics as corpus")
    ap.add_argument(
        "--experts-impl",
        default="grouped_mm",
        help="transformers experts implementation used while training (grouped_mm ~8%% faster than eager on CPU; "
        "numerically identical here); the saved checkpoint is unaffected",
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    t_start = time.time()

    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2MoeForCausalLM

    # ---- data -----------------------------------------------------------------------
    docs = build_corpus(use_docstrings=not args.no_docstrings)
    train_docs, val_docs = split_docs(docs)
    n_chars_train = sum(len(d) for d in train_docs)
    n_chars_val = sum(len(d) for d in val_docs)
    print(
        f"corpus: {len(docs)} docs, {n_chars_train + n_chars_val} chars "
        f"(train {len(train_docs)} docs/{n_chars_train} chars, val {len(val_docs)} docs/{n_chars_val} chars)",
        flush=True,
    )

    tok = train_tokenizer(train_docs, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    train_stream = encode_stream(tok, train_docs, eos_id)
    val_stream = encode_stream(tok, val_docs, eos_id)
    print(
        f"tokenizer: vocab {vocab}, {EOS}={eos_id}; train {len(train_stream)} tokens "
        f"({n_chars_train / len(train_stream):.2f} chars/tok), val {len(val_stream)} tokens "
        f"[{time.time() - t_start:.1f}s]",
        flush=True,
    )
    sample = "The assert statement\n    x = 1"
    assert tok.decode(tok.encode(sample, add_special_tokens=False).ids) == sample, "tokenizer roundtrip failed"

    # ---- model ----------------------------------------------------------------------
    config = make_config(vocab, eos_id, args.seq_len)
    config.router_aux_loss_coef = args.aux_coef
    torch.manual_seed(args.seed)
    model = Qwen2MoeForCausalLM(config)
    init_params(model, config.num_hidden_layers, config.hidden_size)
    if args.experts_impl != "eager":
        model.set_experts_implementation(args.experts_impl)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M params", flush=True)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    data = torch.from_numpy(train_stream.astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)
    L, B = args.seq_len, args.batch
    offs = torch.arange(L + 1)

    def get_batch():
        # Every window starts with <|endoftext|> as BOS, as the engine's prompts do: a token
        # that is always there at position 0 for attention to rest on when nothing else
        # in a long context is relevant (without it, the first run's loss rose beyond
        # ~1,000 positions: docs/BENCHMARKS.md, "The built-in model's context").
        starts = torch.randint(0, len(data) - L, (B,), generator=gen)
        w = data[starts[:, None] + offs[None, :L]]
        return with_bos(w[:, :-1], eos_id), w.contiguous()

    # ---- training -------------------------------------------------------------------
    total_steps = args.steps if args.steps > 0 else None
    calib_steps = 10
    budget_s = args.minutes * 60.0
    t_train0 = time.time()
    t_log, tok_log = time.time(), 0
    step = 0
    ce_hist, aux_hist = [], []
    step_time_ema = None
    while True:
        if total_steps is not None and step >= total_steps:
            break
        lr = lr_at(step, total_steps if total_steps else 10**9, args.warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch()
        ce, aux = forward_losses(model, x, y)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_log += x.numel()
        ce_hist.append(ce.item())
        aux_hist.append(float(aux.detach()))

        if total_steps is None and step == calib_steps:
            # fix the schedule length from measured throughput (excluding the first, slower steps)
            el = time.time() - t_train0
            per_step = el / calib_steps
            remaining = budget_s - (time.time() - t_start)
            total_steps = max(calib_steps + 1, calib_steps + int(remaining / per_step))
            print(f"calibration: {per_step:.3f}s/step -> total_steps={total_steps}", flush=True)

        if step % args.log_every == 0 or step == total_steps:
            now = time.time()
            k = min(args.log_every, len(ce_hist))
            print(
                f"step {step:5d}/{total_steps} lr {lr:.2e} ce {sum(ce_hist[-k:]) / k:.4f} "
                f"aux {sum(aux_hist[-k:]) / k:.3f} gnorm {float(gnorm):.2f} "
                f"tok/s {tok_log / (now - t_log):.0f} elapsed {now - t_start:.0f}s",
                flush=True,
            )
            if args.steps <= 0 and step > calib_steps:
                # --minutes mode on a shared CPU: if throughput dropped, shrink the schedule (never grow
                # it) so that the cosine still completes roughly within the budget.
                sec_per_step = (now - t_log) / (tok_log / (B * L))
                step_time_ema = sec_per_step if step_time_ema is None else 0.7 * step_time_ema + 0.3 * sec_per_step
                left = budget_s - (now - t_start)
                if (total_steps - step) * step_time_ema > 1.1 * max(left, 0.0):
                    new_total = max(step + 1, step + int(max(left, 0.0) / step_time_ema))
                    if new_total < total_steps:
                        print(f"  re-plan: slower than calibrated, total_steps {total_steps} -> {new_total}", flush=True)
                        total_steps = new_total
            t_log, tok_log = now, 0
        if args.eval_every and step % args.eval_every == 0:
            vq, _ = evaluate(model, val_stream, L, 32, max_windows=64)
            print(f"  quick val ce {vq:.4f} (ppl {math.exp(vq):.2f})", flush=True)
            t_log = time.time()  # keep eval time out of the tokens/s and re-plan estimates

    train_time = time.time() - t_train0
    final_train_ce = sum(ce_hist[-50:]) / len(ce_hist[-50:])
    val_ce, usage = evaluate(model, val_stream, L, 32)
    train_eval_ce, _ = evaluate(model, train_stream, L, 32, max_windows=len(val_stream) // L)
    print(
        f"final: train ce (last 50 steps) {final_train_ce:.4f} | train eval ce {train_eval_ce:.4f} | "
        f"val ce {val_ce:.4f} (ppl {math.exp(val_ce):.2f}) | {step} steps in {train_time:.0f}s",
        flush=True,
    )
    for li, u in enumerate(usage):
        tot = sum(u)
        print(f"  moe layer {li}: expert share " + " ".join(f"{c / tot:.3f}" for c in u), flush=True)

    # ---- save -----------------------------------------------------------------------
    os.makedirs(args.out, exist_ok=True)
    if args.experts_impl != "eager":
        model.set_experts_implementation("eager")
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(args.out)
    tc_path = os.path.join(args.out, "tokenizer_config.json")   # the BOS it was trained with
    with open(tc_path) as fh:
        tc = json.load(fh)
    tc["add_bos_token"] = True
    with open(tc_path, "w") as fh:
        json.dump(tc, fh, indent=2)
    with open(os.path.join(args.out, "chat_template.jinja"), "w") as fh:   # copied by convert
        fh.write(CHAT_TEMPLATE)

    samples = generate_samples(model, tok, ["The assert statement", "The return value"], seed=args.seed)
    for p, s in samples.items():
        print(f"--- prompt {p!r} greedy:\n{s['greedy']}\n--- sampled (T=0.8, top_k=40):\n{s['sampled']}", flush=True)

    info = {
        "script": "scripts/train_builtin.py",
        "argv": sys.argv[1:],
        "args": vars(args),
        "seed": args.seed,
        "steps": step,
        "tokens_seen": step * B * L,
        "final_train_ce_last50": final_train_ce,
        "final_train_eval_ce": train_eval_ce,
        "final_val_ce": val_ce,
        "final_val_ppl": math.exp(val_ce),
        "train_time_s": train_time,
        "total_time_s": time.time() - t_start,
        "n_params": n_params,
        "corpus": {
            "source": "pydoc_data.topics.topics" + ("" if args.no_docstrings else " + stdlib docstrings (ast)"),
            "python": sys.version.split()[0],
            "docs": len(docs),
            "train_docs": len(train_docs),
            "val_docs": len(val_docs),
            "train_chars": n_chars_train,
            "val_chars": n_chars_val,
            "train_tokens": int(len(train_stream)),
            "val_tokens": int(len(val_stream)),
            "split": "crc32(doc) % 20 == 0 -> val",
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab, "eos_id": eos_id, "bos_id": eos_id, "pad_id": eos_id},
        "expert_usage_val": usage,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "samples": samples,
    }
    with open(os.path.join(args.out, "training_info.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    print(f"saved to {args.out} [{time.time() - t_start:.0f}s total]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
