"""A warm start's per-file costs (issue 30: Qwen3-30B-A3B opens 6,144 expert files).

Whether a file of 2 MB or more is cached past its header (then its header's pages are kept)
is asked of two pages, the first after the header and the last of the first 2 MB, not of
all 511 (mincore over the whole range was 0.5 s of a warm Engine() at that size)."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from colibri_core.format.container import HUGE_PAGE, _cached_after
from colibri_core.format.modelfile import ContainerFile, write_container
from colibri_core.format.quant import quantize_q4
from colibri_core.memstat import drop_file_cache, file_cache_bytes, resident_bytes


@pytest.fixture()
def big(tmp_path):
    w = quantize_q4(np.random.default_rng(2).standard_normal((8192, 1024)).astype(np.float32), 128)
    path = tmp_path / "big.bin"
    write_container(path, [("w", w)])
    drop_file_cache(path, sync=True)
    if file_cache_bytes(path):
        pytest.skip("posix_fadvise(DONTNEED) drops nothing on this file system")
    return path, w


def _read_page(path, off: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)     # that page only, no readahead
        os.pread(fd, 4096, off)
    finally:
        os.close(fd)


def _head(path) -> int:
    f = ContainerFile(path)
    try:
        return f.tensor("w").data.ctypes.data - f.base_address
    finally:
        f.close()


@pytest.mark.parametrize("where", ["after_header", "end_of_2mb", "cold", "middle"])
def test_which_pages_say_warm(big, where):
    path, w = big
    head = _head(path)                       # opening it cold dropped its header again
    drop_file_cache(path, sync=True)
    pages = {"after_header": [head], "end_of_2mb": [HUGE_PAGE - 4096], "cold": [],
             "middle": [HUGE_PAGE // 2]}[where]
    for off in pages:
        _read_page(path, off)
    if pages and not resident_bytes_of(path, pages[0]):
        pytest.skip("a 4 KB pread cached more or less than its page here")
    f = ContainerFile(path)
    try:
        kept = resident_bytes(f.base_address, head) == head
        # the two probed pages decide; a page between them alone does not (the cost of
        # asking two pages, not 511: a warm file holds both)
        assert kept == (where in ("after_header", "end_of_2mb")), where
        assert _cached_after(f._mm, head) == kept
        np.testing.assert_array_equal(f.tensor("w").data, w.data)
    finally:
        f.close()


def resident_bytes_of(path, off: int) -> bool:
    """Whether the page at `off` is cached (mincore through a plain mapping: opening a
    ContainerFile would read and maybe drop its header)."""
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    try:
        a = np.frombuffer(mm, np.uint8)
        got = resident_bytes(a.ctypes.data + off, 4096) > 0
        del a
        return got
    finally:
        mm.close()


# ----------------------------------------------------------------------------- expert tables

def test_a_shared_expert_table_is_checked_once(shared_table_model_dir, monkeypatch):
    """The 24 expert files share one table: its shapes are checked against the config once,
    and every file still gets views of its own bytes."""
    from colibri_core.format import modelfile
    from colibri_core.model import weights
    from colibri_core.model.weights import load_model
    calls = []
    real = weights._check_expert_table
    monkeypatch.setattr(weights, "_check_expert_table",
                        lambda f, h, i: calls.append(f.path) or real(f, h, i))
    modelfile._TABLES.clear()
    weights._CHECKED_TABLES.clear()
    m = load_model(shared_table_model_dir)
    try:
        experts = [x for L in m.layers for x in L.experts]
        assert len(experts) == 24 and len(calls) == 1, calls
        assert len({id(x.file.sections) for x in experts}) == 1
        for x in experts:
            raw = open(x.file.path, "rb").read()
            off, n = x.file.sections["w2"].parts["data"]
            assert bytes(np.asarray(x.ffn.w2.data).reshape(-1)) == raw[off:off + n]
    finally:
        m.close()


def test_a_checked_table_is_still_refused_for_another_shape(shared_table_model_dir):
    """A table checked for one (hidden, inter) is checked again for another, and refused
    naming the file and the section."""
    from colibri_core.errors import ModelFormatError
    from colibri_core.model.weights import expert_ffn, load_model
    m = load_model(shared_table_model_dir)
    try:
        f = m.layers[1].experts[0].file
        assert expert_ffn(f, 64, 64) is not None            # the checked shape
        with pytest.raises(ModelFormatError, match=r"expert_1_0\.bin: section 'w1' has shape"):
            expert_ffn(f, 64, 128)
    finally:
        m.close()
