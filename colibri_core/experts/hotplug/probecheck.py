"""The checks a probe runs on an expert .so, in the probe's own process (probe.py runs
it there: the warm helper's child, or a fresh interpreter): load it with RTLD_NOW and call
ffn_forward on random and edge-case inputs.

Checks, each call on a fresh output buffer filled with NaN and followed by guard values:
- return value 0;
- every output written and finite (a NaN left over means "not written", "accumulated into
  y" or "produced NaN"; all are refusals);
- nothing written past the end of y, input x left unchanged;
- rows independent: row t of a 7-token call equals a 1-token call on row t;
- deterministic: the same call twice gives the same output.
Cases: random N(0,1) rows (n_tokens 1 and 7), zeros, large values (N(0,1) * 100).

Only the standard library and cffi are imported (numpy and watchdog never are).
"""
from __future__ import annotations

import math
import random

LARGE = 100.0
GUARD = 16
GUARD_VALUE = -2.0 ** 100   # exact in float32
RTOL, ATOL = 1e-3, 1e-5
FFN_CDEF = "int ffn_forward(const float *x, float *y, int n_tokens, int hidden);"


class ProbeFailure(Exception):
    pass


def probe(path: str, hidden: int, seed: int = 0, ffi=None) -> dict:
    """Run the checks on `path` in this process; raise ProbeFailure. `ffi`: an FFI with
    FFN_CDEF declared (the helper's, made once), else one is made here."""
    if ffi is None:
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(FFN_CDEF)
    try:
        lib = ffi.dlopen(path, ffi.RTLD_NOW)
        fn = lib.ffn_forward
    except (OSError, AttributeError) as e:
        raise ProbeFailure(f"cannot load: {e}") from None
    rng = random.Random(seed)

    def call(rows: list[list[float]], case: str) -> list[list[float]]:
        n = len(rows)
        flat = [v for r in rows for v in r]
        x = ffi.new("float[]", flat)
        x_before = ffi.unpack(x, n * hidden)
        y = ffi.new("float[]", [math.nan] * (n * hidden) + [GUARD_VALUE] * GUARD)
        rc = fn(x, y, n, hidden)
        if rc != 0:
            raise ProbeFailure(f"ffn_forward returned {rc} on {case} (n_tokens={n}),"
                               " expected 0")
        if ffi.unpack(y + n * hidden, GUARD) != [GUARD_VALUE] * GUARD:
            raise ProbeFailure(f"ffn_forward wrote past the end of y on {case}"
                               f" (n_tokens={n}, hidden={hidden})")
        if ffi.unpack(x, n * hidden) != x_before:
            raise ProbeFailure(f"ffn_forward modified its input x on {case}")
        out = ffi.unpack(y, n * hidden)
        if not all(map(math.isfinite, out)):
            i = next(i for i, v in enumerate(out) if not math.isfinite(v))
            what = "NaN" if math.isnan(out[i]) else "inf"
            raise ProbeFailure(f"output y[{i // hidden}][{i % hidden}] is {what} on {case}"
                               f" (n_tokens={n}): not written, accumulated into y, or"
                               " non-finite result")
        return [out[t * hidden:(t + 1) * hidden] for t in range(n)]

    def close(a: list[list[float]], b: list[list[float]], what: str) -> None:
        scale = max((abs(v) for r in b for v in r), default=0.0)
        for t, (ra, rb) in enumerate(zip(a, b)):
            for i, (va, vb) in enumerate(zip(ra, rb)):
                if abs(va - vb) > ATOL + RTOL * max(abs(vb), scale * 1e-2):
                    raise ProbeFailure(f"{what}: y[{t}][{i}] = {va!r} vs {vb!r}")

    pool = [rng.gauss(0.0, 1.0) for _ in range(8 * hidden)]

    def gauss(n: int, scale: float = 1.0, first: int = 0) -> list[list[float]]:
        return [[v * scale for v in pool[(first + t) * hidden:(first + t + 1) * hidden]]
                for t in range(n)]

    calls = 0
    call(gauss(1, first=7), "random input")
    seven = gauss(7)
    y7 = call(seven, "random input")
    calls += 2
    for t in (0, 3, 6):
        close([y7[t]], call([seven[t]], "random input"),
              f"rows not independent (row {t} of 7 vs alone)")
        calls += 1
    close(y7, call(seven, "random input"), "not deterministic (same input twice)")
    call([[0.0] * hidden], "zeros")
    call([[0.0] * hidden for _ in range(7)], "zeros")
    big = gauss(7, LARGE, first=1)
    call(big, f"large values (N(0,1)*{LARGE:g})")
    call(big[:1], f"large values (N(0,1)*{LARGE:g})")
    calls += 5
    return {"ok": True, "calls": calls}
