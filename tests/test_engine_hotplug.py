"""Hot-plugged experts through the real engine: generation runs in one thread while this
thread builds, renames, replaces and deletes real files in the watched folder."""
import os
import threading
import time

import numpy as np
import pytest

from colibri_core.config import EngineConfig, HotplugConfig
from colibri_core.engine import Engine
from colibri_core.hookspecs import hookimpl
from colibri_core.experts.hotplug.authoring.builder import build_expert

H, I = 128, 64   # tiny_model_dir: hidden 128, MoE layers 1 and 2, 4 experts


def _npz(path, seed, bias):
    rng = np.random.default_rng(seed)
    np.savez(path, w1=rng.standard_normal((I, H)) / np.sqrt(H), w3=rng.standard_normal((I, H)) / np.sqrt(H),
             w2=rng.standard_normal((H, I)) / np.sqrt(I), router_row=np.zeros(H, np.float32),
             router_bias=np.float32(bias))
    return path


def _build(tmp, name, version, seed, bias=50.0):
    so = tmp / f"{name}-{version}.so"
    build_expert(_npz(tmp / f"{name}-{version}.npz", seed, bias), so, layer=1, name=name, version=version,
                 portable=True)
    return so


class Events:
    def __init__(self):
        self.loaded, self.unloaded, self.rejected = [], [], []

    @hookimpl
    def colibri_expert_loaded(self, info):
        self.loaded.append(info)

    @hookimpl
    def colibri_expert_unloaded(self, info):
        self.unloaded.append(info)

    @hookimpl
    def colibri_expert_rejected(self, path, reason):
        self.rejected.append((path, reason))


class Looper(threading.Thread):
    """Generates back-to-back requests; records (request, step, expert-set generation, slot-4 routed)."""

    def __init__(self, eng):
        super().__init__(daemon=True)
        self.eng, self.stop, self.tokens, self.error = eng, threading.Event(), [], None
        self.routed = {}        # (request id, step) -> slot 4 routed in layer 1
        looper = self

        class Routed:           # on the scheduler's thread, right after the token's step
            @hookimpl
            def colibri_token(self, request_id, step, token_id, text, expert_set_generation,
                              expert_set_id):
                ids = [t.routing.ids for t in eng.model.last_routing if t.layer == 1][0]
                looper.routed[request_id, step] = bool((ids == 4).any())

        eng.register_plugin(Routed(), "routed")

    def run(self):
        try:
            r = 0
            while not self.stop.is_set():
                g = self.eng.generate([1, 2, 3], max_new_tokens=40, temperature=0)
                for ev in g:
                    routed = self.routed.pop((g.request_id, ev.step))
                    self.tokens.append((r, ev.step, ev.expert_set_generation, routed))
                    time.sleep(0.002)
                    if self.stop.is_set():
                        break
                r += 1
        except BaseException as e:   # surfaced by the test
            self.error = e

    def wait_version(self, pred, timeout=20.0):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.error:
                raise self.error
            if self.tokens and pred(self.tokens[-1]):
                return self.tokens[-1]
            time.sleep(0.01)
        raise AssertionError(f"timed out; last token {self.tokens[-1] if self.tokens else None}")


def test_add_replace_rollback_remove_while_generating(tiny_model_dir, tmp_path):
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    cfg = EngineConfig(experts_dir=str(watched), hotplug=HotplugConfig(settle_s=0.05))
    eng = Engine(tiny_model_dir, cfg)
    ev = Events()
    eng.register_plugin(ev)
    loop = Looper(eng)
    loop.start()
    try:
        loop.wait_version(lambda t: True)
        assert not loop.tokens[-1][3]                      # no hot expert yet
        v1 = _build(build, "fraud", "1", seed=1)
        os.rename(v1, watched / "fraud.so")                # write elsewhere, rename in
        t = loop.wait_version(lambda t: t[3])
        add_version = t[2]
        v2 = _build(build, "fraud", "2", seed=2)
        os.replace(v2, watched / "fraud.so")               # replace in place
        loop.wait_version(lambda t: t[2] > add_version)
        assert [i["version"] for i in ev.loaded] == ["1", "2"]
        replace_version = eng.expert_set_generation
        eng.hotplug.rollback("fraud")
        loop.wait_version(lambda t: t[2] > replace_version)
        assert ev.loaded[-1]["version"] == "1"
        (watched / "fraud.so").unlink()
        loop.wait_version(lambda t: not t[3] and t[2] > replace_version + 1)
        loop.wait_version(lambda t: True)
    finally:
        loop.stop.set()
        loop.join(10)
        eng.close()
    assert loop.error is None
    # every token accounted for: steps contiguous within each request, versions monotonic
    by_req = {}
    for r, step, version, _ in loop.tokens:
        by_req.setdefault(r, []).append(step)
    for steps in by_req.values():
        assert steps == list(range(len(steps)))
    versions = [v for _, _, v, _ in loop.tokens]
    assert versions == sorted(versions)
    # the hot expert was routed exactly while it was live
    live = [routed for _, _, v, routed in loop.tokens if add_version <= v <= replace_version]
    assert live and all(live)
    assert not loop.tokens[-1][3]
    assert ev.unloaded and ev.unloaded[-1]["name"] == "fraud"


