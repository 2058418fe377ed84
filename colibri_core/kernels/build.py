"""cffi build script (API mode, out-of-line) of `colibri_core._colibri_kernels`.

Used by setup.py (`cffi_modules`) and runnable directly for a development build:
`python colibri_core/kernels/build.py` puts `_colibri_kernels*.so` into colibri_core

SIMD code is chosen at run time (AVX2+FMA, AVX-512 VNNI and the aarch64 dot-product
functions carry target attributes), so the build never uses -march=native and the
extension runs on any x86-64 / aarch64 CPU.

`kernel_flags()` is the one list of compiler flags: this build and the aarch64 test driver
(tests/c/ck_neon_driver.c, built by tests/test_neon_emulated.py with a cross compiler)
both take them from there, so the kernels that are tested are compiled as the shipped
ones. `python colibri_core/kernels/build.py --cflags aarch64` prints them.
"""
from __future__ import annotations

import glob
import os
import sysconfig

from cffi import FFI

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KDIR = "colibri_core/kernels/c"  # relative to the repo root, as setuptools wants

_CDEF_BEGIN, _CDEF_END = "/* cdef begin */", "/* cdef end */"


def public_declarations() -> str:
    """The declarations of kernels/c/ck.h between its cdef markers are the cdef: one source
    of truth for the C API (ck_internal.h holds what only the C sources share)."""
    with open(os.path.join(_REPO, _KDIR, "ck.h")) as f:
        text = f.read()
    return text[text.index(_CDEF_BEGIN) + len(_CDEF_BEGIN):text.index(_CDEF_END)]


CDEF = public_declarations()


def target_machine() -> str:
    """The machine this build compiles for ("x86_64", "aarch64", ...): sysconfig's
    platform, which a cross build sets to the target's."""
    m = sysconfig.get_platform().rsplit("-", 1)[-1].lower()
    return "aarch64" if m == "arm64" else m


def kernel_flags(machine: str | None = None) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of the kernels for `machine` (default: this build's).

    aarch64 adds -ffp-contract=off: GCC otherwise fuses a * b + c in the scalar
    reference into one fmadd (x86-64's baseline has no FMA, so there it never does), and
    the NEON tiles, which reproduce ck_scalar.c's roundings lane by lane, would no longer
    match it bit for bit. Fused multiply-adds stay where a kernel asks for them (vfmaq_f32
    and the x86 FMA intrinsics)."""
    machine = (machine or target_machine()).lower()
    cflags = ["-O3", "-std=gnu11", "-pthread"]     # the threads are ck_pool.c's (no OpenMP)
    if machine in ("aarch64", "arm64"):
        cflags.append("-ffp-contract=off")
    return cflags, ["-pthread"]


def kernel_sources() -> list[str]:
    """The kernel sources compiled into the extension: kernels/c/*.c (absolute paths)."""
    return sorted(glob.glob(os.path.join(_REPO, _KDIR, "*.c")))


def _build_ffi(absolute: bool = False) -> FFI:
    kdir = os.path.join(_REPO, _KDIR) if absolute else _KDIR
    sources = kernel_sources()
    cflags, ldflags = kernel_flags()
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "colibri_core._colibri_kernels",
        '#include "ck.h"',
        sources=[os.path.join(kdir, os.path.basename(p)) for p in sources],
        include_dirs=[kdir],
        depends=[os.path.join(kdir, os.path.basename(h))
                 for h in sorted(glob.glob(os.path.join(_REPO, _KDIR, "*.h")))],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )
    return ffi


ffibuilder = _build_ffi()

if __name__ == "__main__":
    # Build in build/cffi-dev (cffi runs setuptools there, away from the repo's
    # pyproject.toml), then copy the extension next to colibri_core/__init__.py under the
    # name `pip install -e .` gives it (cffi compiles against the limited API unless
    # Python is a debug build), removing other builds that could shadow it.
    import shutil
    import sys

    if sys.argv[1:2] == ["--cflags"]:   # --cflags [MACHINE]: the compile flags, one line
        print(" ".join(kernel_flags(sys.argv[2] if len(sys.argv) > 2 else None)[0]))
        sys.exit(0)
    tmp = os.path.join(_REPO, "build", "cffi-dev")
    so = _build_ffi(absolute=True).compile(tmpdir=tmp, verbose=False)
    pkg = os.path.join(_REPO, "colibri_core")
    abi3 = not hasattr(sys, "gettotalrefcount") and not sysconfig.get_config_var("Py_GIL_DISABLED")
    dest = os.path.join(pkg, "_colibri_kernels.abi3.so" if abi3 and so.endswith(".so")
                        else os.path.basename(so))
    shutil.copyfile(so, dest + ".tmp")
    os.replace(dest + ".tmp", dest)  # atomic: a running process keeps its mapping
    for old in glob.glob(os.path.join(pkg, "_colibri_kernels*.so")):
        if old != dest:
            os.remove(old)
    print(dest)
