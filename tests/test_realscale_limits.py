"""What breaks at real size, at small widths: a model with DeepSeek-V3's 58 x 256 expert
files under a hard RLIMIT_NOFILE of 1,024 and within vm.max_map_count (filemap.py), the
KV pool's default from the memory available and the preload of a model larger than
memory (residency.py); docs/ARCHITECTURE.md, "Defaults that follow the model".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from colibri_core.format import filemap
from colibri_core.config import EngineConfig, load_model_config
from colibri_core.engine import Engine
from colibri_core.errors import ModelFormatError, RequestTooLarge
from colibri_core.format.modelfile import ContainerFile
from colibri_core.experts.residency import kv_bytes_per_position, kv_pool_tokens, preload_files
from colibri_core.model.testing import write_random_model

REPO = Path(__file__).resolve().parent.parent
LAYERS, EXPERTS = 58, 256            # DeepSeek-V3's routed experts: 14,848 files


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    d = tmp_path_factory.mktemp("many") / "m"
    write_random_model(d, hidden=64, heads=2, kv_heads=1, inter=64, moe_inter=64, vocab=64,
                       group=64, shared=0, context=64, experts=EXPERTS, top_k=8,
                       layers=("dense",) + ("moe",) * LAYERS)
    return d


_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))   # hard: cannot be raised
    from colibri_core.engine import Engine
    from colibri_core.format.filemap import map_count
    before = map_count()
    with Engine.from_model_dir(sys.argv[1], threads=1) as e:
        mapped = map_count() - before
        fds = len(os.listdir("/proc/self/fd"))
        toks = e.generate([1, 2, 3, 4], max_new_tokens=6, temperature=0).run().token_ids
    print(json.dumps({"mapped": mapped, "fds": fds, "tokens": toks,
                      "hard": resource.getrlimit(resource.RLIMIT_NOFILE)[1]}))
""")


def test_58_x_256_expert_files_run_under_a_hard_fd_limit_of_1024(many_experts):
    p = subprocess.run([sys.executable, "-c", _CHILD, str(many_experts)], capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["hard"] == 1024
    assert got["mapped"] >= LAYERS * EXPERTS          # every expert file is mapped ...
    assert got["fds"] < 64                            # ... and none keeps a descriptor
    with Engine.from_model_dir(many_experts, threads=1) as e:   # no limit: the same tokens
        ref = e.generate([1, 2, 3, 4], max_new_tokens=6, temperature=0).run().token_ids
    assert got["tokens"] == ref and len(ref) == 6


def test_a_model_past_vm_max_map_count_is_refused_in_one_line(many_experts, monkeypatch):
    have = filemap.map_count()
    monkeypatch.setattr(filemap, "max_map_count", lambda: have + LAYERS * EXPERTS)
    with pytest.raises(ModelFormatError) as e:         # the headroom does not fit
        Engine.from_model_dir(many_experts, threads=1)
    msg = str(e.value)
    assert "\n" not in msg and "vm.max_map_count is" in msg and "14,850 files" in msg
    assert filemap.map_count() <= have + 16            # refused before mapping anything
    # copy-in under a budget maps no expert file: the same model loads
    monkeypatch.setattr(filemap, "max_map_count", lambda: have + 100 + filemap.MAP_HEADROOM)
    with Engine.from_model_dir(many_experts, threads=1, load_mode="copy",
                               max_resident_mb=64) as eng:
        assert len(eng.generate([1, 2], max_new_tokens=2, temperature=0).run().token_ids) == 2


def test_a_mapping_outlives_its_file_object_while_a_view_is_alive(tmp_path):
    d = tmp_path / "m"
    write_random_model(d)
    f = ContainerFile(d / "model.bin")
    addr, want = f.base_address, bytes(f.buf[:4096])
    view = f.tensor("final_norm")
    norm = np.array(view)
    f.close()                                          # the view still reads the file
    assert np.array_equal(view, norm) and f"{addr:x}-" in _maps()
    del view
    assert f"{addr:x}-" not in _maps()                 # the last view gone: unmapped
    g = ContainerFile(d / "model.bin")
    assert bytes(g.buf[:4096]) == want == (d / "model.bin").read_bytes()[:4096]
    g.close()


def _maps() -> str:
    return Path("/proc/self/maps").read_text()


def test_kv_pool_default_follows_memory_context_and_row_size(tmp_path):
    d = tmp_path / "m"
    write_random_model(d, context=8192)
    mc, eng_cfg = load_model_config(d / "config.json"), EngineConfig()   # its files' sizes
    model = sum(i.size for i in mc.files.values())
    row = kv_bytes_per_position(mc, "f32")
    assert row == 3 * 2 * 2 * 32 * 4                   # layers x (k, v) x kv heads x d x f32
    # plenty of memory: capped at 65,536 positions (the context is shorter)
    assert kv_pool_tokens(mc, eng_cfg, available=1 << 40) == 65536
    # half of what the model leaves, in positions of the dtype's rows
    avail = model + 2 * 10_000 * row
    assert kv_pool_tokens(mc, eng_cfg, available=avail) == 10_000
    f16 = EngineConfig(kv_dtype="f16")
    assert kv_pool_tokens(mc, f16, available=avail) == 20_000
    # never below one sequence of min(4,096, context) positions; a set value wins
    assert kv_pool_tokens(mc, eng_cfg, available=model) == 4096
    assert kv_pool_tokens(mc, EngineConfig(kv_pool_tokens=7), available=model) == 7
    assert kv_pool_tokens(mc, EngineConfig(max_resident_mb=64), available=model) == 8192


def test_a_small_default_pool_refuses_a_long_request_in_one_line(tmp_path, monkeypatch):
    d = tmp_path / "m"
    write_random_model(d, context=8192)
    import colibri_core.model.kvcache as kvcache
    monkeypatch.setattr(kvcache, "available_bytes", lambda: 0)    # no memory to spare
    with Engine.from_model_dir(d, threads=1) as e:
        assert e.kv_pool.capacity_tokens == 4096
        with pytest.raises(RequestTooLarge, match="kv_pool_tokens=4096"):
            e.generate([1, 2, 3], max_new_tokens=5000).run()


class _F:
    def __init__(self, size):
        self.size = size


def test_preload_reads_the_prefix_of_files_that_fits_in_memory():
    files = [_F(300 << 20), _F(10 << 20)] + [_F(100 << 20) for _ in range(20)]
    assert preload_files(files, available=100 << 30) == files
    # 2 GiB available: 1.5 GiB of room (512 MiB kept) holds 310 MiB + 12 x 100 MiB
    assert preload_files(files, available=2 << 30) == files[:14]
    gib = [_F(1 << 30) for _ in range(10)]     # 8 GiB: an eighth kept, 7 files fit
    assert preload_files(gib, available=8 << 30) == gib[:7]
    assert preload_files(files, available=256 << 20) == []
