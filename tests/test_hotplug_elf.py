"""ELF reader and metadata checks on real shared objects built with the real compiler."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from colibri_core.experts.hotplug.authoring.builder import compile_shared
from colibri_core.experts.hotplug.elf import ElfFile, host_machine
from colibri_core.experts.hotplug.errors import (ArchitectureMismatch, ElfFormatError, ExpertAbiError,
                                         ExpertIncomplete, ExpertMetadataError)
from colibri_core.experts.hotplug.meta import META_SIZE, MAGIC, read_expert_file
from colibri_core.experts.hotplug.authoring.testing import compile_test_expert

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

H = 64


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return compile_test_expert(tmp_path_factory.mktemp("elf") / "good.so", hidden=H, layer=3,
                               name="fraud_a", version="1.2.3")


def patched(src, dst, offset: int, data: bytes):
    raw = bytearray(src.read_bytes())
    raw[offset:offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_reads_symbols_and_maps_them_to_file_offsets(good):
    with ElfFile(good) as elf:
        assert elf.e_machine == host_machine()
        meta = elf.symbol("colibri_expert_meta")
        row = elf.symbol("colibri_router_row")
        fwd = elf.symbol("ffn_forward")
        assert meta.size == META_SIZE and meta.dynamic
        assert row.size == 4 * H and fwd.dynamic and fwd.type == 2
        assert struct.unpack_from("<I", elf.symbol_bytes(meta))[0] == MAGIC
        values = np.frombuffer(elf.symbol_bytes(row), "<f4")
    expected = np.zeros(H, np.float32)
    expected[0], expected[-1] = 1.0, -1.0
    np.testing.assert_array_equal(values, expected)
    # The offsets agree with binutils' view of the same file.
    out = subprocess.run(["readelf", "-W", "--dyn-syms", str(good)], capture_output=True,
                         text=True).stdout if shutil.which("readelf") else ""
    if out:
        line = next(ln for ln in out.splitlines() if ln.endswith(" colibri_router_row"))
        assert int(line.split()[1], 16) == row.value


def test_metadata_is_read_without_loading(good):
    info = read_expert_file(str(good), H, {1, 3})
    m = info.meta
    assert (m.name, m.version, m.layers, m.hidden_size) == ("fraud_a", "1.2.3", (3,), H)
    assert m.router_bias == 0.5 and m.thread_safe and not m.has_q4 and info.q4 is None
    assert "gcc" in m.target and "-O2" in m.target
    assert info.router_row.nbytes == 4 * H


def test_wrong_machine_is_refused(good, tmp_path):
    bad = patched(good, tmp_path / "arm.so", 18, struct.pack("<H", 183 if host_machine()
                                                               != 183 else 62))
    with pytest.raises(ArchitectureMismatch, match="ELF machine .* expected"):
        read_expert_file(str(bad), H, {3})


def test_32bit_and_big_endian_elf_are_refused(good, tmp_path):
    with pytest.raises(ArchitectureMismatch, match="32-bit ELF"):
        read_expert_file(str(patched(good, tmp_path / "e32.so", 4, b"\x01")), H, {3})
    with pytest.raises(ArchitectureMismatch, match="big-endian"):
        read_expert_file(str(patched(good, tmp_path / "be.so", 5, b"\x02")), H, {3})


@pytest.mark.parametrize("keep", [0, 3, 10, 64, 0.5, -1])
def test_truncated_file_is_incomplete(good, tmp_path, keep):
    raw = good.read_bytes()
    n = int(len(raw) * keep) if isinstance(keep, float) else keep % len(raw)
    (tmp_path / "t.so").write_bytes(raw[:n])
    with pytest.raises(ExpertIncomplete):
        read_expert_file(str(tmp_path / "t.so"), H, {3})


def test_not_an_elf_and_not_a_shared_object(tmp_path):
    (tmp_path / "x.so").write_bytes(b"#!/bin/sh\necho hi\n" * 10)
    with pytest.raises(ElfFormatError, match="not an ELF") as e:
        read_expert_file(str(tmp_path / "x.so"), H, {3})
    assert not isinstance(e.value, ExpertIncomplete)
    (tmp_path / "main.c").write_text("int main(void){return 0;}\n")
    subprocess.run(["gcc", "-no-pie", "-o", str(tmp_path / "exe"), str(tmp_path / "main.c")],
                   check=True)
    with pytest.raises(ElfFormatError, match="shared object"):
        read_expert_file(str(tmp_path / "exe"), H, {3})


def test_wrong_abi_version_is_refused(tmp_path):
    so = compile_test_expert(tmp_path / "abi.so", abi=99)
    with pytest.raises(ExpertAbiError, match="ABI version 99, expected one of \\[1, 2\\]"):
        read_expert_file(str(so), H, {1})


def test_model_mismatches_are_refused(good):
    with pytest.raises(ExpertMetadataError, match="hidden_size 64, expected .* 128"):
        read_expert_file(str(good), 128, {3})
    with pytest.raises(ExpertMetadataError, match="layer\\(s\\) \\[3\\] are not MoE layers"):
        read_expert_file(str(good), H, {0, 1, 2})


def test_missing_symbols_and_pointer_metadata_are_refused(tmp_path):
    head = "#include \"colibri_expert.h\"\n"
    meta = ("const colibri_expert_meta_t colibri_expert_meta = {.magic = COLIBRI_EXPERT_MAGIC,"
            " .abi_version = 1, .struct_size = 360, .hidden_size = 64, .n_layers = 1,"
            " .layers = {1}, .name = \"m\", .version = \"1\"};\n")
    row = "COLIBRI_EXPORT const float colibri_router_row[64] = {1.0f};\n"
    fwd = "int ffn_forward(const float *x, float *y, int n, int h) { return 0; }\n"
    cases = {
        "nometa": (head + row + fwd, ExpertAbiError, "no 'colibri_expert_meta'"),
        "norow": (head + meta + fwd, ExpertAbiError, "no 'colibri_router_row'"),
        "nofwd": (head + meta + row, ExpertAbiError, "no exported function 'ffn_forward'"),
        "shortrow": (head + meta + fwd +
                     "COLIBRI_EXPORT const float colibri_router_row[32] = {1.0f};\n",
                     ExpertMetadataError, "colibri_router_row is 128 bytes, expected 256"),
        "bssrow": (head + meta + fwd + "COLIBRI_EXPORT float colibri_router_row[64];\n",
                   ElfFormatError, "zero-filled memory"),
        # A 360-byte record holding a pointer: patched by a relocation at load time.
        "pointer": ("#include <stdint.h>\n"
                    "__attribute__((visibility(\"default\"))) const struct {uint32_t w[88];"
                    " const void *p;} __attribute__((packed)) colibri_expert_meta ="
                    " {{0x45584C43u, 1, 360}, &colibri_expert_meta};\n" + fwd,
                    ExpertAbiError, "relocations"),
    }
    for name, (src, err, msg) in cases.items():
        (tmp_path / f"{name}.c").write_text(src)
        so = tmp_path / f"{name}.so"
        compile_shared([tmp_path / f"{name}.c"], so, cflags=("-O1",))
        with pytest.raises(err, match=msg):
            read_expert_file(str(so), H, {1})


def test_a_file_truncated_while_it_is_parsed_cannot_fault(good, tmp_path):
    """The ELF reader works on the bytes it read, never on a mapping of a file in the
    watched folder: truncating that file meanwhile (anyone can) reads as the old bytes,
    not as a bus error."""
    src = tmp_path / "x.so"
    shutil.copyfile(good, src)
    with ElfFile(src) as elf:
        before = elf.symbol_bytes(elf.symbol("colibri_router_row"))
        os.truncate(src, 64)                          # a mapped reader dies of SIGBUS here
        assert elf.symbol_bytes(elf.symbol("colibri_router_row")) == before