def test_refusals_reported_and_engine_goes_on(tiny_model_dir, tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    bad = {
        "wrong_hidden.so": dict(hidden=64, layer=1),
        "wrong_layer.so": dict(hidden=H, layer=0),        # layer 0 is dense
        "crash.so": dict(hidden=H, layer=1, fault="segv"),
        "nan.so": dict(hidden=H, layer=1, fault="nan"),
    }
    for name, kw in bad.items():
        compile_test_expert(build / name, name=name.split(".")[0], **kw)
        os.rename(build / name, watched / name)
    os.symlink(watched / "crash.so", watched / "link.so")
    from colibri_core.plugins import build_plugin_manager
    pm = build_plugin_manager(load_entrypoints=False)
    ev = Events()
    pm.register(ev)              # registered before start: the start-up scan reports too
    eng = Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                              hotplug=HotplugConfig(settle_s=0.05)), plugin_manager=pm)
    try:
        assert all(r["status"] != "active" for r in eng.hotplug.list())
        assert eng.expert_set_generation == 0
        g = eng.generate([1, 2, 3], max_new_tokens=5, temperature=0).run()
        assert len(g.token_ids) == 5
        reasons = " | ".join(r for _, r in ev.rejected)
        for word in ("hidden", "layer", "NaN", "symlink"):
            assert word.lower() in reasons.lower(), (word, reasons)
        assert "signal" in reasons.lower() or "crash" in reasons.lower() or "segv" in reasons.lower(), reasons
    finally:
        eng.close()


def test_isolated_expert_crash_after_adoption_disables_it(tiny_model_dir, tmp_path):
    from colibri_core.experts.hotplug.authoring.testing import MAGIC_INPUT, compile_test_expert
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    compile_test_expert(build / "iso.isolated.so", name="iso", hidden=H, layer=1, fault="crash_on_magic")
    os.rename(build / "iso.isolated.so", watched / "iso.isolated.so")
    eng = Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                              hotplug=HotplugConfig(settle_s=0.05)))
    try:
        rows = eng.hotplug.list()
        assert [r["isolation"] for r in rows] == ["isolated"]
        hot = eng.hotplug.active()["iso"]
        assert any(isinstance(e, object) and getattr(e, "hot", None) is hot
                   for e in eng.model.expert_set.experts[1])
        # Kill the helper process from outside: the engine must go on without the expert.
        pid = hot.helper_pid
        os.kill(pid, 9)
        time.sleep(0.2)
        g = eng.generate([1, 2, 3], max_new_tokens=6, temperature=0).run()
        assert len(g.token_ids) == 6
        assert "iso" not in eng.hotplug.active()
        assert all(getattr(e, "hot", None) is not hot for e in eng.model.expert_set.experts[1])
    finally:
        eng.close()


def test_pinned_request_keeps_its_expert_set(tiny_model_dir, tmp_path):
    """A request that pins its expert set is computed with the snapshot it started with,
    while a new request adopts the newly dropped expert."""
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    with Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                             hotplug=HotplugConfig(settle_s=0.05))) as eng:
        pinned = iter(eng.generate([1, 2, 3], max_new_tokens=30, temperature=0, pin_experts=True))
        first = [next(pinned) for _ in range(3)]
        os.rename(_build(build, "late", "1", seed=3), watched / "late.so")
        t0 = time.time()
        while eng.expert_set_generation == 0 and time.time() - t0 < 20:
            eng.apply_expert_changes()               # this is the engine's thread
            time.sleep(0.02)
        assert eng.expert_set_generation >= 1           # adopted while the pinned run is open
        rest = list(pinned)
        assert {ev.expert_set_generation for ev in first + rest} == {0}
        for t in eng.model.last_routing:             # the pinned run never saw slot 4
            assert not (t.routing.ids == 4).any()
        g = eng.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
        assert g.events[0].expert_set_generation >= 1
        routed = [t.routing.ids for t in eng.model.last_routing if t.layer == 1][0]
        assert (routed == 4).any()


