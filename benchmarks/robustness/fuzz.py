"""Long fuzzing run: the fuzzers of tests/test_fuzz*.py in rounds with fresh seeds.

    python -m benchmarks.robustness.fuzz --minutes 30 [--per-round 2000] [-k elf] [--json out.json]

Each round runs pytest on tests/test_fuzz.py and test_fuzz_elf.py with
COLIBRI_FUZZ_EXAMPLES=<per-round> and a new
`--hypothesis-seed`, until the time is up; the first failing round stops the run and its
output (hypothesis' shrunk falsifying example, with a reproduction blob) is printed. At the
end: rounds, inputs tried per fuzzer, and the result. The CI run is the same file with a
few hundred examples per fuzzer (docs/ROBUSTNESS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO as ROOT


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--per-round", type=int, default=2000, help="examples per fuzzer per round")
    ap.add_argument("-k", default=None, help="pytest -k expression (one fuzzer, e.g. 'elf')")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    deadline = time.time() + args.minutes * 60
    report = Path(tempfile.mkdtemp(prefix="colibri-fuzz-")) / "tried.json"
    rounds, failed, t0 = 0, None, time.time()
    while time.time() < deadline:
        seed = random.randrange(1 << 31)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               "-W", "ignore::DeprecationWarning", str(ROOT / "tests" / "test_fuzz.py"),
               str(ROOT / "tests" / "test_fuzz_elf.py"),
               f"--hypothesis-seed={seed}"]
        if args.k:
            cmd += ["-k", args.k]
        env = dict(os.environ, COLIBRI_FUZZ_EXAMPLES=str(args.per_round),
                   COLIBRI_FUZZ_REPORT=str(report))
        left = max(60.0, deadline - time.time() + 600)
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as e:
            failed = {"seed": seed, "output": f"round timed out after {left:.0f} s (a hang?)\n"
                                              f"{(e.stdout or '')[-4000:]}"}
            break
        rounds += 1
        print(f"fuzz: round {rounds} (seed {seed}): {r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.returncode}",
              file=sys.stderr)
        if r.returncode != 0:
            failed = {"seed": seed, "output": r.stdout[-20000:] + r.stderr[-4000:]}
            break
    tried = json.loads(report.read_text()) if report.exists() else {}
    result = {"rounds": rounds, "minutes": round((time.time() - t0) / 60, 1), "per_round": args.per_round,
              "inputs_tried": tried, "total_inputs": sum(tried.values()), "failed": failed is not None}
    if failed:
        print(failed["output"])
        result["failure"] = {"seed": failed["seed"], "tail": failed["output"][-4000:]}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
