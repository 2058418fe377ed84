"""The expert metadata (`colibri_expert_meta`, include/colibri_expert.h) read from the ELF file.

`read_expert_file(path, hidden_size, moe_layers)` parses the shared object without loading
it, checks it against the host and the model, and returns where each data symbol lives in the
file, so the engine can map the router row and the INT4 weights without copying them.
"""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import numpy as np

from .elf import STT_FUNC, ElfFile, check_host
from .errors import ExpertAbiError, ExpertMetadataError, ModelMismatch

ABI_VERSION = 2            # 2: base_model in what ABI 1 reserved (same 360 bytes), +PORTABLE
SUPPORTED_ABI_VERSIONS = frozenset({1, 2})
MAGIC = 0x45584C43                       # b"CLXE"
MAX_LAYERS = 16
NAME_LEN, VERSION_LEN, TARGET_LEN = 64, 32, 128
FLAG_THREAD_SAFE = 0x1
FLAG_HAS_Q4 = 0x2
FLAG_PORTABLE = 0x4                      # ABI 2: built to run on any model of its shape
KNOWN_FLAGS = FLAG_THREAD_SAFE | FLAG_HAS_Q4
KNOWN_FLAGS_BY_ABI = {1: KNOWN_FLAGS, 2: KNOWN_FLAGS | FLAG_PORTABLE}
BASE_MODEL_LEN = 32                      # sha256 of the model (fingerprint.py), raw bytes

# magic, abi_version, struct_size, flags, hidden, intermediate, group, n_layers,
# layers[16], router_bias, reserved0, name[64], version[32], target[128],
# base_model[32] (ABI 2; ABI 1's reserved[8] u32, zeros)
META_STRUCT = struct.Struct(f"<8I{MAX_LAYERS}ifI{NAME_LEN}s{VERSION_LEN}s{TARGET_LEN}s"
                            f"{BASE_MODEL_LEN}s")
META_SIZE = META_STRUCT.size             # 360
assert META_SIZE == 360

SYM_META = "colibri_expert_meta"
SYM_FORWARD = "ffn_forward"
SYM_ROUTER = "colibri_router_row"
Q4_MATRICES = ("w1", "w3", "w2")
Q4_PARTS = ("data", "scales", "zeros")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")


@dataclass(frozen=True)
class ExpertMeta:
    """The decoded metadata record."""

    abi_version: int
    flags: int
    hidden_size: int
    intermediate_size: int
    group_size: int
    layers: tuple[int, ...]
    router_bias: float
    name: str
    version: str
    target: str
    base_model: str = ""     # hex fingerprint of the model it was built for; "": none

    @property
    def portable(self) -> bool:
        return bool(self.flags & FLAG_PORTABLE)

    @property
    def binding(self) -> str:
        """"bound" (to base_model), "portable", or "unbound" (built before ABI 2)."""
        return "portable" if self.portable else "bound" if self.base_model else "unbound"

    @property
    def thread_safe(self) -> bool:
        return bool(self.flags & FLAG_THREAD_SAFE)

    @property
    def has_q4(self) -> bool:
        return bool(self.flags & FLAG_HAS_Q4)

    def pack(self) -> bytes:
        """The 360 bytes of the C struct (used by the builder and the tests)."""
        layers = list(self.layers) + [0] * (MAX_LAYERS - len(self.layers))
        return META_STRUCT.pack(MAGIC, self.abi_version, META_SIZE, self.flags,
                                self.hidden_size, self.intermediate_size, self.group_size,
                                len(self.layers), *layers, self.router_bias, 0,
                                self.name.encode(), self.version.encode(),
                                self.target.encode(), bytes.fromhex(self.base_model))


@dataclass(frozen=True)
class Part:
    offset: int   # byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class ExpertFileInfo:
    """What the checks found: the metadata and where each data symbol lies in the file."""

    path: str
    size: int
    meta: ExpertMeta
    router_row: Part                    # float32 [hidden]
    q4: dict[str, Part] | None          # "w1.data", "w1.scales", ... when meta.has_q4
    router_file: str | None = None      # the file holding router_row (None: `path`; a
                                        # bundle's router_row.npy, bundle.py)


