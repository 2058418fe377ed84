"""Issue 39, items 4 and 6: every removed hot-plugged expert is released -- the object,
its staged file and its mapping -- after its removal and after close(), and the staged
copy is mapped under the SIGBUS guard (a truncated copy disables that expert only).

Before: after 60 random adds, replaces and removes one removed expert stayed alive (a
local of the hot-plug worker's loop), its staged .so still mapped, until the next release.
"""
from __future__ import annotations

import gc
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colibri_core.config import EngineConfig, HotplugConfig
from colibri_core.engine import Engine
from colibri_core.experts.hotplug.expert import HotExpert

from test_engine_hotplug import Looper, _build

REPO = Path(__file__).resolve().parent.parent


def _count(root: Path) -> tuple[int, int, int]:
    """(HotExpert objects alive, mappings of files under root, descriptors of them)."""
    gc.collect()
    objs = sum(isinstance(o, HotExpert) for o in gc.get_objects())
    with open("/proc/self/maps") as f:
        maps = sum(str(root) in line for line in f)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
        except OSError:
            pass
    return objs, maps, fds


def _settle(eng, pred, what, timeout=20.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        eng.hotplug.wait_idle(5)
        eng.apply_expert_changes()
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("isolation", ["inprocess", "isolated"])
def test_removed_experts_are_released_after_removal_and_close(tiny_model_dir, tmp_path,
                                                              isolation):
    watched, build = tmp_path / "experts", tmp_path / "build"
    watched.mkdir()
    build.mkdir()
    sos = {n: [_build(build, n, str(v), seed=10 * i + v) for v in range(3)]
           for i, n in enumerate(("fraud", "scam"))}
    eng = Engine(tiny_model_dir, EngineConfig(
        experts_dir=str(watched), hotplug=HotplugConfig(settle_s=0.02, isolation=isolation)))
    loop = Looper(eng)
    loop.start()
    pinned = None
    try:
        rng = random.Random(0)
        for _ in range(30 if isolation == "inprocess" else 12):
            name = rng.choice(sorted(sos))
            p = watched / f"{name}.so"
            if p.exists() and rng.random() < 0.4:
                p.unlink()
            else:
                shutil.copy(rng.choice(sos[name]), build / "tmp.so")
                os.replace(build / "tmp.so", p)
            time.sleep(rng.choice([0.0, 0.01, 0.05, 0.2]))
        (watched / "scam.so").unlink(missing_ok=True)
        shutil.copy(sos["fraud"][0], build / "tmp.so")
        os.replace(build / "tmp.so", watched / "fraud.so")
        _settle(eng, lambda: [(e.name, e.version) for e in eng.model.expert_set.hot_experts()]
                == [("fraud", "0")], "only fraud 0 live")
        # a generation that pinned the set with fraud, kept by the caller across close()
        pinned = eng.generate([1, 2, 3], max_new_tokens=50, temperature=0, pin_experts=True)
        next(iter(pinned))
        for n in sos:
            (watched / f"{n}.so").unlink(missing_ok=True)
        _settle(eng, lambda: not eng.model.expert_set.hot_experts(), "all removed")
    finally:
        loop.stop.set()
        loop.join(10)
    assert loop.error is None
    staging = Path(eng.hotplug.staging_dir)
    _settle(eng, lambda: _count(staging)[0] == 1, "removed experts released")
    objs, maps, fds = _count(staging)
    assert objs == 1 and fds == 0     # only fraud, which the pinned generation still uses
    eng.close()
    objs, maps, fds = _count(staging)
    assert fds == 0 and objs <= 1           # released (dlclose); the caller's object stays
    del pinned
    assert _count(staging) == (0, 0, 0)


TRUNCATED = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[3])
    from test_engine_hotplug import _build
    from pathlib import Path
    from colibri_core.config import EngineConfig, HotplugConfig
    from colibri_core.engine import Engine
    model, tmp = Path(sys.argv[1]), Path(sys.argv[2])
    (tmp / "experts").mkdir(); (tmp / "build").mkdir()
    so = _build(tmp / "build", "fraud", "1", seed=1)
    eng = Engine(model, EngineConfig(experts_dir=str(tmp / "experts"),
                                     hotplug=HotplugConfig(settle_s=0.02, isolation=sys.argv[4])))
    os.rename(so, tmp / "experts" / "fraud.so")
    t0 = time.time()
    while not eng.model.expert_set.hot_experts() and time.time() - t0 < 20:
        eng.hotplug.wait_idle(10); eng.apply_expert_changes(); time.sleep(0.02)
    (e,) = eng.model.expert_set.hot_experts()
    before = eng.expert_set_generation
    os.truncate(e.staged_path, 0)                     # the engine's own copy, cut short
    print("row sum", float(e.router_row.sum()))       # reads the lost pages: no SIGBUS
    assert not e.alive
    list(eng.generate([1, 2, 3], max_new_tokens=3, temperature=0))
    eng.apply_expert_changes()
    assert not eng.model.expert_set.hot_experts() and eng.expert_set_generation > before
    print("removed:", [ev for ev in eng.expert_events.recent() if ev.get("reason") == "crashed"] != [])
    print("tokens", len(list(eng.generate([1, 2, 3], max_new_tokens=5, temperature=0))))
    eng.close()
    sys.stdout.flush()
    if sys.argv[4] == "inprocess":
        # the limit (docs/HOTPLUG.md): the library's code pages are the dynamic loader's,
        # unguarded; glibc runs its finalizers from them at exit
        os._exit(0)
