"""The fuzzers' shared machinery (tests/test_fuzz.py, tests/test_fuzz_elf.py): example
counts (COLIBRI_FUZZ_EXAMPLES / COLIBRI_FUZZ_SCALE), the time and memory guards every input
runs under, the per-fuzzer input counts reported on exit (COLIBRI_FUZZ_REPORT), and
structural mutations of JSON-like values."""
from __future__ import annotations

import atexit
import copy
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from colibri_core.errors import ColibriError

from robust_helpers import memory_limit, time_limit

SCALE = float(os.environ.get("COLIBRI_FUZZ_SCALE", "1"))
FIXED = os.environ.get("COLIBRI_FUZZ_EXAMPLES")


def examples(default: int) -> int:
    """Examples per fuzzer: the CI default (tuned to keep the file near 15 s on 2 idle cores),
    or COLIBRI_FUZZ_EXAMPLES for a long run."""
    return int(FIXED) if FIXED else max(1, int(default * SCALE))


def fuzz(default: int):
    return settings(max_examples=examples(default), deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


TRIED: Counter = Counter()          # inputs tried per fuzzer (reported on exit)
TIME_LIMIT_S = 10.0                 # one input must be handled within this (hang guard)
MEM_LIMIT = 64 << 20                # ... and allocate at most this (the inputs are < 1 MiB)


def _report():
    path = os.environ.get("COLIBRI_FUZZ_REPORT")
    if path and TRIED:
        old = {}
        if os.path.exists(path):
            try:
                old = json.loads(Path(path).read_text())
            except ValueError:
                old = {}
        for k, v in TRIED.items():
            old[k] = old.get(k, 0) + v
        Path(path).write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


atexit.register(_report)


def guarded(name: str, fn, allowed=(ColibriError,)):
    """Run fn under the time and memory guards; only the typed errors are allowed out.
    Returns fn's result, or the (allowed) exception."""
    TRIED[name] += 1
    with time_limit(TIME_LIMIT_S, name), memory_limit(MEM_LIMIT, name):
        try:
            return fn()
        except allowed as e:
            text = str(e)
            assert text.strip(), f"{name}: empty error message from {type(e).__name__}"
            return e


# ============================================================================ values

# Boundary values that break naive readers, plus anything JSON can hold.
EDGE_INTS = [0, 1, -1, 2, 3, 63, 64, 65, 127, 128, 4095, 4096, 4097, 2 ** 16, 2 ** 31 - 1,
             2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40, 2 ** 40 + 1, 2 ** 53, 2 ** 63 - 1, 2 ** 63,
             2 ** 64, -(2 ** 63), 10 ** 30]
json_scalars = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["", "q4", "q8", "f32", "f16", "bf16", "moe", "dense", "mla", "gqa",
                     "softmax", "sigmoid", "yarn", "\x00", "x" * 300]))
json_values = st.recursive(json_scalars,
                           lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                   st.dictionaries(st.text(max_size=8), inner,
                                                                   max_size=4)),
                           max_leaves=12)


def _paths(obj, prefix=()):
    """Every path (tuple of keys/indices) into a JSON-like value, the root excluded."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw, base, n_max: int = 3, values=json_values):
    """`base` (a JSON-like dict) with 1..n_max structural mutations: a field set to another
    value, deleted, duplicated into a new key, or a new key added."""
    obj = copy.deepcopy(base)

    def value():                    # a fresh copy: sampled constants are shared objects
        return copy.deepcopy(draw(values))
    for _ in range(draw(st.integers(1, n_max))):
        paths = _paths(obj)
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add", "list"]))
        if not paths or op == "add":
            parent = obj if not paths else _get(obj, draw(st.sampled_from(paths))[:-1])
            if isinstance(parent, dict):
                parent[draw(st.text(max_size=10))] = value()
            continue
        path = draw(st.sampled_from(paths))
        parent = _get(obj, path[:-1])
        if op == "delete":
            del parent[path[-1]]
        elif op == "list" and isinstance(parent[path[-1]], list):
            lst = parent[path[-1]]
            how = draw(st.sampled_from(["empty", "double", "first", "reverse", "append"]))
            new = {"empty": [], "double": lst * 2, "first": lst[:1], "reverse": lst[::-1],
                   "append": lst + [value()]}[how]
            lst[:] = copy.deepcopy(new)
        else:
            parent[path[-1]] = value()
    return obj


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder for the fuzzers' files (one per test module)."""
    return tmp_path_factory.mktemp("fuzz")
