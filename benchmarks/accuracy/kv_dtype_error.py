"""What an f16 or q8 KV cache costs against f32: the same sequence decoded with each.

    python -m benchmarks.accuracy.kv_dtype_error [--steps 64] [--json]

For each model (a random one from colibri_core.model.testing and the built-in one), the f32
cache decodes `steps` greedy tokens after a fixed 128-token prompt, with int8 activations
(the default) and with float activations (the C pipeline's float tiles, where no
int8 rounding of the attention's output hides the cache's own error); the f16 and q8 caches are then
fed the same tokens (teacher forcing), so every step compares logits of the same
context. Reported per storage type: the largest relative logit error over the steps
(max |l - l_f32| / max |l_f32| of a step), its median, the share of steps whose greedy
token equals f32's, and the first step at which a free-running greedy decode with that
cache leaves f32's tokens (None: never within `steps`). The measurement is
tests/kv_error_helpers.py's; tests/test_kvcache.py holds floors on these figures;
docs/BENCHMARKS.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from tests.kv_error_helpers import measure, prompt_for, random_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    from colibri_core.config import builtin_model_dir
    from colibri_core.engine import Engine
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("random", random_model(Path(tmp) / "m")), ("builtin", builtin_model_dir())):
            for act in ("int8", "float"):
                with Engine.from_model_dir(path, threads=2, activations=act) as eng:
                    out[f"{name}/{act}"] = measure(eng.model, prompt_for(eng), a.steps)
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{'model/activations':18} {'kv':4} {'max rel':>9} {'median rel':>11} {'greedy =':>9} "
          f"{'diverges at':>12}")
    for name, r in out.items():
        for dt, m in r.items():
            div = "never" if m["first_divergence"] is None else str(m["first_divergence"])
            print(f"{name:18} {dt:4} {m['max_rel']:9.2e} {m['median_rel']:11.2e} "
                  f"{m['greedy_agreement']:9.1%} {div:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
