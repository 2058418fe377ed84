"""Model files truncated while mapped, and the isolated helper's shared buffer: no SIGBUS
may kill the engine (docs/ROBUSTNESS.md, "Files truncated while mapped"; docs/HOTPLUG.md,
"Isolation").

Every case that could die of SIGBUS runs in a subprocess (10 s cap), so a regression fails
the test instead of killing pytest. A truncation mid-generation must end the request with
ModelFileDamaged naming the file, the process must go on (exit 0, not -SIGBUS), later
requests on that model must fail the same way, and a fresh engine on an intact copy must
work. A SIGBUS outside the engine's mappings must still reach the previous handler.
"""
from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colibri_core.config import builtin_model_dir
from colibri_core.runtime.scheduler import AHEAD

REPO = Path(__file__).resolve().parent.parent
BUILTIN = builtin_model_dir()
TIMEOUT = 10


def no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # the cases meant to die of SIGBUS


def run_py(script: str, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd="/",
                          preexec_fn=no_core_dump)


def result_of(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def two_copies(tmp_path):
    """(a copy to damage, an intact copy) of the built-in model."""
    return (Path(shutil.copytree(BUILTIN, tmp_path / "victim")),
            Path(shutil.copytree(BUILTIN, tmp_path / "intact")))


# ----------------------------------------------------------------------------- the engine

GENERATE = """
import json, os, sys
from colibri_core.engine import Engine
from colibri_core.errors import ModelFileDamaged

victim, name, intact, settings, top_k = sys.argv[1:]
settings, top_k = json.loads(settings), int(top_k)
eng = Engine.from_model_dir(victim, threads=1, **settings)
out = {"tokens": 0, "first": None, "later": None}
try:
    for ev in eng.generate("The assert statement", max_new_tokens=40, temperature=0,
                           experts_per_token=top_k):
        out["tokens"] += 1
        if out["tokens"] == 3:                        # mid-generation, after 3 tokens
            os.truncate(os.path.join(victim, name), 4096)
except ModelFileDamaged as e:
    out["first"], out["first_type"] = str(e), type(e).__name__
try:                                                  # a later request on the same model
    eng.generate("Hello", max_new_tokens=4, experts_per_token=top_k).run()
except ModelFileDamaged as e:
    out["later"] = str(e)
eng.close()
with Engine.from_model_dir(intact, threads=1, **settings) as fresh:
    out["fresh"] = len(fresh.generate("The assert statement", max_new_tokens=8,
                                      temperature=0, experts_per_token=top_k).run().token_ids)
print(json.dumps(out))
"""


@pytest.mark.parametrize("name, settings", [
    ("model.bin", {}),
    ("expert_1_3.bin", {}),
    ("model.bin", {"max_resident_mb": 16}),          # a budget holding every expert
    ("expert_2_5.bin", {"max_resident_mb": 16}),
    ("expert_1_3.bin", {"max_resident_mb": 6.7}),     # ~11 experts cached: reloaded, EFAULT
], ids=["model-mmap", "expert-mmap", "model-budget", "expert-budget", "expert-tight-budget"])
def test_truncated_while_generating_fails_the_request_not_the_process(two_copies, name,
                                                                      settings):
    victim, intact = two_copies
    # top_k 8 = every expert of the built-in model on every token: the truncated expert
    # is read at the next step whatever the router picks
    got = result_of(run_py(GENERATE, victim, name, intact, json.dumps(settings), 8))
    path = str(victim / name)
    # the step after the truncation fails; tokens computed before it (a stream runs up
    # to scheduler.AHEAD tokens ahead of its reader) are still delivered
    assert 3 <= got["tokens"] <= 3 + AHEAD, got
    assert got["first_type"] == "ModelFileDamaged"
    assert got["first"].startswith(f"{path}: the file was truncated"), got
    assert "--verify" in got["first"] and "\n" not in got["first"]
    assert got["later"] == got["first"]                # the same error until reloaded
    assert got["fresh"] == 8                           # an intact copy serves normally


def test_cli_run_prints_one_error_line_and_exits_2(two_copies, tmp_path):
    victim, _ = two_copies
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "truncate_at_step_2.py").write_text(textwrap.dedent("""
        import os
        from colibri_core.hookspecs import hookimpl

        @hookimpl
        def colibri_token(step):
            if step == 2:          # another program truncating the file, mid-generation
                os.truncate(os.environ["VICTIM"], 4096)
    """))
    env = dict(os.environ, VICTIM=str(victim / "model.bin"))
    p = subprocess.run([sys.executable, "-m", "colibri_core", "run", "--model", str(victim),
                        "--plugins-dir", str(plugins), "-n", "30", "--temperature", "0",
                        "--threads", "1", "--prompt", "The assert statement"],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd="/")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("colibri: error:")]
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert errors == [f"colibri: error: {victim / 'model.bin'}: the file was truncated "
                      f"while the model was using it; restore or re-convert it (`colibri "
                      f"inspect {victim} --verify` names the damaged files), then reload "
                      f"the model"], p.stderr
    assert "Traceback" not in p.stderr
    # and the check it points to names the file
    p = subprocess.run([sys.executable, "-m", "colibri_core", "inspect", str(victim),
                        "--verify"], capture_output=True, text=True, timeout=TIMEOUT, cwd="/")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"{victim / 'model.bin'}: size 4096 bytes" in p.stdout + p.stderr


