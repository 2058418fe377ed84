"""Adaptive k (plugins/adaptive_k.py) against fixed k on the built-in model: what
benchmarks/accuracy/bench_adaptive_k.py reports and tests/test_builtin_plugins.py holds a
floor on."""
from __future__ import annotations

import time

import numpy as np


def kl(p_logits, q_logits):
    p = np.exp(p_logits - p_logits.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
    q = np.exp(q_logits - q_logits.max(1, keepdims=True)); q /= q.sum(1, keepdims=True)
    return float(np.mean(np.sum(p * (np.log(p + 1e-12) - np.log(q + 1e-12)), axis=1)))


def measure(tokens: int = 512, chunk: int = 128, ps=(0.5, 0.6, 0.7, 0.8, 0.9)) -> list[dict]:
    """One row per setting: experts per token, prefill tokens/s, KL from the default k."""
    import pydoc_data.topics as topics
    from colibri_core.builtin_plugins.adaptive_k import AdaptiveK
    from colibri_core.engine import Engine

    text = "".join(topics.topics[k] for k in sorted(topics.topics)[-20:])
    eng = Engine.from_config("builtin")
    ids = eng.encode(text)[:tokens]
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    E = eng.model_cfg.num_experts

    def run(k, plugin=None):
        if plugin is not None:
            eng.register_plugin(plugin, name="adaptive")
        t0 = time.perf_counter()
        logits, used = [], []
        for c in chunks:
            logits.append(eng.next_token_logits(c, experts_per_token=k, all_positions=True))
            used += [float((t.routing.ids >= 0).sum(1).mean()) for t in eng.model.last_routing]
        dt = time.perf_counter() - t0
        if plugin is not None:
            eng.pm.unregister(name="adaptive")
        return np.concatenate(logits), float(np.mean(used)), len(ids) / dt

    ref, _, _ = run(eng.model_cfg.top_k)
    rows = []
    for label, k, plug in ([(f"fixed k={k}", k, None) for k in (1, 2, 3, 4)]
                           + [(f"adaptive p={p}", E, AdaptiveK(p=p, k_min=1, k_max=4))
                              for p in ps]):
        lg, used, tps = run(k, plug)
        rows.append({"setting": label, "experts_per_token": round(used, 2),
                     "tokens_per_s": round(tps, 1), "kl_vs_default": round(kl(ref, lg), 4)})
    eng.close()
    return rows