def test_changes_are_prepared_off_the_engine_thread(tiny_model_dir, tmp_path):
    """While one thread generates, adds, replaces and removals are adopted between two
    tokens from expert sets (and decode plans) the hot-plug worker built: no dlopen and no
    decode plan on the generating thread once it runs. A rollback, which the worker does
    not prepare, is built on the generating thread and is just as correct."""
    import threading

    from colibri_core.forward import steptables
    from colibri_core.experts.hotplug.expert import _ffi
    watched = tmp_path / "experts"
    watched.mkdir(mode=0o755)
    build = tmp_path / "build"
    build.mkdir()
    where: dict[str, list[str]] = {"plan": [], "dlopen": []}
    real_init, real_dlopen = steptables.SetTables.__init__, _ffi.dlopen

    def plan_init(self, *a, **k):
        where["plan"].append(threading.current_thread().name)
        real_init(self, *a, **k)

    def dlopen(*a, **k):
        where["dlopen"].append(threading.current_thread().name)
        return real_dlopen(*a, **k)
    steptables.SetTables.__init__, _ffi.dlopen = plan_init, dlopen
    try:
        eng = Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                                  hotplug=HotplugConfig(settle_s=0.05)))
        loop = Looper(eng)
        loop.name = "generator"
        loop.start()
        try:
            loop.wait_version(lambda t: t[1] >= 2)      # decoding: the first set's plan
            where["plan"].clear()                       # was built there
            os.rename(_build(build, "fraud", "1", seed=1), watched / "fraud.so")
            loop.wait_version(lambda t: t[3])
            v = eng.expert_set_generation
            os.replace(_build(build, "fraud", "2", seed=2), watched / "fraud.so")
            loop.wait_version(lambda t: t[2] > v)
            os.rename(_build(build, "other", "1", seed=3, bias=-50.0), watched / "other.so")
            loop.wait_version(lambda t: t[2] > v + 1)
            (watched / "other.so").unlink()
            loop.wait_version(lambda t: t[2] > v + 2)
            stats = dict(eng.expert_change_stats)
            plans = list(where["plan"])
            v = eng.expert_set_generation
            eng.hotplug.rollback("fraud")
            loop.wait_version(lambda t: t[2] > v)
            rolled = dict(eng.expert_change_stats)
        finally:
            loop.stop.set()
            loop.join(10)
            eng.close()
    finally:
        steptables.SetTables.__init__, _ffi.dlopen = real_init, real_dlopen
    assert loop.error is None
    assert stats == {"prepared": 4, "built_here": 0}, stats
    assert plans and "generator" not in plans, plans
    assert where["dlopen"] and "generator" not in where["dlopen"], where["dlopen"]
    assert rolled == {"prepared": 4, "built_here": 1}, rolled
    assert eng.hotplug is None
    versions = [v for _, _, v, _ in loop.tokens]
    assert versions == sorted(versions)
    assert loop.tokens[-1][3]                   # fraud 1 is back and routed (bias 50)


def _settle(eng, generation, timeout=20.0):
    """Apply queued changes (this is the engine's thread) until the generation passes
    `generation`; -> the new generation."""
    t0 = time.time()
    while eng.expert_set_generation <= generation and time.time() - t0 < timeout:
        eng.apply_expert_changes()
        time.sleep(0.02)
    assert eng.expert_set_generation > generation, "change not adopted"
    return eng.expert_set_generation


