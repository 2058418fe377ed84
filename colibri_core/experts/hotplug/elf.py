"""A small ELF64 little-endian reader: enough to check a shared object before loading it.

It reads the file header, the program headers (segments), the section headers, the symbol
tables (.dynsym, then .symtab) and the dynamic relocations, and maps a symbol's virtual
address to its offset in the file, so that constant data can be read without dlopen().

Every header, section and segment is checked against the file size, so a file that is still
being written (its section headers, written last by the linker, are missing) is refused with
`ExpertIncomplete` and never half-read.

Reference: the System V gABI, "Object Files" chapter (Elf64_Ehdr, Elf64_Shdr, Elf64_Phdr,
Elf64_Sym, Elf64_Rela).
"""
from __future__ import annotations

import os
import platform
import struct
import sys
from dataclasses import dataclass

from .errors import ArchitectureMismatch, ElfFormatError, ExpertIncomplete

ELF_MAGIC = b"\x7fELF"
ELFCLASS32, ELFCLASS64 = 1, 2
ELFDATA2LSB, ELFDATA2MSB = 1, 2
ET_DYN = 3
ELFOSABI_SYSV, ELFOSABI_GNU = 0, 3

SHT_NOBITS, SHT_SYMTAB, SHT_DYNSYM, SHT_RELA, SHT_STRTAB = 8, 2, 11, 4, 3
SHN_UNDEF, SHN_XINDEX = 0, 0xFFFF
PT_LOAD = 1
STT_OBJECT, STT_FUNC = 1, 2

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")   # 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")         # 64 bytes
_PHDR = struct.Struct("<IIQQQQQQ")           # 56 bytes
_SYM = struct.Struct("<IBBHQQ")              # 24 bytes
_RELA = struct.Struct("<QQq")                # 24 bytes

# e_machine of the hosts Colibri runs on (64-bit little-endian only).
MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "riscv64": 243,
            "ppc64le": 21, "loongarch64": 258}
MACHINE_NAMES = {3: "i386", 8: "MIPS", 20: "PowerPC", 21: "PowerPC64", 40: "ARM",
                 62: "x86-64", 183: "AArch64", 243: "RISC-V", 258: "LoongArch"}


def host_machine() -> int:
    """e_machine of the running host, or raise ArchitectureMismatch for unsupported hosts."""
    m = platform.machine().lower()
    if m not in MACHINES or sys.byteorder != "little" or struct.calcsize("P") != 8:
        raise ArchitectureMismatch(
            f"host {platform.machine()} ({sys.byteorder}-endian, {8 * struct.calcsize('P')}-bit)"
            " is not supported by the hot-plug loader: expected a 64-bit little-endian host")
    return MACHINES[m]


def machine_name(e_machine: int) -> str:
    return f"{e_machine} ({MACHINE_NAMES.get(e_machine, 'unknown')})"


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class Segment:
    type: int
    offset: int
    vaddr: int
    filesz: int
    memsz: int


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int       # virtual address (for a shared object: relative to its load base)
    size: int
    type: int        # STT_*
    bind: int        # STB_*
    shndx: int       # section index, SHN_UNDEF for an undefined (imported) symbol
    dynamic: bool    # found in .dynsym (exported) rather than only in .symtab

    @property
    def defined(self) -> bool:
        return self.shndx != SHN_UNDEF


MAX_EXPERT_FILE = 1 << 30   # an expert .so larger than this is refused before it is read


def _read_all(fd: int, path: str) -> bytes:
    """The file's bytes as fstat sizes it (pread: the descriptor's offset is left alone);
    fewer if it shrinks meanwhile (then its headers say it is incomplete)."""
    size = os.fstat(fd).st_size
    if size > MAX_EXPERT_FILE:
        raise ElfFormatError(f"{path}: {size} bytes, larger than an expert file may be "
                             f"({MAX_EXPERT_FILE} bytes)", path=path)
    parts, off = [], 0
    while off < size:
        chunk = os.pread(fd, min(1 << 20, size - off), off)
        if not chunk:
            break
        parts.append(chunk)
        off += len(chunk)
    return b"".join(parts)


