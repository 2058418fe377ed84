"""A candidate's name takes a slot in the live book (its set puts it there); a candidate
that leaves without going live gives it back, so that the next new name gets it, and a
later candidate of the same name asks the live book again (experts/candidates.py,
hotplug/book.py forget_name)."""
import os
import shutil
import time

from colibri_core.engine import Engine
from hotplug_helpers import tiny_model_expert


def _put(so, folder, name):
    tmp = folder / f".{name}.tmp"
    shutil.copyfile(so, tmp)
    os.replace(tmp, folder / f"{name}.so")


def _wait(eng, pred, what, timeout=120.0):
    t0 = time.monotonic()
    while True:
        eng.apply_expert_changes()
        if pred():
            return
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def _state(state_dir):
    import json
    with open(os.path.join(state_dir, "hotplug_state.json"), encoding="utf-8") as f:
        return json.load(f)


def test_a_dropped_candidate_frees_its_slot(tiny_model_dir, tmp_path):
    watched = tmp_path / "watched"
    (watched / "shadow").mkdir(parents=True, mode=0o700)
    watched.chmod(0o700)
    cand, other = tiny_model_expert(tmp_path, "cand", 1), tiny_model_expert(tmp_path, "other", 2)
    with Engine.from_model_dir(tiny_model_dir, experts_dir=str(watched), threads=1) as eng:
        first = eng.model_cfg.num_experts
        live_book, shadow_book = eng.hotplug.book, eng.candidates.manager.book
        _put(cand, watched / "shadow", "cand")
        _wait(eng, lambda: any(r["name"] == "cand" and r["state"] == "shadow"
                               for r in eng.candidates.rows()), "the candidate")
        assert live_book.records["cand"].slot == first == shadow_book.records["cand"].slot
        assert live_book.next_slot == first + 1
        eng.candidates.drop("cand")
        _wait(eng, lambda: "cand" not in live_book.records, "the slot given back")
        assert "cand" not in shadow_book.records and live_book.next_slot == first
        state = _state(eng.hotplug.state_dir)          # saved: a restart keeps it freed
        assert "cand" not in state["experts"] and state["next_slot"] == first
        _put(other, watched, "other")                # a new live name: the freed slot
        _wait(eng, lambda: any(h.name == "other" for h in eng.model.expert_set.hot_experts()),
              "the live expert")
        assert live_book.records["other"].slot == first
        # the dropped name back as a candidate: a slot of its own, not other's
        shutil.copyfile(watched / "shadow" / "dropped" / "cand.so", tmp_path / "again.so")
        _put(tmp_path / "again.so", watched / "shadow", "cand")
        _wait(eng, lambda: any(r["name"] == "cand" and r["state"] == "shadow"
                               for r in eng.candidates.rows()), "the candidate again")
        assert live_book.records["cand"].slot == shadow_book.records["cand"].slot == first + 1


def test_a_candidate_of_a_live_name_keeps_the_slot(tiny_model_dir, tmp_path):
    """A new version of a live expert tried as a candidate, then dropped: the live name
    keeps its slot and record."""
    watched = tmp_path / "watched"
    (watched / "shadow").mkdir(parents=True, mode=0o700)
    watched.chmod(0o700)
    v1 = tiny_model_expert(tmp_path, "name", 3)
    (tmp_path / "v2").mkdir()
    v2 = tiny_model_expert(tmp_path / "v2", "name", 4)
    with Engine.from_model_dir(tiny_model_dir, experts_dir=str(watched), threads=1) as eng:
        first = eng.model_cfg.num_experts
        _put(v1, watched, "name")
        _wait(eng, lambda: any(h.name == "name" for h in eng.model.expert_set.hot_experts()),
              "the live expert")
        _put(v2, watched / "shadow", "name")
        _wait(eng, lambda: any(r["name"] == "name" for r in eng.candidates.rows()), "the candidate")
        eng.candidates.drop("name")
        _wait(eng, lambda: not eng.candidates.rows(), "the candidate gone")
        assert eng.hotplug.book.records["name"].slot == first
        assert eng.hotplug.book.next_slot == first + 1
