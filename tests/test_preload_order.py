"""The background preload (EngineConfig.preload "willneed", no budget) starts once the
first forward step is done (issue 30: on 2 CPUs it shared them with the first forward of
a warm Qwen3-30B-A3B load); wait_preload() and close() still end it when no step ran."""
from __future__ import annotations

import threading

import pytest

from colibri_core.engine import Engine
from colibri_core.format.modelfile import ContainerFile
from colibri_core.forward.pipeline import Pipeline
from colibri_core.model.testing import write_random_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("preload") / "m"
    write_random_model(d, hidden=64, heads=2, kv_heads=1, inter=64, moe_inter=64, vocab=64,
                       group=64, shared=0, context=64, experts=4, top_k=2,
                       layers=("dense", "moe", "moe"))
    return d


@pytest.fixture
def events(monkeypatch):
    log, lock = [], threading.Lock()
    populate, run = ContainerFile.populate, Pipeline.run

    def populated(self):
        with lock:
            log.append("populate")
        return populate(self)

    def ran(self, *a, **k):
        out = run(self, *a, **k)
        with lock:
            log.append("step")
        return out

    monkeypatch.setattr(ContainerFile, "populate", populated)
    monkeypatch.setattr(Pipeline, "run", ran)
    return log


def test_the_preload_starts_after_the_first_step(model, events):
    with Engine.from_model_dir(model, threads=1) as eng:
        t = eng.model.residency._preloader
        assert t is not None and t.is_alive()
        t.join(0.5)                       # long enough for the old preload to have run
        assert "populate" not in events
        eng.generate([1, 2, 3], max_new_tokens=2, temperature=0).run()
        eng.model.residency.wait_preload()
        assert not t.is_alive()
    assert events[0] == "step" and events.count("populate") == 2 + 2 * 4   # every file, once


def test_wait_preload_and_close_end_it_without_a_step(model, events):
    with Engine.from_model_dir(model, threads=1) as eng:
        eng.model.residency.wait_preload()
        assert "step" not in events and "populate" in events
    eng = Engine.from_model_dir(model, threads=1)
    t = eng.model.residency._preloader
    eng.close()
    assert not t.is_alive()