""")


@pytest.mark.parametrize("isolation", ["inprocess", "isolated"])
def test_truncated_staged_copy_disables_the_expert_not_the_engine(tiny_model_dir, tmp_path,
                                                                  isolation):
    r = subprocess.run([sys.executable, "-c", TRUNCATED, str(tiny_model_dir), str(tmp_path),
                        str(REPO / "tests"), isolation], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "row sum 0.0" in r.stdout and "tokens 5" in r.stdout, r.stdout


def test_copy_mode_shrunk_expert_is_model_file_damaged(tmp_path):
    """Item 6: in copy mode (budget: experts read into the cache's slots) an expert file
    cut short while the engine runs gives ModelFileDamaged, as in mmap mode (was a plain
    ModelFormatError 'file shrank while reading an expert')."""
    from colibri_core.config import builtin_model_dir
    from colibri_core.errors import ModelFileDamaged
    d = shutil.copytree(builtin_model_dir(), tmp_path / "m")
    eng = Engine.from_model_dir(d, load_mode="copy", max_resident_mb=7)   # < the whole model
    try:
        eng.generate("The ", max_new_tokens=3, temperature=0).run()
        for f in d.glob("expert_*.bin"):
            os.truncate(f, 4096)
        with pytest.raises(ModelFileDamaged) as ei:
            for i in range(8):
                eng.generate(f"Some other prompt {i}", max_new_tokens=20, temperature=0).run()
        assert "truncated while the model was using it" in str(ei.value)
    finally:
        eng.close()


def test_engine_open_close_rss_slope_is_flat():
    """Item 6: benchmarks/robustness/leaks.py --slope: RSS over engine open/close cycles after the
    first fifth grows by well under one engine's objects per cycle (tens of KB; the leak
    found was 36 KB). The benchmark's own target is 1 KB (measured 0.8-0.9 KB on a quiet
    machine, 1.1 KB once in a CI run beside other work), too close to noise for a test."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.robustness.leaks", "--slope",
                        "600", "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    res = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert res["bytes_per_cycle"] <= 8192, res


INSPECT = textwrap.dedent("""
    import os, sys
    from colibri_core import cli
    from colibri_core.format import validate
    real, done = validate.tensor_problems, []
    def cut_then_check(name, t):             # the first file scanned, cut short under it
        if not done:
            done.append(os.truncate(os.path.join(sys.argv[1], "expert_1_0.bin"), 4096))
        return real(name, t)
    validate.tensor_problems = cut_then_check
    sys.exit(cli.main(["inspect", sys.argv[1], "--verify"]))
""")


def test_inspect_verify_maps_under_the_guard(tmp_path):
    """Item 6: `colibri inspect --verify` reading a file truncated under it reports it
    (exit 2) instead of dying of SIGBUS."""
    from colibri_core.config import builtin_model_dir
    d = shutil.copytree(builtin_model_dir(), tmp_path / "m")
    r = subprocess.run([sys.executable, "-c", INSPECT, str(d)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "expert_1_0.bin: truncated while being checked" in r.stdout, r.stdout[-2000:]