class ElfFile:
    """A parsed ELF64 little-endian shared object, read into memory (call close()).

    Read, not mapped: the file may sit in the watched folder, where anyone may truncate it
    while it is parsed, and a mapped page that is gone would kill the process (SIGBUS);
    a short read is just an incomplete file."""

    def __init__(self, path: str | os.PathLike, *, fd: int | None = None):
        """`fd`: a descriptor of the file already open for reading (kept open); else the
        path is opened."""
        self.path = os.fspath(path)
        self._mm: bytes | None = None
        if fd is not None:
            self._mm = _read_all(fd, self.path)
        else:
            with open(self.path, "rb") as f:
                self._mm = _read_all(f.fileno(), self.path)
        self.size = len(self._mm)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- lifecycle
    def close(self) -> None:
        self._mm = None

    def __enter__(self) -> "ElfFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- raw access
    def read(self, offset: int, size: int, what: str = "data") -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ExpertIncomplete(
                f"{self.path}: {what} at bytes {offset}..{offset + size} lies past the end of"
                f" the file ({self.size} bytes): file incomplete or truncated", path=self.path)
        if self._mm is None:
            return b""
        return self._mm[offset:offset + size]

    # -- parsing
    def _parse(self) -> None:
        p = self.path
        head = self.read(0, min(self.size, 16), "ELF identification")
        if not (ELF_MAGIC.startswith(head) if len(head) < 4 else head[:4] == ELF_MAGIC):
            raise ElfFormatError(f"{p}: not an ELF file (magic {head[:4]!r}, expected"
                                 f" {ELF_MAGIC!r})", path=p)
        if len(head) < 16:
            raise ExpertIncomplete(f"{p}: only {self.size} bytes, shorter than an ELF"
                                   " header: file incomplete", path=p)
        self.elf_class, self.data_order, self.osabi = head[4], head[5], head[7]
        if self.elf_class != ELFCLASS64:
            bits = {ELFCLASS32: "32-bit"}.get(self.elf_class, f"class {self.elf_class}")
            raise ArchitectureMismatch(f"{p}: {bits} ELF, expected a 64-bit ELF (ELFCLASS64)"
                                       " for this host", path=p)
        if self.data_order != ELFDATA2LSB:
            raise ArchitectureMismatch(f"{p}: big-endian ELF, expected little-endian"
                                       " (ELFDATA2LSB) for this host", path=p)
        (_, self.e_type, self.e_machine, _, _, phoff, shoff, _, _, phentsize, phnum,
         shentsize, shnum, shstrndx) = _EHDR.unpack(self.read(0, _EHDR.size, "ELF header"))
        if self.e_type != ET_DYN:
            raise ElfFormatError(f"{p}: ELF type {self.e_type}, expected a shared object"
                                 " (ET_DYN, built with -shared)", path=p)
        if shoff == 0:
            raise ElfFormatError(f"{p}: no section headers, expected a linked shared object"
                                 " with .dynsym", path=p)
        if shentsize != _SHDR.size or (phnum and phentsize != _PHDR.size):
            raise ElfFormatError(f"{p}: header entry sizes {shentsize}/{phentsize}, expected"
                                 f" {_SHDR.size}/{_PHDR.size}", path=p)

        # Segments.
        self.segments: list[Segment] = []
        for i in range(phnum):
            t, _, off, va, _, fsz, msz, _ = _PHDR.unpack(
                self.read(phoff + i * _PHDR.size, _PHDR.size, "program header"))
            seg = Segment(t, off, va, fsz, msz)
            if t == PT_LOAD:
                self.read(off, 0, "segment")
                if off + fsz > self.size:
                    self.read(off, fsz, f"PT_LOAD segment {i}")
            self.segments.append(seg)

        # Sections (with extended numbering: e_shnum/e_shstrndx overflow into section 0).
        first = _SHDR.unpack(self.read(shoff, _SHDR.size, "section header table"))
        if shnum == 0:
            shnum = first[5]
        if shstrndx == SHN_XINDEX:
            shstrndx = first[6]
        raw = [_SHDR.unpack(self.read(shoff + i * _SHDR.size, _SHDR.size, "section header"))
               for i in range(shnum)]
        for i, r in enumerate(raw):
            if r[1] != SHT_NOBITS:
                self.read(r[4], 0, f"section {i}")
                if r[4] + r[5] > self.size:
                    self.read(r[4], r[5], f"section {i}")
        if not 0 < shstrndx < shnum:
            raise ElfFormatError(f"{p}: section-name table index {shstrndx} out of range"
                                 f" (0..{shnum})", path=p)
        names = self.read(raw[shstrndx][4], raw[shstrndx][5], "section names")
        self.sections = [Section(_cstr(names, r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[9])
                         for r in raw]

        # Symbols: .dynsym (exported) first, then .symtab for what it adds.
        self.symbols: dict[str, Symbol] = {}
        for want in (SHT_DYNSYM, SHT_SYMTAB):
            for sec in self.sections:
                if sec.type == want:
                    self._read_symbols(sec, dynamic=want == SHT_DYNSYM)

    def _read_symbols(self, sec: Section, dynamic: bool) -> None:
        if sec.entsize != _SYM.size or not 0 < sec.link < len(self.sections):
            raise ElfFormatError(f"{self.path}: symbol table {sec.name} has entry size"
                                 f" {sec.entsize} / string table {sec.link}, expected"
                                 f" {_SYM.size} / a valid index", path=self.path)
        strtab = self.sections[sec.link]
        strings = self.read(strtab.offset, strtab.size, f"{strtab.name}")
        table = self.read(sec.offset, sec.size, sec.name)
        for i in range(1, sec.size // _SYM.size):
            st_name, info, _, shndx, value, size = _SYM.unpack_from(table, i * _SYM.size)
            name = _cstr(strings, st_name)
            if not name or name in self.symbols and (self.symbols[name].defined
                                                     or shndx == SHN_UNDEF):
                continue
            self.symbols[name] = Symbol(name, value, size, info & 0xF, info >> 4, shndx,
                                        dynamic)

    # -- queries
    def symbol(self, name: str) -> Symbol | None:
        sym = self.symbols.get(name)
        return sym if sym is not None and sym.defined else None

    def file_offset(self, vaddr: int, size: int, what: str) -> int:
        """File offset of [vaddr, vaddr+size) through the PT_LOAD segment that holds it."""
        for seg in self.segments:
            if seg.type == PT_LOAD and seg.vaddr <= vaddr and vaddr + size <= seg.vaddr + seg.memsz:
                if vaddr + size > seg.vaddr + seg.filesz:
                    raise ElfFormatError(f"{self.path}: {what} lies in zero-filled memory"
                                         " (.bss) and has no bytes in the file: expected"
                                         " initialized constant data", path=self.path)
                return seg.offset + (vaddr - seg.vaddr)
        raise ElfFormatError(f"{self.path}: {what} at address {vaddr:#x} is in no loadable"
                             " segment", path=self.path)

    def symbol_offset(self, sym: Symbol) -> int:
        return self.file_offset(sym.value, sym.size, f"symbol {sym.name}")

    def symbol_bytes(self, sym: Symbol) -> bytes:
        return self.read(self.symbol_offset(sym), sym.size, f"symbol {sym.name}")

    def relocated(self, vaddr: int, size: int) -> bool:
        """True when a dynamic relocation writes inside [vaddr, vaddr+size)."""
        for sec in self.sections:
            if sec.type != SHT_RELA or sec.entsize != _RELA.size:
                continue
            table = self.read(sec.offset, sec.size, sec.name)
            for i in range(sec.size // _RELA.size):
                r_offset = _RELA.unpack_from(table, i * _RELA.size)[0]
                if vaddr - 8 < r_offset < vaddr + size:
                    return True
        return False


def check_host(elf: ElfFile) -> None:
    """Refuse an ELF built for another machine or OS ABI than the running host."""
    want = host_machine()
    if elf.e_machine != want:
        raise ArchitectureMismatch(
            f"{elf.path}: ELF machine {machine_name(elf.e_machine)}, expected"
            f" {machine_name(want)} for this host ({platform.machine()})", path=elf.path)
    if elf.osabi not in (ELFOSABI_SYSV, ELFOSABI_GNU):
        raise ArchitectureMismatch(f"{elf.path}: ELF OS ABI {elf.osabi}, expected 0 (System V)"
                                   " or 3 (GNU/Linux)", path=elf.path)


def _cstr(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    if offset >= len(table) or end < 0:
        return ""
    return table[offset:end].decode("utf-8", "replace")
