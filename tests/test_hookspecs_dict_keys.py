"""The dict keys every hookspec docstring documents (its "Keys of ``ARG``:" sections) are
the ones a real generation with hot-plugged experts passes, each of the documented type."""
from __future__ import annotations

import re

from colibri_core import hookspecs
from colibri_core.config import EngineConfig, HotplugConfig
from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import HOOK_NAMES

from plugin_guard_helpers import engine_with, generate


KEYS_HEADER = re.compile(r"^(\s*)Keys of ``(\w+)``:\s*$")
KEY_LINE = re.compile(r"^(\s*)(\w+) \(([^)]+)\): \S")
TYPES = {"str": lambda v: isinstance(v, str), "int": lambda v: type(v) is int,
         "bool": lambda v: type(v) is bool, "float": lambda v: isinstance(v, float),
         "list[int]": lambda v: isinstance(v, list) and all(type(x) is int for x in v)}


def documented_keys(doc: str) -> dict[str, dict[str, str]]:
    """``{argument: {key: type}}`` from a docstring's ``Keys of ``ARG``:`` sections."""
    out: dict[str, dict[str, str]] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = KEYS_HEADER.match(line)
        if not m:
            continue
        keys = out[m.group(2)] = {}
        indent = None
        for entry in lines[i + 1:]:
            if not entry.strip():
                break
            km = KEY_LINE.match(entry)
            depth = len(entry) - len(entry.lstrip())
            if indent is None:
                assert km, f"first line after {line.strip()!r} is not 'key (type): ...'"
                indent = depth
            if depth < indent or depth <= len(m.group(1)):
                break
            if depth == indent:
                assert km, f"malformed key line {entry.strip()!r}"
                assert km.group(3) in TYPES, f"unknown type {km.group(3)!r} in {entry.strip()!r}"
                keys[km.group(2)] = km.group(3)
    return out


SPEC_KEYS = {h: documented_keys(getattr(hookspecs, h).__doc__) for h in HOOK_NAMES}


def test_every_dict_argument_documents_its_keys():
    for hook in HOOK_NAMES:
        fn = getattr(hookspecs, hook)
        dict_args = {a for a, t in fn.__annotations__.items() if t == "dict"}
        assert set(SPEC_KEYS[hook]) == dict_args, hook
        assert all(SPEC_KEYS[hook].values()), hook
    assert SPEC_KEYS["colibri_expert_loaded"]["info"]["layer"] == "int"
    assert documented_keys("Keys of ``x``:\n    a (int): one\n        more\n    b (str): two\n\n"
                           "    c (int): not in it") == {"x": {"a": "int", "b": "str"}}


class RecordsEveryHook:
    """Implements every hook with all its arguments; ``calls``: (hook, arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []


def _recording_impl(hook: str):
    """``def <hook>(self, <its arguments>)`` appending them to self.calls (pluggy reads
    the arguments an implementation wants from its signature, so it is written out)."""
    spec = getattr(hookspecs, hook)
    args = spec.__code__.co_varnames[:spec.__code__.co_argcount]
    ns: dict = {}
    exec(f"def {hook}(self, {', '.join(args)}):\n"
         f"    self.calls.append(({hook!r}, dict({', '.join(f'{a}={a}' for a in args)})))\n", ns)
    return hookimpl(ns[hook])


for _hook in HOOK_NAMES:
    setattr(RecordsEveryHook, _hook, _recording_impl(_hook))


def test_documented_dict_keys_are_what_the_engine_passes(tiny_model_dir, tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    watched, build = tmp_path / "experts", tmp_path / "build"
    watched.mkdir(mode=0o755)
    build.mkdir()
    compile_test_expert(build / "good.so", name="good", hidden=128, layer=1)
    compile_test_expert(build / "wrong.so", name="wrong", hidden=64, layer=1)
    for so in ("good.so", "wrong.so"):
        (build / so).rename(watched / so)
    from colibri_core.builtin_plugins.metrics import Metrics
    rec, metrics = RecordsEveryHook(), Metrics()
    cfg = EngineConfig(experts_dir=str(watched), hotplug=HotplugConfig(settle_s=0.05))
    with engine_with(rec, "recorder", tiny_model_dir, cfg) as eng:
        assert eng.pm.get_plugin("recorder") is rec
        generate(eng)                                   # loaded + rejected at start-up
        eng.next_token_logits([4, 5])
        eng.register_plugin(metrics, name="metrics")
        metrics.colibri_expert_loaded(info=[kw for h, kw in rec.calls
                                            if h == "colibri_expert_loaded"][0]["info"])
        assert metrics.hot_experts == {(1, 4)}          # keyed by the documented keys
        (watched / "good.so").unlink()
        eng.hotplug.rescan()
        assert eng.hotplug.wait_idle(20)
        generate(eng)                                   # unloaded at a token boundary
        assert metrics.hot_experts == set()
        assert eng.plugin_failures() == {}
    seen = {hook for hook, _ in rec.calls}
    assert seen == set(HOOK_NAMES), set(HOOK_NAMES) - seen
    for hook, args in SPEC_KEYS.items():
        for arg, keys in args.items():
            given = [kw[arg] for h, kw in rec.calls if h == hook]
            assert given, (hook, arg)
            for d in given:
                for key, typ in keys.items():
                    assert key in d, f"{hook}: {arg}[{key!r}] is documented but not passed: {d}"
                    assert TYPES[typ](d[key]), f"{hook}: {arg}[{key!r}] = {d[key]!r}, not {typ}"
    loaded = [kw["info"] for h, kw in rec.calls if h == "colibri_expert_loaded"]
    assert [(i["name"], i["layer"], i["expert"], i["layers"]) for i in loaded] == [("good", 1, 4, [1])]
    unloaded = [kw["info"] for h, kw in rec.calls if h == "colibri_expert_unloaded"]
    assert [(i["name"], i["reason"], i["layers"]) for i in unloaded] == [("good", "deleted", [1])]
