"""Structural fuzzing of the ELF metadata reader of hot-plugged experts (hotplug/elf.py):
valid expert .so files with their ELF header, section and program headers, symbol table
entries and expert metadata record set to boundary or random values, flipped or
truncated. The contract and the long-run knobs are those of test_fuzz.py."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from colibri_core.experts.hotplug.errors import ExpertRejected

from fuzz_helpers import fuzz, guarded
from fuzz_helpers import scratch  # noqa: F401  (a fixture)


# ============================================================================ ELF

ELF_FIELDS = {   # Elf64_Ehdr after e_ident: name -> (offset, struct format)
    "e_type": (16, "<H"), "e_machine": (18, "<H"), "e_version": (20, "<I"), "e_entry": (24, "<Q"),
    "e_phoff": (32, "<Q"), "e_shoff": (40, "<Q"), "e_flags": (48, "<I"), "e_ehsize": (52, "<H"),
    "e_phentsize": (54, "<H"), "e_phnum": (56, "<H"), "e_shentsize": (58, "<H"),
    "e_shnum": (60, "<H"), "e_shstrndx": (62, "<H")}
SHDR_FIELDS = [("sh_name", 0, "<I"), ("sh_type", 4, "<I"), ("sh_flags", 8, "<Q"), ("sh_addr", 16, "<Q"),
               ("sh_offset", 24, "<Q"), ("sh_size", 32, "<Q"), ("sh_link", 40, "<I"), ("sh_info", 44, "<I"),
               ("sh_addralign", 48, "<Q"), ("sh_entsize", 56, "<Q")]
PHDR_FIELDS = [("p_type", 0, "<I"), ("p_flags", 4, "<I"), ("p_offset", 8, "<Q"), ("p_vaddr", 16, "<Q"),
               ("p_paddr", 24, "<Q"), ("p_filesz", 32, "<Q"), ("p_memsz", 40, "<Q"), ("p_align", 48, "<Q")]
SYM_FIELDS = [("st_name", 0, "<I"), ("st_info", 4, "<B"), ("st_other", 5, "<B"), ("st_shndx", 6, "<H"),
              ("st_value", 8, "<Q"), ("st_size", 16, "<Q")]
META_FIELDS = [("magic", 0, "<I"), ("abi_version", 4, "<I"), ("struct_size", 8, "<I"), ("flags", 12, "<I"),
               ("hidden", 16, "<I"), ("intermediate", 20, "<I"), ("group", 24, "<I"),
               ("n_layers", 28, "<I"), ("layers[0]", 32, "<i"), ("layers[15]", 92, "<i"),
               ("router_bias", 96, "<f"), ("name[0]", 104, "<B"), ("name[63]", 167, "<B"),
               ("version[0]", 168, "<B"), ("target[127]", 327, "<B")]


class ElfLayout:
    """Where the mutable structures of a valid expert .so lie (from its own headers)."""

    def __init__(self, path: Path):
        from colibri_core.experts.hotplug.elf import SHT_DYNSYM, SHT_SYMTAB, ElfFile
        self.raw = path.read_bytes()
        self.size = len(self.raw)
        r = self.raw
        self.phoff, self.shoff = struct.unpack_from("<QQ", r, 32)
        self.phnum, self.shnum = struct.unpack_from("<H", r, 56)[0], struct.unpack_from("<H", r, 60)[0]
        with ElfFile(path) as elf:
            self.symtabs = [(s.offset, s.size // 24) for s in elf.sections if s.type in (SHT_DYNSYM, SHT_SYMTAB)]
            self.symbols = {}
            for s in elf.sections:
                if s.type in (SHT_DYNSYM, SHT_SYMTAB):
                    strtab = elf.sections[s.link]
                    names = r[strtab.offset:strtab.offset + strtab.size]
                    for i in range(1, s.size // 24):
                        st_name = struct.unpack_from("<I", r, s.offset + 24 * i)[0]
                        end = names.find(b"\0", st_name)
                        nm = names[st_name:end].decode("utf-8", "replace")
                        if nm.startswith("colibri_") or nm == "ffn_forward":
                            self.symbols.setdefault(nm, []).append(s.offset + 24 * i)
            meta = elf.symbol("colibri_expert_meta")
            self.meta_off = elf.symbol_offset(meta)


def _elf_values(bits_fmt: str, size: int, orig: int):
    n = struct.calcsize(bits_fmt)
    if bits_fmt == "<f":
        return st.one_of(st.floats(width=32), st.sampled_from([float("nan"), float("inf"), 0.0]))
    signed = bits_fmt[-1].islower() and bits_fmt[-1] not in "BHIQ"
    lo, hi = (-(1 << (8 * n - 1)), (1 << (8 * n - 1)) - 1) if signed else (0, (1 << (8 * n)) - 1)
    edges = [v for v in {0, 1, 2, 3, 16, 24, 56, 64, 360, 4096, size - 1, size, size + 1, size * 2,
                         orig - 1, orig + 1, orig + 24, orig * 2, hi, hi - 1, hi // 2, hi // 2 + 1,
                         lo, 0xFFFF, 0xFF00, 0x7FFFFFFF} if lo <= v <= hi]
    return st.one_of(st.sampled_from(sorted(edges)), st.integers(lo, hi))


@st.composite
def mutated_elf(draw, lay: ElfLayout):
    raw = bytearray(lay.raw)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["ehdr", "ident", "shdr", "shdr", "phdr", "sym", "sym", "meta",
                                     "meta", "bytes", "truncate"]))
        if kind == "ident":
            if len(raw) >= 16:
                raw[draw(st.integers(0, 15))] = draw(st.integers(0, 255))
            continue
        if kind == "truncate":
            cut = draw(st.sampled_from([0, 3, 4, 15, 16, 63, 64, lay.shoff, lay.shoff + 1,
                                        lay.size - 1, lay.meta_off + 100]))
            del raw[min(cut, len(raw)):]
            continue
        if kind == "bytes":
            if raw:
                for _ in range(draw(st.integers(1, 16))):
                    raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
            continue
        if kind == "ehdr":
            name = draw(st.sampled_from(sorted(ELF_FIELDS)))
            off, fmt = ELF_FIELDS[name]
        elif kind == "shdr":
            i = draw(st.integers(0, max(0, lay.shnum - 1)))
            _, rel, fmt = draw(st.sampled_from(SHDR_FIELDS))
            off = lay.shoff + 64 * i + rel
        elif kind == "phdr":
            i = draw(st.integers(0, max(0, lay.phnum - 1)))
            _, rel, fmt = draw(st.sampled_from(PHDR_FIELDS))
            off = lay.phoff + 56 * i + rel
        elif kind == "sym":
            name = draw(st.sampled_from(sorted(lay.symbols)))
            base = draw(st.sampled_from(lay.symbols[name]))
            _, rel, fmt = draw(st.sampled_from(SYM_FIELDS))
            off = base + rel
        else:
            _, rel, fmt = draw(st.sampled_from(META_FIELDS))
            off = lay.meta_off + rel
        n = struct.calcsize(fmt)
        if off + n > len(raw):
            continue
        orig = struct.unpack_from(fmt, raw, off)[0]
        val = draw(_elf_values(fmt, lay.size, int(orig) if fmt != "<f" else 0))
        struct.pack_into(fmt, raw, off, val)
    return bytes(raw)


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """Two valid experts: the C test expert (no q4 weights) and a built one (q4 symbols)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    d = tmp_path_factory.mktemp("elf")
    a = compile_test_expert(d / "plain.so", hidden=128, layer=1, name="plain")
    rng = np.random.default_rng(0)
    np.savez(d / "w.npz", w1=rng.standard_normal((64, 128)), w3=rng.standard_normal((64, 128)),
             w2=rng.standard_normal((128, 64)), router_row=rng.standard_normal(128).astype(np.float32))
    build_expert(d / "w.npz", d / "q4.so", layer=2, name="q4", version="1",
                 portable=True)
    return {"plain": ElfLayout(a), "q4": ElfLayout(d / "q4.so")}


