"""cffi build script (API mode, out-of-line) of `colibri_core._colibri_kernels`.

Used by setup.py (`cffi_modules`) and runnable directly for a development build:
`python colibri_core/_kernels_build.py` puts `_colibri_kernels*.so` into colibri_core/.

SIMD code is chosen at run time (AVX2+FMA functions carry target attributes), so the
build never uses -march=native and the extension runs on any x86-64 / aarch64 CPU.
"""
from __future__ import annotations

import glob
import os

from cffi import FFI

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KDIR = "colibri_core/_kernels"  # relative to the repo root, as setuptools wants

# Mirror of the public part of _kernels/ck.h.
CDEF = """
void ck_init(void);
int ck_backend(void);
int ck_backend_available(int b);
int ck_set_backend(int b);
void ck_set_threads(int n);
void ck_set_par_min_work(int64_t w);
int ck_get_threads(void);
uint64_t ck_rdtsc(void);
const char *ck_cycle_counter_name(void);
void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum);
int ck_q4_matmul(const uint8_t *wd, const float *ws, const uint8_t *wz,
                 int64_t rows, int64_t cols, int64_t group,
                 const float *x, int64_t n, float *out, int act_int8,
                 int8_t *xq, float *xs, int32_t *xsum);
int ck_q8_matmul(const int8_t *wd, const float *ws,
                 int64_t rows, int64_t cols, int64_t group,
                 const float *x, int64_t n, float *out, int act_int8,
                 int8_t *xq, float *xs, int32_t *xsum);
int ck_expert_ffn(const uint8_t *w1d, const float *w1s, const uint8_t *w1z,
                  const uint8_t *w3d, const float *w3s, const uint8_t *w3z, int64_t g13,
                  const uint8_t *w2d, const float *w2s, const uint8_t *w2z, int64_t g2,
                  int64_t hidden, int64_t inter,
                  const float *x, int64_t n, float *out, const float *rw,
                  int accumulate, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum,
                  float *h, int8_t *hq, float *hs, int32_t *hsum);
int ck_attention_decode(const float *q, int64_t nh, int64_t d, const float *k, const float *v,
                        int64_t nkv, int64_t len, float scale, float *out, float *scores);
"""


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
        depends=[os.path.join(kdir, "ck.h")],
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
