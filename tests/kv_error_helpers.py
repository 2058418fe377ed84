"""The logit error of an f16 or q8 KV cache against f32, the same sequence decoded with each:
what benchmarks/accuracy/kv_dtype_error.py reports and tests/test_kvcache.py holds floors on."""
from __future__ import annotations

from pathlib import Path

import numpy as np

DTYPES = ("f16", "q8")
PROMPT_LEN = 128


def decode(model, prompt: list, steps: int, dtype: str, forced: list | None = None):
    """Greedy decode of `steps` tokens after `prompt` with a `dtype` cache (the tokens
    of `forced` fed instead of the greedy ones when given) -> (logits [steps, V], tokens)."""
    cache = model.new_cache(len(prompt) + steps, dtype)
    k = model.cfg.top_k
    out, toks = [], []
    logits = model.forward([np.asarray(prompt)], [cache], [k])[0]
    for i in range(steps):
        out.append(np.array(logits, np.float64))
        tok = int(np.argmax(logits))
        toks.append(tok)
        if i + 1 < steps:
            logits = model.decode_step(forced[i] if forced is not None else tok, cache, k)
    return np.stack(out), toks


def measure(model, prompt: list, steps: int = 64) -> dict:
    """{dtype: {max_rel, median_rel, greedy_agreement, first_divergence}} against f32."""
    ref, ref_toks = decode(model, prompt, steps, "f32")
    res = {}
    for dt in DTYPES:
        got, toks = decode(model, prompt, steps, dt, forced=ref_toks)
        rel = np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)
        _, free = decode(model, prompt, steps, dt)
        div = next((i for i, (a, b) in enumerate(zip(free, ref_toks)) if a != b), None)
        res[dt] = {"max_rel": float(rel.max()), "median_rel": float(np.median(rel)),
                   "greedy_agreement": float(np.mean(np.array(toks) == np.array(ref_toks))),
                   "first_divergence": div}
    return res


def random_model(path: Path) -> Path:
    from colibri_core.model.testing import write_random_model
    write_random_model(path, seed=5, vocab=512, hidden=256, layers=("dense", "moe", "moe"),
                       experts=6, top_k=2, inter=384, moe_inter=192, shared=96, heads=8,
                       kv_heads=2, context=256)
    return path


def prompt_for(eng) -> list:
    """The built-in model: PROMPT_TEXT (what it was trained on is Python); a random model:
    random ids."""
    if eng.tokenizer is not None:
        return eng.encode(PROMPT_TEXT * 4)[:PROMPT_LEN]
    return np.random.default_rng(1).integers(0, eng.model_cfg.vocab_size - 1, PROMPT_LEN).tolist()


# The built-in model's prompt: the text the documented figures were measured on (the
# docstring kv_dtype_error.py had then), kept word for word so the figures stay comparable.
PROMPT_TEXT = """What an f16 or q8 KV cache costs against f32: the same sequence decoded with each.

    python benchmarks/kv_dtype_error.py [--steps 64] [--json]

For each model (a random one from colibri_core.testing and the built-in one), the f32
cache decodes `steps` greedy tokens after a fixed 128-token prompt, with int8 activations
(the default) and with float activations (the C pipeline's float tiles, where no
int8 rounding of the attention's output hides the cache's own error); the f16 and q8 caches are then
fed the same tokens (teacher forcing), so every step compares logits of the same
context. Reported per storage type: the largest relative logit error over the steps
(max |l - l_f32| / max |l_f32| of a step), its median, the share of steps whose greedy
token equals f32's, and the first step at which a free-running greedy decode with that
cache leaves f32's tokens (None: never within `steps`). tests/test_kvcache.py holds
floors on these figures; docs/BENCHMARKS.md quotes them.
"""
