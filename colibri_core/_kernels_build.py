"""cffi build script (API mode, out-of-line) of `colibri_core._colibri_kernels`.

Used by setup.py (`cffi_modules`) and runnable directly for a development build:
`python colibri_core/_kernels_build.py` puts `_colibri_kernels*.so` into colibri_core/.

SIMD code is chosen at run time (AVX2+FMA and AVX-512 VNNI functions carry target
attributes), so the build never uses -march=native and the extension runs on any
x86-64 / aarch64 CPU.
"""
from __future__ import annotations

import glob
import os

from cffi import FFI

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KDIR = "colibri_core/_kernels"  # relative to the repo root, as setuptools wants

_CDEF_BEGIN, _CDEF_END = "/* cdef begin */", "/* cdef end */"


def public_declarations() -> str:
    """The declarations of _kernels/ck.h between its cdef markers are the cdef: one source
    of truth for the C API (ck_internal.h holds what only the C sources share)."""
    with open(os.path.join(_REPO, _KDIR, "ck.h")) as f:
        text = f.read()
    return text[text.index(_CDEF_BEGIN) + len(_CDEF_BEGIN):text.index(_CDEF_END)]


CDEF = public_declarations()


def _build_ffi(absolute: bool = False) -> FFI:
    kdir = os.path.join(_REPO, _KDIR) if absolute else _KDIR
    sources = sorted(glob.glob(os.path.join(_REPO, _KDIR, "*.c")))
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "colibri_core._colibri_kernels",
        '#include "ck.h"',
        sources=[os.path.join(kdir, os.path.basename(p)) for p in sources],
        include_dirs=[kdir],
        depends=[os.path.join(kdir, h) for h in ("ck.h", "ck_internal.h", "ck_tiles.h")],
        extra_compile_args=["-O3", "-fopenmp", "-std=gnu11"],
        extra_link_args=["-fopenmp"],
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
    import sysconfig

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
