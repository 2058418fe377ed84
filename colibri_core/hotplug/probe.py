"""Out-of-process probe of an expert .so: `python -m colibri_core.hotplug.probe PATH HIDDEN`.

Runs in a fresh interpreter (spawned, never a fork of the engine), loads the .so with
RTLD_NOW and calls ffn_forward on random and edge-case inputs. It writes one verdict line
`COLIBRI-PROBE {json}` to stdout and exits 0 when the expert passed, 3 when it failed a
check. A crash (signal), a hang (the parent's timeout) or a missing verdict is a failure the
parent (`run_probe`) names itself.

Checks, each call on a fresh output buffer filled with NaN and followed by guard values:
- return value 0;
- every output written and finite (a NaN left over means "not written", "accumulated into
  y" or "produced NaN"; all are refusals);
- nothing written past the end of y, input x left unchanged;
- rows independent: row t of a 7-token call equals a 1-token call on row t;
- deterministic: the same call twice gives the same output.
Cases: random N(0,1) rows (n_tokens 1 and 7), zeros, large values (N(0,1) * 100).

Only the standard library and cffi are imported, so the probe starts in tens of ms.
"""
from __future__ import annotations

import json
import math
import random
import sys

VERDICT_PREFIX = "COLIBRI-PROBE "
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 3, 2
LARGE = 100.0
GUARD = 16
GUARD_VALUE = -2.0 ** 100   # exact in float32
RTOL, ATOL = 1e-3, 1e-5


class ProbeFailure(Exception):
    pass


def probe(path: str, hidden: int, seed: int = 0) -> dict:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef("int ffn_forward(const float *x, float *y, int n_tokens, int hidden);")
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


def run_probe(path: str, hidden: int, timeout_s: float = 5.0, *, cwd: str | None = None,
              seed: int = 0) -> dict:
    """Probe `path` in a fresh interpreter; return the verdict or raise ExpertProbeError.

    Called by the manager's worker thread (never the engine thread). The child runs in its
    own session so that a hang is ended by killing its whole process group.
    """
    import os
    import signal
    import subprocess

    from .errors import ExpertProbeError

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "colibri_core.hotplug.probe", path, str(hidden), str(seed)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=env,
                            cwd=cwd or os.path.dirname(os.path.abspath(path)))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise ExpertProbeError(f"{path}: probe hung: no verdict within {timeout_s:g} s"
                               " (probe killed)", reason="probe-timeout", path=path) from None
    rc = proc.returncode
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        raise ExpertProbeError(f"{path}: probe crashed with {sig} while calling ffn_forward"
                               " (or loading the .so)", reason="probe-crash", path=path)
    verdict = None
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith(VERDICT_PREFIX):
            try:
                verdict = json.loads(line[len(VERDICT_PREFIX):])
            except ValueError:
                verdict = None
    if not isinstance(verdict, dict) or (verdict.get("ok") is True) != (rc == EXIT_OK):
        tail = " | ".join(err.decode("utf-8", "replace").strip().splitlines()[-2:])
        raise ExpertProbeError(f"{path}: probe exited with status {rc} without a verdict"
                               f"{': ' + tail if tail else ''}", reason="probe-failed",
                               path=path)
    if not verdict["ok"]:
        raise ExpertProbeError(f"{path}: probe refused it: {verdict.get('reason')}",
                               reason="probe-failed", path=path)
    return verdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m colibri_core.hotplug.probe PATH HIDDEN [SEED]",
              file=sys.stderr)
        return EXIT_USAGE
    path, hidden = argv[0], int(argv[1])
    seed = int(argv[2]) if len(argv) == 3 else 0
    try:
        verdict = probe(path, hidden, seed)
        code = EXIT_OK
    except ProbeFailure as e:
        verdict, code = {"ok": False, "reason": str(e)}, EXIT_FAILED
    sys.stdout.write(VERDICT_PREFIX + json.dumps(verdict) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
