"""The NEON backend, executed: tests/c/ck_neon_driver.c and ck_neon_api.c (C only, no
Python on the target) compiled with the kernel sources by Debian's aarch64 cross compiler,
with the flags the package's own build uses (kernels/build.py's kernel_flags("aarch64"):
-ffp-contract=off is among them), and run under qemu-aarch64 user emulation twice: `-cpu
cortex-a53` (no dot-product instructions: the plain NEON tables run) and `-cpu max` (sdot).
The driver compares every NEON kernel with the scalar reference in the same binary and
prints one line per kernel; the tolerances are in the driver and docs/ARCHITECTURE.md.

Needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user (.ci/run installs them).
Where CI is set, a missing one fails the test; elsewhere the test skips, saying which.
By hand: `python -m pytest tests/test_neon_emulated.py -v -s` (prints the reports).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KDIR = ROOT / "colibri_core" / "kernels" / "c"
DRIVER = ROOT / "tests" / "c" / "ck_neon_driver.c"
DRIVER_SOURCES = sorted((ROOT / "tests" / "c").glob("*.c"))   # the driver and ck_neon_api.c
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
PACKAGES = "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"

# what every run must report, and how: exact (bit for bit the scalar results) or within
# the driver's tolerance
EXACT = {"act_quant", "q4_i8", "q8_i8", "q6_i8", "mx_i8", "matmul_int8", "expert_ffn_int8",
         "step_experts_head"}
TOLERANT = {"q4_f32", "q8_f32", "exp", "softmax", "attn", "matmul_float", "expert_ffn_float",
            "attention_decode", "step_attention", "step_float"}
LINE = re.compile(r"^KERNEL (\S+) (\S+) (PASS|FAIL|SKIP) cases=(\d+) (.*)$")


def build_script():
    """This checkout's colibri_core/kernels/build.py (the flags and the source list)."""
    spec = importlib.util.spec_from_file_location("_ck_build_under_test",
                                                  ROOT / "colibri_core" / "kernels" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_list_of_flags():
    """The extension and the driver are compiled with kernel_flags(); aarch64 adds
    -ffp-contract=off, x86-64 keeps its flags."""
    b = build_script()
    assert "-ffp-contract=off" in b.kernel_flags("aarch64")[0]
    assert b.kernel_flags("x86_64") == (["-O3", "-std=gnu11", "-pthread"], ["-pthread"])
    kwds = b.ffibuilder._assigned_source[3]          # what cffi will compile with
    assert (kwds["extra_compile_args"], kwds["extra_link_args"]) == b.kernel_flags()
    r = subprocess.run([sys.executable, str(ROOT / "colibri_core" / "kernels" / "build.py"), "--cflags",
                        "aarch64"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == b.kernel_flags("aarch64")[0], r.stderr


def test_driver_is_not_in_the_extension():
    sources = [Path(p) for p in build_script().kernel_sources()]
    assert DRIVER.is_file() and DRIVER not in sources
    assert DRIVER in DRIVER_SOURCES and not set(DRIVER_SOURCES) & set(sources)
    assert {p.name for p in sources} >= {"ck_scalar.c", "ck_neon.c", "ck_core.c"}
    assert not any(re.search(r"\bint\s+main\s*\(", p.read_text()) for p in sources)


def tools() -> tuple[str, str]:
    cc, qemu, missing = shutil.which(CC), shutil.which(QEMU), []
    if cc is None:
        missing.append(CC)
    else:   # the cross C library: gcc prints a bare name when it cannot find the file
        libc = subprocess.run([cc, "-print-file-name=libc.a"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
        if not os.path.isabs(libc):
            missing.append("the aarch64 C library")
    if qemu is None:
        missing.append(QEMU)
    if missing:
        why = f"{', '.join(missing)} not installed (apt-get install -y {PACKAGES})"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the emulated NEON test")
        pytest.skip(why)
    return cc, qemu


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> tuple[str, Path]:
    cc, qemu = tools()
    b = build_script()
    cflags, ldflags = b.kernel_flags("aarch64")
    exe = tmp_path_factory.mktemp("neon") / "ck_neon_driver"
    cmd = [cc, *cflags, "-Wall", "-static", f"-I{KDIR}", *map(str, DRIVER_SOURCES), *b.kernel_sources(),
           "-o", str(exe), "-lm", *ldflags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    return qemu, exe


@pytest.mark.parametrize("cpu,dotprod", [("cortex-a53", 0), ("max", 1)])
def test_neon_kernels_under_qemu(driver, cpu, dotprod):
    qemu, exe = driver
    t0 = time.monotonic()
    r = subprocess.run([qemu, "-cpu", cpu, str(exe)], capture_output=True, text=True,
                       timeout=600)
    took = time.monotonic() - t0
    print(f"\n--- qemu-aarch64 -cpu {cpu} ({took:.1f} s) ---\n{r.stdout}{r.stderr}")
    assert r.returncode == 0, f"-cpu {cpu}: exit status {r.returncode}\n{r.stdout}\n{r.stderr}"
    summary = re.search(r"^SUMMARY dotprod=(\d) selected=(\w+) kernels=(\d+) failures=(\d+)",
                        r.stdout, re.M)
    assert summary, r.stdout
    assert summary.group(1, 2, 4) == (str(dotprod), "sdot" if dotprod else "plain", "0")
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    for line in r.stdout.splitlines():
        if m := LINE.match(line):
            kernel, variant, status, cases, rest = m.groups()
            seen[kernel, variant] = (status, rest)
            if status != "SKIP":
                assert status == "PASS" and int(cases) > 0, line
                assert (rest == "exact") == (kernel in EXACT), line
    assert {k for k, _ in seen} == EXACT | TOLERANT
    for kernel in ("q4_i8", "q8_i8", "q6_i8", "mx_i8"):  # both int8 variants, sdot where it exists
        assert seen[kernel, "plain"][0] == "PASS"
        assert seen[kernel, "sdot"][0] == ("PASS" if dotprod else "SKIP")
    api = "api-sdot" if dotprod else "api-plain"
    assert all(seen[k, api][0] == "PASS" for k in ("matmul_int8", "step_experts_head", "step_float"))
