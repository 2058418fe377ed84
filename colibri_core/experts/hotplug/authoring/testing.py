"""Test experts: a small C expert with switchable faults, compiled on demand.

Used by tests/test_hotplug*.py and benchmarks/speed/bench_hotplug.py, and handy to try the
hot-plug folder by hand. `compile_test_expert(out, fault="segv")` builds an expert whose
ffn_forward segfaults; the other faults are listed in FAULTS.

The healthy expert computes y = scale * tanh(x) row by row, so two versions built with
different `scale` are told apart by their output.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .builder import c_bytes, compile_shared
from ..meta import FLAG_PORTABLE, FLAG_THREAD_SAFE

FAULTS = {
    "none": 0,
    "segv": 1,        # writes through a null pointer on every call
    "hang": 2,        # never returns
    "nan": 3,         # returns NaN outputs
    "rc": 4,          # returns 7
    "partial": 5,     # writes only the first row of y
    "crash_on_magic": 6,  # segfaults when x[0][0] == MAGIC_INPUT, healthy otherwise
    "abort_on_load": 7,   # a constructor that aborts when the library is loaded
    "shrink_shm": 8,      # computes y, then ftruncates every memfd it can reach to 0 bytes
                          # (the isolated helper's shared buffer); returns 9 if one shrank
    "fork_hang": 9,       # forks a child that sleeps forever, writes its pid to
                          # ./fork_hang.pid (the probe's cwd), then never returns
}
MAGIC_INPUT = 12345.0

TEST_EXPERT_C = r"""
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "colibri_expert.h"

#ifndef ABI
#define ABI COLIBRI_EXPERT_ABI_VERSION
#endif
#ifndef BASE_MODEL
#define BASE_MODEL {0}
#endif

const colibri_expert_meta_t colibri_expert_meta = {
    .magic = COLIBRI_EXPERT_MAGIC,
    .abi_version = ABI,
    .struct_size = sizeof(colibri_expert_meta_t),
    .flags = FLAGS,
    .hidden_size = HIDDEN,
    .n_layers = 1,
    .layers = {LAYER},
    .router_bias = 0.5f,
    .name = EXPERT_NAME,
    .version = EXPERT_VERSION,
    .target = EXPERT_TARGET,
    .base_model = BASE_MODEL,
};

COLIBRI_EXPORT const float colibri_router_row[HIDDEN] = {[0] = 1.0f, [HIDDEN - 1] = -1.0f};

#if FAULT == 7
__attribute__((constructor)) static void on_load(void) { abort(); }
#endif
#if FAULT == 1 || FAULT == 6
static int *volatile null_ptr;      /* read at run time: the store is not optimized away */
#endif
#if FAULT == 8
static int shrink_memfds(void)      /* 1 if a memfd of this process could be shrunk */
{
    int shrank = 0;
    for (int fd = 3; fd < 1024; fd++) {
        char link[64], target[256];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n <= 0)
            continue;
        target[n] = 0;
        if (strncmp(target, "/memfd:", 7) == 0 && ftruncate(fd, 0) == 0)
            shrank = 1;
    }
    return shrank;
}
#endif

int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    if (hidden != HIDDEN || n_tokens < 1)
        return 1;
#if FAULT == 1
    *null_ptr = 1;
#elif FAULT == 2
    for (;;)
        pause();
#elif FAULT == 4
    return 7;
#elif FAULT == 6
    if (x[0] == MAGIC_INPUT)
        *null_ptr = 1;
#elif FAULT == 9
    pid_t child = fork();
    if (child == 0)
        for (;;)
            pause();
    FILE *f = fopen("fork_hang.pid", "w");
    if (f) {
        fprintf(f, "%d\n", (int)child);
        fclose(f);
    }
    for (;;)
        pause();
#endif
    int rows = FAULT == 5 ? 1 : n_tokens;
    for (long i = 0; i < (long)rows * hidden; i++)
        y[i] = FAULT == 3 ? NAN : (float)(SCALE) * tanhf(x[i]);
#if FAULT == 8
    if (shrink_memfds())
        return 9;
#endif
    return 0;
}
"""


def compile_test_expert(out_so: str | os.PathLike, *, hidden: int = 64, layer: int = 1,
                        name: str = "test_expert", version: str = "1.0",
                        fault: str = "none", scale: float = 1.0, abi: int | None = None,
                        thread_safe: bool = True, base_model: str | None = None,
                        cc: str = "gcc", cflags: tuple[str, ...] = ("-O2",)) -> Path:
    """Compile the test expert to `out_so` (atomically) and return its path.

    `base_model` (hex fingerprint) binds it to a model; without one it is portable (its
    y = scale * tanh(x) means the same in any model), except with `abi=1` (unbound)."""
    portable = base_model is None and (abi is None or abi >= 2)
    defines = {"HIDDEN": hidden, "LAYER": layer, "FAULT": FAULTS[fault],
               "SCALE": f"{float(scale)!r}f", "MAGIC_INPUT": f"{MAGIC_INPUT!r}f",
               "FLAGS": (FLAG_THREAD_SAFE if thread_safe else 0)
               | (FLAG_PORTABLE if portable else 0),
               "EXPERT_NAME": f'"{name}"', "EXPERT_VERSION": f'"{version}"'}
    if abi is not None:
        defines["ABI"] = f"{abi}u"
    if base_model is not None:
        defines["BASE_MODEL"] = c_bytes(base_model)
    with tempfile.TemporaryDirectory(prefix="colibri-test-expert-") as d:
        src = Path(d) / "test_expert.c"
        src.write_text(TEST_EXPERT_C)
        compile_shared([src], out_so, cc=cc, cflags=cflags, defines=defines)
    return Path(out_so)
