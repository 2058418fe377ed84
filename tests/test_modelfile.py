"""The container format and the model-directory reader: alignment, jump table, copy-in
mode, and refusal of damaged files with one clear line."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

from colibri_core.errors import ExpertIndexError, ModelFormatError
from colibri_core.format.modelfile import ALIGN, ContainerFile, write_container
from colibri_core.format.quant import quantize_q4, quantize_q6
from colibri_core.model.weights import load_model, verify_checksums


def test_roundtrip_and_alignment(tmp_path):
    rng = np.random.default_rng(0)
    w = quantize_q4(rng.standard_normal((37, 300)), 128)
    v = rng.standard_normal(11).astype(np.float32)
    h = rng.standard_normal((3, 5)).astype(np.float16)
    write_container(tmp_path / "a.bin", [("w", w), ("v", v), ("h", h)])
    for mode in ("mmap", "copy"):
        f = ContainerFile(tmp_path / "a.bin", mode)
        for s in f.sections.values():
            for off, _ in s.parts.values():
                assert off % ALIGN == 0
        t = f.tensor("w")
        assert (t.data == w.data).all() and (t.scales == w.scales).all() and (t.zeros == w.zeros).all()
        assert (f.tensor("v") == v).all() and (f.tensor("h") == h).all()
        # zero-copy: the view's address lies inside the mapped/copied buffer
        assert f.base_address <= t.data.ctypes.data < f.base_address + f.size
        f.close()


def test_q6_sections_are_format_1_1_and_others_stay_1_0(tmp_path):
    """A q6 section makes its file (and the model directory) minor version 1; a file
    without one is written as 1.0, byte for byte what a 1.0 writer gave. Both read back."""
    rng = np.random.default_rng(1)
    w6 = quantize_q6(rng.standard_normal((37, 300)), 128)
    v = rng.standard_normal(11).astype(np.float32)
    assert write_container(tmp_path / "six.bin", [("w", w6), ("v", v)]) == 1
    assert write_container(tmp_path / "four.bin", [("v", v)]) == 0
    assert struct.unpack_from("<HH", (tmp_path / "six.bin").read_bytes(), 8) == (1, 1)
    assert struct.unpack_from("<HH", (tmp_path / "four.bin").read_bytes(), 8) == (1, 0)
    f = ContainerFile(tmp_path / "six.bin")
    t = f.tensor("w")
    assert f.sections["w"].dtype == "q6" and t.data.shape == (37, 384 // 64 * 48)
    assert (t.data == w6.data).all() and (t.zeros == w6.zeros).all() and (t.scales == w6.scales).all()
    f.close()
    # a reader refuses a q6 section whose part sizes do not match its shape
    raw = bytearray((tmp_path / "six.bin").read_bytes())
    tlen = struct.unpack_from("<I", raw, 12)[0]
    table = json.loads(raw[16:16 + tlen])
    table["sections"][0]["shape"] = [37, 400]
    new = json.dumps(table, separators=(",", ":")).encode().ljust(tlen)
    raw[16:16 + tlen] = new
    (tmp_path / "bad.bin").write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=r"section 'w': part 'data' has \d+ bytes, expected"):
        ContainerFile(tmp_path / "bad.bin")


def test_model_dir_with_q6_head_is_1_1(tmp_path):
    from colibri_core.model.testing import write_random_model
    cfg = write_random_model(tmp_path / "m6", head="q6")
    assert (cfg.format.major, cfg.format.minor) == (1, 1)
    cfg = write_random_model(tmp_path / "m8")
    assert (cfg.format.major, cfg.format.minor) == (1, 0)
    w = load_model(tmp_path / "m6")
    assert type(w.lm_head).__name__ == "Q6Tensor"
    w.close()


def test_jump_table_addresses_are_computed(tiny_model_dir):
    w = load_model(tiny_model_dir)
    ex = w.layers[1].experts[3]
    assert ex.name == "expert_1_3"
    assert ex.ffn.w1.data.ctypes.data == ex.address + ex.file.sections["w1"].parts["data"][0]
    offs = [tuple(e.file.sections["w2"].parts["data"]) for lw in w.layers if lw.kind == "moe" for e in lw.experts]
    assert len(set(offs)) == 1          # every expert file has the same layout
    w.close()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_file_refused(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    with open(d / "expert_1_2.bin", "r+b") as f:
        f.truncate(os.path.getsize(d / "expert_1_2.bin") - 100)
    with pytest.raises(ModelFormatError, match=r"expert_1_2.bin: size \d+ bytes, config.json records \d+"):
        load_model(d)


def test_missing_file_refused(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "routing.bin").unlink()
    with pytest.raises(ModelFormatError, match="routing.bin: missing"):
        load_model(d)


def test_corruption_found_by_verify(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    with open(d / "expert_2_0.bin", "r+b") as f:
        f.seek(ALIGN + 10)
        b = f.read(1)
        f.seek(ALIGN + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    load_model(d).close()                      # sizes fine: loads (checksums are opt-in)
    problems = verify_checksums(d)
    assert len(problems) == 1 and "expert_2_0.bin: sha256 mismatch" in problems[0]


def test_bad_magic_and_version(tmp_path):
    write_container(tmp_path / "a.bin", [("v", np.zeros(3, np.float32))])
    raw = bytearray((tmp_path / "a.bin").read_bytes())
    bad = bytearray(raw)
    bad[:8] = b"NOTCOLIB"
    (tmp_path / "b.bin").write_bytes(bad)
    with pytest.raises(ModelFormatError, match="not a Colibri file"):
        ContainerFile(tmp_path / "b.bin")
    struct.pack_into("<H", raw, 8, 2)
    (tmp_path / "c.bin").write_bytes(raw)
    with pytest.raises(ModelFormatError, match=r"format version 2.0 is not readable"):
        ContainerFile(tmp_path / "c.bin")


def test_table_pointing_past_the_end_refused(tmp_path):
    write_container(tmp_path / "a.bin", [("v", np.zeros(3000, np.float32))])
    (tmp_path / "a.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:ALIGN + 100])
    with pytest.raises(ModelFormatError, match="past the end of the file"):
        ContainerFile(tmp_path / "a.bin")


def test_top_k_beyond_experts_is_fatal(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["top_k"] = 9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExpertIndexError, match=r"^FATAL: expert index out of bounds: top_k=9 .*'top_k' field"):
        load_model(d)


def test_shape_mismatch_names_section(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"section 'w1' has shape \[128, 128\], expected \[64, 128\]"):
        load_model(d)


def test_large_files_are_written_out_of_the_page_cache(tmp_path):
    """write_container syncs a file of 2 MB or more and drops it from the page cache, so
    that the engine's first load reads it in 2 MB folios (modelfile.py, "2 MB pages");
    a smaller file stays cached. Where the file system keeps pages whatever is asked
    (tmpfs), there is nothing to check."""
    from colibri_core.memstat import drop_file_cache, file_cache_bytes
    rng = np.random.default_rng(0)
    big = quantize_q4(rng.standard_normal((4096, 1024)).astype(np.float32), 128)   # ~2.2 MB
    small = quantize_q4(rng.standard_normal((64, 1024)).astype(np.float32), 128)
    write_container(tmp_path / "big.bin", [("w", big)])
    write_container(tmp_path / "small.bin", [("w", small)])
    size = (tmp_path / "big.bin").stat().st_size
    assert size >= 2 << 20
    cached_big = file_cache_bytes(tmp_path / "big.bin")
    assert file_cache_bytes(tmp_path / "small.bin") > 0
    drop_file_cache(tmp_path / "small.bin", sync=True)
    if file_cache_bytes(tmp_path / "small.bin") > 0:
        pytest.skip("this file system keeps pages in the page cache when asked to drop them")
    assert cached_big == 0, (cached_big, size)
    f = ContainerFile(tmp_path / "big.bin")          # the header's pages are dropped again
    assert file_cache_bytes(tmp_path / "big.bin") == 0
    np.testing.assert_array_equal(f.tensor("w").data, big.data)
    f.close()


def test_preload_rereads_a_file_cached_in_small_folios(tmp_path):
    """A weights file the page cache holds in 4 KB folios (read by something else with
    readahead off) stays mapped in 4 KB pages whatever MADV_HUGEPAGE says; the no-budget
    preload drops it and reads it again, in 2 MB folios where the file system has large
    folios (residency.py, _reread_small_folios). The bytes are unchanged."""
    from types import SimpleNamespace
    from colibri_core.memstat import (MADV_POPULATE_READ, drop_file_cache, file_pmd_mapped,
                                      madvise)
    from colibri_core.format.modelfile import HUGE_PAGE, MADV_HUGEPAGE
    from colibri_core.experts.residency import Residency
    rng = np.random.default_rng(1)
    big = quantize_q4(rng.standard_normal((8192, 1024)).astype(np.float32), 128)   # ~4.4 MB
    path = tmp_path / "big.bin"
    write_container(path, [("w", big)])
    size = path.stat().st_size
    if not file_pmd_mapped():
        pytest.skip("the kernel does not report FilePmdMapped (/proc/self/smaps)")

    def pmd(f):
        return file_pmd_mapped().get(f.base_address, 0)

    def mapped(f):
        f.madvise(MADV_HUGEPAGE)
        madvise(f.base_address, -(-size // 4096) * 4096, MADV_POPULATE_READ)
        return pmd(f)

    f = ContainerFile(path)                 # read cold: are there 2 MB file pages here?
    if mapped(f) == 0:
        f.close()
        pytest.skip("no 2 MB file pages on this file system (no large folios, or THP off)")
    f.close()
    drop_file_cache(path, sync=True)        # cold again, then 4 KB folios, readahead off
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    for off in range(0, size, 4096):
        os.pread(fd, 4096, off)
    os.close(fd)
    f = ContainerFile(path)
    if mapped(f) > 0:
        f.close()
        pytest.skip("4 KB reads with readahead off still gave 2 MB folios here")
    res = Residency(SimpleNamespace(files=[f], layers=[]), None)
    res.preload(MADV_POPULATE_READ)
    assert res.reread_files == 1
    assert pmd(f) >= HUGE_PAGE, pmd(f)
    np.testing.assert_array_equal(f.tensor("w").data, big.data)
    f.close()


def test_the_header_of_a_warm_file_stays_cached(tmp_path):
    """ContainerFile drops the pages its header read left in a cold file of 2 MB or more
    (so the preload can read the file in 2 MB folios), but not in a file already cached
    past its header: that drop would only cost a read at every later load (6,144 of them
    for Qwen3-30B-A3B's experts)."""
    from colibri_core.memstat import drop_file_cache, resident_bytes
    rng = np.random.default_rng(2)
    big = quantize_q4(rng.standard_normal((8192, 1024)).astype(np.float32), 128)   # ~4.4 MB
    path = tmp_path / "big.bin"
    write_container(path, [("w", big)])
    drop_file_cache(path, sync=True)
    f = ContainerFile(path)                  # cold: the header's pages are dropped again
    head = f.tensor("w").data.ctypes.data - f.base_address   # the first section's offset
    cold = resident_bytes(f.base_address, head)
    f.close()
    if cold:
        pytest.skip("posix_fadvise(DONTNEED) drops nothing on this file system")
    with open(path, "rb") as fh:             # warm: the whole file read, readahead on
        while fh.read(1 << 20):
            pass
    f = ContainerFile(path)
    assert resident_bytes(f.base_address, head) == head
    np.testing.assert_array_equal(f.tensor("w").data, big.data)
    f.close()
