"""Loading a model parses each distinct section table once (issue 30: Qwen3-30B-A3B's
6,144 expert files share one table; parsing it per file was the largest CPU cost of a warm
Engine()). A table that differs in any byte, or a file of another size, is still parsed
and checked in full, and refused naming its own file."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from colibri_core.errors import ModelFormatError
from colibri_core.format import modelfile
from colibri_core.model.weights import load_model


def _table(path):
    """The section table read with json from the file's bytes (the independent reading)."""
    raw = open(path, "rb").read()
    n = struct.unpack_from("<8sHHI", raw, 0)[3]
    return raw, {s["name"]: s for s in json.loads(raw[16:16 + n])["sections"]}


def test_expert_tables_are_parsed_once(shared_table_model_dir, monkeypatch):
    calls = []
    real = modelfile.parse_table
    monkeypatch.setattr(modelfile, "parse_table", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    getattr(modelfile, "_TABLES", {}).clear()
    m = load_model(shared_table_model_dir)
    try:
        experts = [x for L in m.layers for x in L.experts]
        assert len(experts) == 24
        assert len(calls) == 3, calls           # model.bin, routing.bin, one expert table
        for x in experts:                       # each file's views are its own bytes
            raw, tab = _table(x.file.path)
            for mname in ("w1", "w3", "w2"):
                off, n = tab[mname]["parts"]["data"]
                got = np.asarray(getattr(x.ffn, mname).data).view(np.uint8).reshape(-1)
                assert bytes(got) == raw[off:off + n]
    finally:
        m.close()


def test_a_different_table_or_size_is_checked_in_full(shared_table_model_dir, tmp_path):
    getattr(modelfile, "_TABLES", {}).clear()
    load_model(shared_table_model_dir).close()  # the shared table is now remembered
    bad = tmp_path / "bad"
    shutil.copytree(shared_table_model_dir, bad)
    victim = bad / "expert_2_5.bin"
    raw, tab = _table(victim)
    off = tab["w3"]["parts"]["data"][0]
    text = raw.replace(b'"data":[%d,' % off, b'"data":[%d,' % (off + 8), 1)
    assert text != raw and len(text) == len(raw)
    victim.write_bytes(text)
    with pytest.raises(ModelFormatError, match="expert_2_5.bin.*'w3'.*4096"):
        load_model(bad, load_mode="mmap")
    victim.write_bytes(raw[:-4096])             # the same table, a shorter file
    with pytest.raises(ModelFormatError, match="expert_2_5.bin.*truncated"):
        load_model(bad, load_mode="mmap")
    os.remove(victim)
