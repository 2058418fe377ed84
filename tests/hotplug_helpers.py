"""Shared pieces of the hot-plug rule tests (tests/test_hotplug_rules.py): an event
recorder, a manager factory, safe drops, waits with long deadlines (never a timed
assertion)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from colibri_core.hotplug.testing import compile_test_expert

H = 64
FIRST_SLOT = 16
SETTLE = 0.05
DEADLINE = 20.0          # every wait: a deadline, never a duration that must hold


class Events:
    def __init__(self):
        self.items: list[tuple[str, dict]] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, info: dict) -> None:
        with self._lock:
            self.items.append((kind, info))

    def of(self, kind: str) -> list[dict]:
        with self._lock:
            return [i for k, i in self.items if k == kind]

    def rejected(self, path) -> list[dict]:
        return [i for i in self.of("rejected") if i["path"] == str(path)]


def manager_args(folder, state_dir, events, **kw) -> dict:
    args = dict(experts_dir=folder, hidden_size=H, moe_layers={1, 3}, first_slot=FIRST_SLOT,
                state_dir=state_dir, settle_s=SETTLE, probe_timeout_s=5.0, on_event=events)
    args.update(kw)
    return args


def drop(folder: Path, filename: str, **kw) -> Path:
    """Build a test expert in a scratch folder, then rename it into the watched one."""
    scratch = folder.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    kw.setdefault("hidden", H)
    tmp = compile_test_expert(scratch / f"{filename}.{time.monotonic_ns()}", **kw)
    os.replace(tmp, folder / filename)
    return folder / filename


def drop_bytes(folder: Path, filename: str, data: bytes, mode: int = 0o644) -> Path:
    scratch = folder.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    tmp = scratch / f"{filename}.{time.monotonic_ns()}"
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, folder / filename)
    return folder / filename


def wait_for(pred, what: str, timeout: float = DEADLINE):
    """Poll `pred` until it returns something truthy; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s: {what}")


def drain_until(mgr, n: int, timeout: float = DEADLINE) -> list:
    """drain() like the engine's token loop until `n` changes came out."""
    out: list = []

    def step():
        out.extend(mgr.drain())
        return len(out) >= n
    wait_for(step, f"{n} changes (got {[(c.kind, c.expert.name) for c in out]})", timeout)
    return out


def output_scale(expert) -> float:
    x = np.full((1, H), 0.5, np.float32)
    y = np.empty_like(x)
    expert.forward(x, y)
    return float(y[0, 1] / np.tanh(0.5))
