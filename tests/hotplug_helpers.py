"""Shared pieces of the hot-plug tests (tests/test_hotplug_rules.py,
tests/test_hotplug_bundle.py): an event recorder, a manager factory, safe drops, waits
with long deadlines (never a timed assertion), a reference-design expert source, and a built
expert for tiny_model_dir (tiny_model_expert)."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from colibri_core.experts.hotplug import HotplugManager
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert

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


# A reference-design expert: plain C, no Colibri header, exports only ffn_forward.
REFERENCE_C = r"""
#include <math.h>

int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    if (n_tokens < 1 || hidden < 1)
        return 1;
    for (long i = 0; i < (long)n_tokens * hidden; i++)
        y[i] = SCALE * tanhf(x[i]);
    return 0;
}
"""

CRASHING_C = r"""
static int *volatile null_ptr;
int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    (void)x; (void)y; (void)n_tokens; (void)hidden;
    *null_ptr = 1;
    return 0;
}
"""


def reference_so(out: Path, scale: float = 1.0, source: str = REFERENCE_C) -> Path:
    """`gcc -shared -fPIC` of a reference-design source, as its authors build it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(source.replace("SCALE", f"{float(scale)!r}f"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out), str(src), "-lm"],
                   check=True, capture_output=True, timeout=120)
    os.chmod(out, 0o644)
    src.unlink()
    return out


def write_bundle(where: Path, name: str = "expert_32", version: str = "1.0",
                 layers=(1,), router_bias: float | None = 0.25, hidden: int = H,
                 scale: float = 1.0, toml: str | None = None, row=None,
                 so_name: str = "expert_32.so", source: str = REFERENCE_C) -> Path:
    """A bundle folder `where` (e.g. scratch/expert_32.expert): .so + expert.toml + row."""
    where.mkdir(parents=True, exist_ok=True)
    os.chmod(where, 0o755)
    reference_so(where / so_name, scale, source)
    if toml is None:
        toml = (f'name = "{name}"\nversion = "{version}"\n'
                f"layers = [{', '.join(map(str, layers))}]\n")
        if router_bias is not None:
            toml += f"router_bias = {router_bias!r}\n"
    (where / "expert.toml").write_text(toml)
    if row is None:
        row = np.zeros(hidden, np.float32)
        row[0], row[-1] = 1.0, -1.0
    np.save(where / "router_row.npy", row)
    for p in where.iterdir():
        os.chmod(p, 0o644)
    return where


# ---------------------------------------------------------------- fixtures (imported by tests)
@pytest.fixture
def folder(tmp_path):
    """The watched folder, with safe permissions."""
    d = tmp_path / "experts_so"
    d.mkdir()
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def make_manager(tmp_path, folder):
    """make(**settings) -> (a started-on-demand HotplugManager on `folder`, its Events);
    every manager made is closed at the end of the test."""
    made = []

    def make(**kw):
        events = Events()
        mgr = HotplugManager(**manager_args(folder, tmp_path / "state", events, **kw))
        made.append(mgr)
        return mgr, events
    yield make
    for m in made:
        m.close()


TINY_H = 128             # tiny_model_dir's hidden size (MoE layers 1 and 2, 4 experts)


def tiny_model_expert(tmp_path: Path, name: str, seed: int, bias: float = 0.0) -> Path:
    """A built q4 expert `name` for tiny_model_dir's layer 1 (random weights from `seed`,
    intermediate 64, router row 0 and bias `bias`: 50 has every token choose it)."""
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    rng = np.random.default_rng(seed)
    npz, h, i = tmp_path / f"{name}.npz", TINY_H, 64
    np.savez(npz, w1=rng.standard_normal((i, h)) / np.sqrt(h),
             w3=rng.standard_normal((i, h)) / np.sqrt(h),
             w2=rng.standard_normal((h, i)) / np.sqrt(i), router_row=np.zeros(h, np.float32),
             router_bias=np.float32(bias))
    so = tmp_path / f"{name}.so"
    build_expert(npz, so, layer=1, name=name, version="1", portable=True)
    return so