# ----------------------------------------------------------------------------- the guard itself

UNITS = """
import json, os, sys, threading
import numpy as np
from colibri_core.kernels import mapguard
from colibri_core.errors import ModelFileDamaged
from colibri_core.experts.expertio import populate as _populate
from colibri_core.format.modelfile import ContainerFile

d = sys.argv[1]
out = {}
check = None

def truncated(name):
    f = ContainerFile(os.path.join(d, name))
    os.truncate(f.path, 4096)
    return f

# numpy reading past the new end, on the main thread: zeros, the file marked damaged
f = truncated("model.bin")
check = mapguard.FileCheck([f])
out["main_read"] = int(f.buf[-4096:].sum())
out["main_damaged"] = f.damaged
try:
    check.check()
except ModelFileDamaged as e:
    out["check"] = str(e)
f.close()
out["after_close"] = f.damaged                      # remembered after the unmap

# the same from another thread (no alternate signal stack there)
f = truncated("expert_1_0.bin")
t = threading.Thread(target=lambda: out.__setitem__("thread_read", int(f.buf[-1])))
t.start(); t.join()
out["thread_damaged"] = f.damaged
f.close()

# the budget's expert load (MADV_POPULATE_READ) reports EFAULT instead of faulting
f = truncated("expert_1_1.bin")
try:
    _populate(f)
except ModelFileDamaged as e:
    out["populate"] = str(e)
out["populate_damaged"] = f.damaged
f.close()

# an intact file next to them: its check passes although the counter moved
ok = ContainerFile(os.path.join(d, "expert_1_2.bin"))
mapguard.FileCheck([ok]).check()
out["intact_sum"] = int(ok.buf.sum()) > 0
ok.close()
print(json.dumps(out))
"""


def test_numpy_reads_threads_and_expert_loads_are_covered(two_copies):
    victim, _ = two_copies
    got = result_of(run_py(UNITS, victim))
    assert got["main_read"] == 0 and got["main_damaged"] and got["after_close"]
    assert got["check"].startswith(f"{victim / 'model.bin'}: the file was truncated")
    assert got["thread_read"] == 0 and got["thread_damaged"]
    assert got["populate"].startswith(f"{victim / 'expert_1_1.bin'}: the file was truncated")
    assert got["populate_damaged"] and got["intact_sum"]


ELSEWHERE = """
import faulthandler, mmap, os, sys
if sys.argv[2] == "faulthandler":
    faulthandler.enable()
from colibri_core.engine import Engine
eng = Engine.from_model_dir(sys.argv[1], threads=1)      # the guard is installed now
eng.generate("The", max_new_tokens=2).run()
path = os.path.join(sys.argv[1], "not-a-model-file")
with open(path, "wb") as fh:
    fh.write(b"x" * 3 * mmap.PAGESIZE)
fd = os.open(path, os.O_RDONLY)
m = mmap.mmap(fd, 3 * mmap.PAGESIZE, prot=mmap.PROT_READ)   # not registered
os.truncate(path, 0)
print("reading", flush=True)
m[2 * mmap.PAGESIZE]
print("survived", flush=True)
"""


@pytest.mark.parametrize("before", ["faulthandler", "default"])
def test_a_fault_outside_the_model_reaches_the_previous_handler(tmp_path, before):
    d = Path(shutil.copytree(BUILTIN, tmp_path / "m"))
    p = run_py(ELSEWHERE, d, before)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr)
    assert "reading" in p.stdout and "survived" not in p.stdout
    if before == "faulthandler":
        assert "Fatal Python error: Bus error" in p.stderr, p.stderr


# ----------------------------------------------------------------------------- isolated experts

ISOLATED = """
import json, sys
import numpy as np
from colibri_core.experts.hotplug.isolated import IsolatedRunner
r = IsolatedRunner(sys.argv[1], 64, capacity=4, call_timeout_s=5.0)
x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
out = []
for _ in range(2):                     # the second call writes x again: no SIGBUS either
    y = np.zeros_like(x)
    out.append([r.forward(x, y), bool(np.allclose(y, np.tanh(x), atol=1e-6))])
print(json.dumps({"calls": out, "alive": r.alive()}))
r.close()
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_isolated_helper_cannot_shrink_the_shared_buffer(tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    so = compile_test_expert(tmp_path / "shrink.isolated.so", hidden=64, fault="shrink_shm")
    got = result_of(run_py(ISOLATED, so))
    # rc 9 would mean a truncation succeeded; the engine's reads and writes survived
    assert got == {"calls": [[0, True], [0, True]], "alive": True}


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux-only")
def test_the_shared_buffer_is_sealed():
    from colibri_core.experts.hotplug.isolated import _sealed_memfd
    fd = _sealed_memfd(8192)
    try:
        assert os.fstat(fd).st_size == 8192
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & want == want
        for size in (0, 4096, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)
