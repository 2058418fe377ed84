"""Helpers shared by the plugin tests: the engine's hook arguments (ENGINE_CALLS, one
realistic call per hook), the tracer's line formats, reading a pipe."""
from __future__ import annotations

import os
import re

import numpy as np

ROUTING_RE = re.compile(r"\[ROUTING\] layer=\d+, top_k=\[\d+(,\d+)*\], scores=\[-?\d+\.\d{3}(,-?\d+\.\d{3})*\]")
MEMORY_RE = re.compile(r"\[MEMORY\] expert_\d+_\d+ @ 0x[0-9a-f]+ \(size=\d+\)")
TIME_RE = re.compile(r"\[TIME\] expert_\d+_\d+ FFN: \d+ cycles \(≈\d+\.\dus @ \d+\.\d\dGHz\)")


def read_lines(fd: int) -> list[str]:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode("utf-8").splitlines()


def short(name: str) -> str:
    return name[len("colibri_") :]


rng = np.random.default_rng(0)
LOGITS = rng.standard_normal((3, 8)).astype(np.float32)  # [N=3, E=8]
PROBS = np.exp(LOGITS) / np.exp(LOGITS).sum(1, keepdims=True)
IDS = np.argsort(-LOGITS, axis=1)[:, :2]  # [N, k=2]
SCORES = np.take_along_axis(PROBS, IDS, 1)
WEIGHTS = SCORES / SCORES.sum(1, keepdims=True)
HIDDEN = np.ones((3, 4), np.float32)
INFO = {"path": "experts_so/fraud.so", "layer": 1, "expert": 8, "expert_set_generation": 2,
        "expert_set_id": "ab" * 32}

# hook -> (keyword arguments the engine passes, what the Recorder's call returns)
ENGINE_CALLS = {
    "colibri_engine_start": (dict(engine="ENGINE"), []),
    "colibri_engine_stop": (dict(engine="ENGINE"), []),
    "colibri_choose_k": (dict(prompt_tokens=5, request={}, default_k=2), 1),
    "colibri_request_start": (dict(request_id="r1", prompt_tokens=5, k=2), []),
    "colibri_request_end": (dict(request_id="r1", n_tokens=3, stop_reason="eos"), []),
    "colibri_before_layer": (dict(layer=1, hidden=HIDDEN), []),
    "colibri_choose_k_token": (dict(layer=1, probs=PROBS, default_k=2), [2, 2, 2]),
    "colibri_routing": (dict(layer=1, expert_ids=IDS, weights=WEIGHTS, scores=SCORES, logits=LOGITS), None),
    "colibri_expert_prefetch": (dict(layer=1, experts=[(3, 0x7F8A3C000000, 4096)]), []),
    "colibri_expert_timing": (dict(layer=1, expert=3, cycles=1000, seconds=1e-6), []),
    "colibri_after_layer": (dict(layer=1, hidden=HIDDEN), []),
    "colibri_sample": (dict(logits=np.array([0.1, 3.0, -1.0], np.float32), request={}), 1),
    "colibri_token": (dict(request_id="r1", step=0, token_id=7, text="hi", expert_set_generation=2,
                          expert_set_id="ab" * 32), []),
    "colibri_expert_loaded": (dict(info=INFO), []),
    "colibri_expert_rejected": (dict(path="experts_so/bad.so", reason="probe crashed"), []),
    "colibri_expert_unloaded": (dict(info=dict(INFO, reason="deleted")), []),
}
