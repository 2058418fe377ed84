"""`colibri verify HF_DIR MODEL_DIR`: a converted model against its source checkpoint.

Runs Hugging Face transformers (when installed; float32 on the CPU) and Colibri on a few
prompts and prints, per prompt and overall: the max relative logit error
(max|a - b| / max|ref| over every position), greedy agreement over N new tokens through
Colibri's KV cache (identical tokens until the first divergence) and the perplexity of the
prompt under both. Without transformers it prints Colibri's own perplexities only.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..model.ops import log_softmax

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Mixture-of-experts models route each token to a small number of experts, which",
]


@dataclass
class PromptResult:
    n_tokens: int
    max_rel_err: Optional[float]
    greedy_same: Optional[int]       # identical greedy tokens before the first divergence
    greedy_total: int
    ppl_colibri: float
    ppl_ref: Optional[float]


def perplexity(logits: np.ndarray, ids: Sequence[int]) -> float:
    """exp(mean NLL) of ids[1:] given logits[:-1] ([n, V], one row per position)."""
    if len(ids) < 2:
        return float("nan")
    lp = log_softmax(np.asarray(logits)[:-1])
    return float(math.exp(-lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


def _prompts(eng, prompts_file: Optional[Path], rng_seed: int = 0) -> list[list[int]]:
    if prompts_file is not None:
        try:
            lines = [l.rstrip("\n") for l in Path(prompts_file).read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts {prompts_file}: cannot read ({e})") from None
        lines = [l for l in lines if l.strip()]
        if not lines:
            raise ConfigError(f"--prompts {prompts_file}: no prompts (one per line)")
    else:
        lines = DEFAULT_PROMPTS if eng.tokenizer is not None else None
    if lines is None:                      # no tokenizer: seeded random token ids
        rng = np.random.default_rng(rng_seed)
        return [rng.integers(0, eng.model_cfg.vocab_size, n).tolist() for n in (24, 12, 5)]
    out = []
    for l in lines:
        if eng.tokenizer is None or all(p.isdigit() for p in l.split()):
            out.append([int(p) for p in l.split()])
        else:
            out.append(eng.encode(l))
    return out


def _load_reference(hf_dir: Path):
    """(model, None) or (None, reason)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, "transformers/torch not installed"
    try:
        m = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    except Exception as e:   # e.g. an AWQ checkpoint without autoawq
        return None, f"transformers could not load {hf_dir}: {str(e).splitlines()[0][:120]}"
    return m.eval(), None


def _ref_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].double().numpy()


def _ref_greedy(model, ids, n: int) -> list[int]:
    import torch
    x = torch.tensor([list(ids)])
    # an explicit mask: without one, generate takes prompt tokens equal to pad_token_id
    # (0 here) for padding and masks them out
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0][len(ids):].tolist()


def verify(hf_dir, model_dir, prompts_file=None, n_new: int = 16, routing: str = "fixed",
           activations: str = "int8", out=None, reference=None) -> list[PromptResult]:
    """Compare and print (to `out`, default the sys.stdout of the call, not of the import);
    returns the per-prompt results. `reference`: an already built transformers model
    (tests), instead of loading `hf_dir`."""
    out = sys.stdout if out is None else out
    from ..engine import Engine
    hf_dir, model_dir = Path(hf_dir), Path(model_dir)
    ref, why = (reference, None) if reference is not None else _load_reference(hf_dir)
    results = []
    with Engine.from_model_dir(model_dir, routing=routing, activations=activations) as eng:
        prompts = _prompts(eng, prompts_file)
        print(f"colibri verify: {model_dir} ({eng.model_cfg.architecture}, "
              f"{eng.model_cfg.quantization.get('method', '?')} "
              f"{eng.model_cfg.quantization.get('bits', '?')}-bit) vs "
              f"{'transformers ' + str(hf_dir) if ref is not None else why}; "
              f"routing={routing}, activations={activations}", file=out)
        for i, ids in enumerate(prompts):
            ours = eng.next_token_logits(ids, all_positions=True)
            gen = eng.generate(list(ids), max_new_tokens=n_new, temperature=0).run().token_ids
            r = PromptResult(len(ids), None, None, len(gen), perplexity(ours, ids), None)
            if ref is not None:
                theirs = _ref_logits(ref, ids)
                r.max_rel_err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
                r.ppl_ref = perplexity(theirs, ids)
                rg = _ref_greedy(ref, ids, n_new)[:len(gen)]
                r.greedy_same = next((j for j, (a, b) in enumerate(zip(gen, rg)) if a != b), len(gen))
            results.append(r)
            line = f"  prompt {i}: {r.n_tokens} tokens, ppl colibri {r.ppl_colibri:.3f}"
            if ref is not None:
                line += (f", ref {r.ppl_ref:.3f}; max rel logit error {r.max_rel_err:.2e}; "
                         f"greedy {r.greedy_same}/{r.greedy_total} identical")
            print(line, file=out)
    if ref is not None:
        worst = max(r.max_rel_err for r in results)
        same = sum(r.greedy_same for r in results)
        tot = sum(r.greedy_total for r in results)
        pc = math.exp(np.mean([math.log(r.ppl_colibri) for r in results if r.n_tokens > 1]))
        pr = math.exp(np.mean([math.log(r.ppl_ref) for r in results if r.n_tokens > 1]))
        print(f"  overall: max rel logit error {worst:.2e}, greedy agreement {same}/{tot}, "
              f"perplexity colibri {pc:.3f} vs reference {pr:.3f} ({(pc / pr - 1) * 100:+.2f}%)",
              file=out)
    return results