def q4_part_sizes(hidden: int, inter: int, group: int) -> dict[str, int]:
    """Exact byte size of each q4 part (FORMAT.md layout)."""
    def pad(n: int) -> int:
        return -(-n // group) * group
    out = {}
    for m, (rows, cols) in (("w1", (inter, hidden)), ("w3", (inter, hidden)),
                            ("w2", (hidden, inter))):
        ng = pad(cols) // group
        out[f"{m}.data"] = rows * pad(cols) // 2
        out[f"{m}.scales"] = rows * ng * 4
        out[f"{m}.zeros"] = rows * ng
    return out


def q4_symbol(part: str) -> str:
    m, kind = part.split(".")
    return f"colibri_{m}_{kind}"


def read_expert_file(path: str, hidden_size: int | None = None,
                     moe_layers: set[int] | frozenset[int] | None = None,
                     fingerprint: str | None = None) -> ExpertFileInfo:
    """Parse and check an expert .so without loading it; raise an ExpertRejected subclass."""
    with ElfFile(path) as elf:
        check_host(elf)
        meta = _read_meta(elf)
        check_against_model(path, meta, hidden_size, moe_layers, fingerprint)
        fwd = elf.symbol(SYM_FORWARD)
        if fwd is None or not fwd.dynamic or fwd.type != STT_FUNC:
            raise ExpertAbiError(f"{path}: no exported function {SYM_FORWARD!r}: expected"
                                 " `int ffn_forward(const float*, float*, int, int)` with"
                                 " default visibility", path=path)
        router = _data_part(elf, SYM_ROUTER, 4 * meta.hidden_size,
                            f"float[{meta.hidden_size}] (hidden_size)")
        row = np.frombuffer(elf.read(router.offset, router.nbytes), dtype="<f4")
        if not np.isfinite(row).all():
            raise ExpertMetadataError(f"{path}: {SYM_ROUTER} has non-finite values: expected"
                                      " a finite router row", path=path)
        q4 = None
        if meta.has_q4:
            q4 = {part: _data_part(elf, q4_symbol(part), size, f"{size} bytes (q4 {part})")
                  for part, size in q4_part_sizes(meta.hidden_size, meta.intermediate_size,
                                                  meta.group_size).items()}
        return ExpertFileInfo(path, elf.size, meta, router, q4)


def _read_meta(elf: ElfFile) -> ExpertMeta:
    p = elf.path
    sym = elf.symbol(SYM_META)
    if sym is None:
        fwd = elf.symbol(SYM_FORWARD)
        if fwd is not None and fwd.dynamic and fwd.type == STT_FUNC:
            raise ExpertAbiError(
                f"{p}: no {SYM_META!r} symbol (a .so exporting only {SYM_FORWARD}, as the"
                f" reference design builds it): add the metadata with"
                f" `colibri expert build --from-c SOURCE.c --router-row ROW.npy --layer N`"
                f" (a regular expert .so), or drop it as a bundle: a folder NAME.expert/"
                f" holding this .so, expert.toml (name, version, layers, router_bias) and"
                f" router_row.npy (docs/HOTPLUG.md)", path=p)
        raise ExpertAbiError(f"{p}: no {SYM_META!r} symbol: expected a Colibri expert"
                             " (include colibri_expert.h and define colibri_expert_meta)",
                             path=p)
    if sym.size < 12:
        raise ExpertAbiError(f"{p}: {SYM_META} is {sym.size} bytes, expected {META_SIZE}",
                             path=p)
    raw = elf.symbol_bytes(sym)
    magic, abi, struct_size = struct.unpack_from("<3I", raw)
    if magic != MAGIC:
        raise ExpertAbiError(f"{p}: {SYM_META} magic {magic:#010x}, expected {MAGIC:#010x}"
                             " (\"CLXE\")", path=p)
    if abi not in SUPPORTED_ABI_VERSIONS:
        raise ExpertAbiError(f"{p}: expert ABI version {abi}, expected one of"
                             f" {sorted(SUPPORTED_ABI_VERSIONS)}: rebuild it against this"
                             " engine's colibri_expert.h", path=p)
    if struct_size != META_SIZE or sym.size != META_SIZE:
        raise ExpertAbiError(f"{p}: {SYM_META} is {sym.size} bytes (struct_size field"
                             f" {struct_size}), expected {META_SIZE} for ABI {abi}", path=p)
    if elf.relocated(sym.value, sym.size):
        raise ExpertAbiError(f"{p}: {SYM_META} is patched by dynamic relocations (it holds"
                             " pointers): expected plain constant data", path=p)
    f = META_STRUCT.unpack(raw)
    (_, _, _, flags, hidden, inter, group, n_layers), layers_raw = f[:8], f[8:8 + MAX_LAYERS]
    bias, _, name_b, version_b, target_b, base_b = f[8 + MAX_LAYERS:14 + MAX_LAYERS]
    known = KNOWN_FLAGS_BY_ABI[abi]
    if flags & ~known:
        raise ExpertAbiError(f"{p}: unknown flags {flags & ~known:#x} for ABI {abi}:"
                             f" expected only bits of {known:#x}", path=p)
    if not 1 <= n_layers <= MAX_LAYERS:
        raise ExpertMetadataError(f"{p}: n_layers {n_layers}, expected 1..{MAX_LAYERS}",
                                  path=p)
    layers = tuple(int(v) for v in layers_raw[:n_layers])
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise ExpertMetadataError(f"{p}: layers {list(layers)}, expected distinct global"
                                  " layer indices >= 0", path=p)
    name = _text(p, name_b, "name")
    if not NAME_RE.match(name):
        raise ExpertMetadataError(f"{p}: expert name {name!r}, expected 1-63 characters of"
                                  " [A-Za-z0-9_.-]", path=p)
    version = _text(p, version_b, "version")
    if not version.isprintable():
        raise ExpertMetadataError(f"{p}: version {version!r}, expected printable text",
                                  path=p)
    if not math.isfinite(bias):
        raise ExpertMetadataError(f"{p}: router_bias {bias}, expected a finite float", path=p)
    if flags & FLAG_HAS_Q4:
        if group <= 0 or group % 64 or inter <= 0:
            raise ExpertMetadataError(f"{p}: q4 weights with group_size {group} and"
                                      f" intermediate_size {inter}, expected a positive"
                                      " multiple of 64 and a positive size", path=p)
    base_model = base_b.hex() if abi >= 2 and any(base_b) else ""
    if abi >= 2 and not base_model and not flags & FLAG_PORTABLE:
        raise ExpertMetadataError(f"{p}: base_model is all zeros and flags lack PORTABLE"
                                  f" ({FLAG_PORTABLE:#x}): expected the fingerprint of the model"
                                  " it was built for (`colibri expert build --config NAME`) or"
                                  " COLIBRI_FLAG_PORTABLE", path=p)
    return ExpertMeta(abi, flags, hidden, inter, group, layers, float(bias), name, version,
                      _text(p, target_b, "target"), base_model)


def check_against_model(p: str, meta: ExpertMeta, hidden: int | None,
                         moe_layers, fingerprint: str | None = None) -> None:
    """Refuse an expert this model cannot run: hidden size, layers, and (`fingerprint`: the
    model's, fingerprint.py) an expert bound to another model."""
    if hidden is not None and meta.hidden_size != hidden:
        raise ExpertMetadataError(f"{p}: expert hidden_size {meta.hidden_size}, expected the"
                                  f" model's hidden_size {hidden}", path=p)
    if moe_layers is not None:
        bad = [layer for layer in meta.layers if layer not in moe_layers]
        if bad:
            raise ExpertMetadataError(f"{p}: target layer(s) {bad} are not MoE layers of the"
                                      f" model, expected some of {sorted(moe_layers)}",
                                      path=p)
    if fingerprint and meta.binding == "bound" and meta.base_model != fingerprint:
        raise ModelMismatch(f"{p}: expert {meta.name} {meta.version} was built for model"
                            f" {meta.base_model}, this model is {fingerprint}: rebuild it for"
                            " this model, or build it portable", path=p)


def _data_part(elf: ElfFile, name: str, nbytes: int, expected: str) -> Part:
    p = elf.path
    sym = elf.symbol(name)
    if sym is None:
        raise ExpertAbiError(f"{p}: no {name!r} symbol, expected {expected}", path=p)
    if sym.size != nbytes:
        raise ExpertMetadataError(f"{p}: {name} is {sym.size} bytes, expected {nbytes}"
                                  f" = {expected}", path=p)
    if elf.relocated(sym.value, sym.size):
        raise ExpertAbiError(f"{p}: {name} is patched by dynamic relocations: expected plain"
                             " constant data", path=p)
    offset = elf.symbol_offset(sym)
    elf.read(offset, nbytes, name)
    return Part(offset, nbytes)


def _text(p: str, raw: bytes, field: str) -> str:
    end = raw.find(b"\0")
    if end < 0:
        raise ExpertMetadataError(f"{p}: metadata {field} is not NUL-terminated within"
                                  f" {len(raw)} bytes", path=p)
    try:
        return raw[:end].decode("utf-8")
    except UnicodeDecodeError:
        raise ExpertMetadataError(f"{p}: metadata {field} is not UTF-8", path=p) from None