def test_expert_set_id_names_the_experts_not_the_history(tiny_model_dir, tmp_path):
    """Two engines on the same model with the same hot-plugged experts report the same
    expert_set_id whatever the order they came in, the slots they took or what came and
    went before; the generation counts the changes. Adding an expert changes the id,
    removing it restores the one before; tokens and hook events carry both."""
    import shutil
    build = tmp_path / "build"
    build.mkdir()
    so = {"fraud": _build(build, "fraud", "1", seed=1),
          "other": _build(build, "other", "1", seed=2, bias=-50.0)}

    def put(folder, name):                   # the same bytes in each folder, renamed in
        tmp = build / f"{name}.{time.monotonic_ns()}"
        shutil.copyfile(so[name], tmp)
        os.rename(tmp, folder / f"{name}.so")

    def engine(name):
        watched = tmp_path / name
        watched.mkdir(mode=0o755)
        eng = Engine(tiny_model_dir, EngineConfig(experts_dir=str(watched),
                                                  hotplug=HotplugConfig(settle_s=0.05)))
        ev = Events()
        eng.register_plugin(ev)
        return eng, watched, ev

    a, wa, ev_a = engine("a")
    b, wb, _ = engine("b")
    try:
        base = a.expert_set_id
        assert len(base) == 64 and b.expert_set_id == base and a.expert_set_generation == 0
        # a: fraud, then other, then other removed
        put(wa, "fraud")
        ga_fraud = _settle(a, 0)
        id_fraud = a.expert_set_id
        assert id_fraud != base
        assert ev_a.loaded[-1]["expert_set_id"] == id_fraud
        assert ev_a.loaded[-1]["expert_set_generation"] == ga_fraud
        g = a.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
        assert {(e.expert_set_generation, e.expert_set_id) for e in g.events} == {(ga_fraud, id_fraud)}
        put(wa, "other")
        ga_both = _settle(a, ga_fraud)
        id_both = a.expert_set_id
        assert id_both not in (base, id_fraud)
        (wa / "other.so").unlink()
        _settle(a, ga_both)
        assert a.expert_set_id == id_fraud and ev_a.unloaded[-1]["expert_set_id"] == id_fraud
        # b: other first, then fraud (other slots), then other removed
        put(wb, "other")
        gb = _settle(b, 0)
        assert b.expert_set_id not in (base, id_fraud, id_both)
        put(wb, "fraud")
        gb = _settle(b, gb)
        assert b.expert_set_id == id_both
        slots = {r["name"]: r["slot"] for r in b.hotplug.list()}
        assert slots["fraud"] != {r["name"]: r["slot"] for r in a.hotplug.list()}["fraud"]
        (wb / "other.so").unlink()
        gb = _settle(b, gb)
        assert b.expert_set_id == id_fraud and gb != ga_fraud
        (wb / "fraud.so").unlink()
        gb = _settle(b, gb)
        assert b.expert_set_id == base and b.expert_set_generation > 0
    finally:
        a.close()
        b.close()


def test_expert_set_id_without_model_checksums(tiny_model_dir, tmp_path):
    """A model directory whose config.json lists no files: model experts are named by
    their file's size and header section, so two copies still agree (and differ from the
    id the listed checksums give)."""
    import json
    import shutil
    from colibri_core.experts.expertset import ExpertSet
    from colibri_core.model.weights import load_model
    ids = []
    for name in ("c1", "c2"):
        d = shutil.copytree(tiny_model_dir, tmp_path / name)
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("files")
        (d / "config.json").write_text(json.dumps(cfg))
        w = load_model(d)
        try:
            es = ExpertSet.from_weights(w)
            assert all(v.startswith("header:") for v in es.model_digests.values())
            ids.append(es.id)
        finally:
            es = None
            w.close()
    with Engine(tiny_model_dir) as eng:
        assert ids[0] == ids[1] != eng.expert_set_id


def test_a_failing_drain_stops_hotplug_and_the_engine_keeps_serving(tmp_path, caplog):
    """A bug in applying expert changes must not stall or fail every request: hot-plug
    stops (once, logged with the reason) and requests run on the set already live."""
    import logging
    d = tmp_path / "watched"
    d.mkdir()
    with Engine.from_config("builtin", threads=1, experts_dir=str(d)) as eng:
        want = eng.generate([1, 2, 3], max_new_tokens=4, temperature=0).run().token_ids
        calls = []

        def broken():
            calls.append(1)
            raise RuntimeError("drain broke")
        eng.hotplug.drain = broken
        out = []

        def two():                      # in a thread: a stalled engine fails, never hangs
            for _ in range(2):
                out.append(eng.generate([1, 2, 3], max_new_tokens=4, temperature=0).run().token_ids)
        with caplog.at_level(logging.ERROR, logger="colibri"):
            t = threading.Thread(target=two, daemon=True)
            t.start()
            t.join(60)
        assert not t.is_alive(), "requests stalled after drain() failed"
        assert out == [want, want]
        assert len(calls) == 1
        assert eng.hotplug_error == "RuntimeError: drain broke"
        assert caplog.text.count("hot-plug stopped") == 1