def test_valid_experts_read(experts, scratch):
    from colibri_core.experts.hotplug.meta import read_expert_file
    for name, lay in experts.items():
        p = scratch / f"ok-{name}.so"
        p.write_bytes(lay.raw)
        info = read_expert_file(str(p), 128, {1, 2})
        assert info.meta.name == name and (info.q4 is not None) == (name == "q4")


@fuzz(500)
@given(data=st.data())
def test_fuzz_expert_elf(experts, scratch, data):
    from colibri_core.experts.hotplug.elf import ElfFile
    from colibri_core.experts.hotplug.meta import read_expert_file
    which = data.draw(st.sampled_from(sorted(experts)))
    raw = data.draw(mutated_elf(experts[which]))
    p = scratch / f"fuzz-{which}.so"
    p.write_bytes(raw)

    def go():
        with ElfFile(p) as elf:                 # the reader on its own
            for s in list(elf.symbols.values())[:50]:
                if s.defined and s.size < (1 << 20):
                    try:
                        elf.symbol_bytes(s)
                    except ExpertRejected:
                        pass
        return read_expert_file(str(p), 128, {1, 2})
    got = guarded("expert .so: ELF + metadata", go, (ExpertRejected,))
    if not isinstance(got, BaseException):
        assert got.meta.hidden_size == 128 and got.router_row.offset + got.router_row.nbytes <= len(raw)
        for part in (got.q4 or {}).values():
            assert 0 <= part.offset and part.offset + part.nbytes <= len(raw)
