"""Expert bundles: a reference-design expert and its metadata, dropped as one folder.

The reference design builds an expert as a plain C file exporting only `ffn_forward`,
compiled with `gcc -shared -fPIC`: no `colibri_expert_meta`, no `colibri_router_row`. Such
an expert is accepted as a bundle, a folder `NAME.expert/` (moved in with one `mv`)
holding exactly

    one `*.so`        exports `ffn_forward` (docs/HOTPLUG.md), and no colibri_expert_meta
    expert.toml       name, version, layers, optional router_bias, thread_safe, abi_version,
                      base_model (the model's fingerprint) or portable = true (neither: an
                      unbound expert, loaded with a warning)
    router_row.npy    float32 [hidden], the expert's row of the router (np.save)

The bundle provides what the metadata record would: the hidden size is the router row's
length (it must equal the model's), the layers must be MoE layers of the model, the ABI
version is 1 (the `ffn_forward` contract of ABI 1), no INT4 weights. Every other check
applies unchanged, to the folder and to each of its files (symlink, writable, owner,
complete ELF, architecture, allowlist, probe...).

Identity: the sha256 of the text made of one line `<sha256 of the file>  <name>\\n` per
file, sorted by name (byte order) -- what `LC_ALL=C ls | xargs sha256sum | sha256sum`
prints in the bundle folder. It names the staged copy `<staging>/<identity>.expert/` and is
what the allowlist lists. Names allowed inside a bundle: `[A-Za-z0-9_.-]`, not hidden.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import stat
import sys
import threading
from dataclasses import dataclass

import numpy as np

from ...nesting import TooDeep, guarded
from .elf import STT_FUNC, ElfFile, check_host
from .errors import ExpertAbiError, ExpertMetadataError, ExpertRejected, ExpertSecurityError
from .meta import (FLAG_PORTABLE, FLAG_THREAD_SAFE, MAX_LAYERS, NAME_RE, SUPPORTED_ABI_VERSIONS,
                   SYM_FORWARD, SYM_META, VERSION_LEN, ExpertFileInfo, ExpertMeta, Part,
                   check_against_model, read_expert_file)
from .staging import FileChanged, FileSig, check_owner_and_mode, stage_file

BUNDLE_SUFFIX = ".expert"
TOML_NAME = "expert.toml"
ROW_NAME = "router_row.npy"
ENTRY_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
TOML_KEYS = ("name", "version", "layers", "router_bias", "thread_safe", "abi_version",
             "base_model", "portable")
MAX_TOML_BYTES = 64 * 1024


def is_bundle_name(name: str) -> bool:
    """True for a folder name the hot-plug folder treats as a bundle (`x.expert`)."""
    return name.endswith(BUNDLE_SUFFIX) and not name.startswith(".") \
        and len(name) > len(BUNDLE_SUFFIX)


class BundleRefused(ExpertRejected):
    """The bundle folder itself is malformed: missing, extra or misnamed files."""

    reason = "bundle"


@dataclass(frozen=True)
class BundleSig:
    """What 'the bundle did not change' means: the folder's and every entry's FileSig."""

    folder: FileSig
    entries: tuple[tuple[str, FileSig], ...]


def bundle_sig(path: str, st: os.stat_result | None = None) -> BundleSig:
    st = os.lstat(path) if st is None else st
    entries = []
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    for n in names:
        try:
            entries.append((n, FileSig.of(os.lstat(os.path.join(path, n)))))
        except OSError:
            continue                     # gone meanwhile: the next round differs anyway
    return BundleSig(FileSig.of(st), tuple(entries))


def identity_of(hashes: dict[str, str]) -> str:
    """The bundle identity from {file name: sha256 hex} (see the module docstring)."""
    text = "".join(f"{hashes[n]}  {n}\n" for n in sorted(hashes, key=os.fsencode))
    return hashlib.sha256(text.encode()).hexdigest()


def bundle_identity(path: str | os.PathLike) -> str:
    """The identity of a bundle folder (what goes on the allowlist)."""
    path = os.fspath(path)
    hashes = {}
    for n in os.listdir(path):
        h = hashlib.sha256()
        with open(os.path.join(path, n), "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        hashes[n] = h.hexdigest()
    return identity_of(hashes)


def _check_folder(path: str, st: os.stat_result) -> None:
    check_owner_and_mode(path, st, "bundle folder")
    if not stat.S_ISDIR(st.st_mode):
        raise BundleRefused(f"{path}: a *{BUNDLE_SUFFIX} name but not a folder, expected a"
                            f" bundle folder holding one .so, {TOML_NAME} and {ROW_NAME}",
                            path=path)


def check_bundle(path: str, st: os.stat_result) -> str:
    """Refuse a bundle folder that is unsafe or malformed; return the name of its .so.

    The folder and each entry get the checks of a dropped file (symlink, writable, owner,
    regular file); then exactly one `*.so`, expert.toml and router_row.npy must be there;
    the .so must be a complete ELF.
    """
    _check_folder(path, st)
    names = sorted(os.listdir(path))
    for n in names:
        p = os.path.join(path, n)
        est = os.lstat(p)
        check_owner_and_mode(p, est, "file")
        if not stat.S_ISREG(est.st_mode):
            raise ExpertSecurityError(f"{p}: not a regular file, expected a bundle of plain"
                                      " files (no folders, devices or pipes)",
                                      reason="not-regular", path=p)
    sos = [n for n in names if n.endswith(".so")]
    bad = [n for n in names if not ENTRY_RE.match(n)]
    extra = [n for n in names if n not in (TOML_NAME, ROW_NAME) and not n.endswith(".so")]
    missing = [n for n in (TOML_NAME, ROW_NAME) if n not in names]
    if not sos:
        missing.insert(0, "one *.so")
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if len(sos) > 1:
        problems.append(f"{len(sos)} .so files ({', '.join(sos)})")
    if extra or bad:
        problems.append(f"unexpected {', '.join(sorted(set(extra + bad)))}")
    if problems:
        raise BundleRefused(f"{path}: bundle folder: {'; '.join(problems)}: expected exactly"
                            f" one .so (exporting ffn_forward), {TOML_NAME} and {ROW_NAME},"
                            " names of [A-Za-z0-9_.-]", path=path)
    with ElfFile(os.path.join(path, sos[0])):
        pass                              # complete ELF? (a half-written one is not)
    return sos[0]


def stage_bundle(src: str, staging_dir: str, expect: BundleSig | None = None
                 ) -> tuple[str, str]:
    """Check `src` (check_bundle), copy it to `<staging>/<identity>.expert/`; return
    (identity, path of the staged .so). FileChanged when the bundle changes meanwhile."""
    st = os.lstat(src)
    _check_folder(src, st)
    sig = bundle_sig(src, st)             # before the checks: any change is noticed
    if expect is not None and sig != expect:
        raise FileChanged(src)
    so_name = check_bundle(src, st)
    tmp = os.path.join(staging_dir, f".bundle-{os.getpid()}-{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    try:
        incoming = os.path.join(tmp, ".in")   # each file staged as a .so is (stage_file)
        os.mkdir(incoming, 0o700)
        hashes = {}
        for n, fsig in sig.entries:
            hashes[n], copy = stage_file(os.path.join(src, n), incoming, expect=fsig)
            os.replace(copy, os.path.join(tmp, n))
        os.rmdir(incoming)
        if bundle_sig(src) != sig:
            raise FileChanged(src)
        identity = identity_of(hashes)
        staged = os.path.join(staging_dir, f"{identity}{BUNDLE_SUFFIX}")
        if os.path.isdir(staged):
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, staged)           # its files are read-only (stage_file)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return identity, os.path.join(staged, so_name)


def staging_entry(staged: str) -> str:
    """The top-level entry of the staging folder that holds `staged` (a .so, or the bundle
    folder of a bundle's .so)."""
    parent = os.path.dirname(staged)
    return parent if os.path.basename(parent).endswith(BUNDLE_SUFFIX) else staged


def remove_staged(entry: str) -> None:
    """Delete a staging entry (a file, or a bundle folder with its read-only files)."""
    if os.path.isdir(entry) and not os.path.islink(entry):
        shutil.rmtree(entry, ignore_errors=True)
    else:
        try:
            os.unlink(entry)
        except OSError:
            pass


def read_staged(staged: str, hidden_size: int | None = None,
                moe_layers: set[int] | frozenset[int] | None = None,
                fingerprint: str | None = None) -> ExpertFileInfo:
    """read_expert_file for a staged .so, read_bundle for the .so of a staged bundle."""
    if staging_entry(staged) != staged:
        return read_bundle(staged, hidden_size, moe_layers, fingerprint)
    return read_expert_file(staged, hidden_size, moe_layers, fingerprint)


def read_bundle(so_path: str, hidden_size: int | None = None,
                moe_layers: set[int] | frozenset[int] | None = None,
                fingerprint: str | None = None) -> ExpertFileInfo:
    """Parse and check a bundle (its .so's path given) without loading it. In the order of
    the checks of a .so: the ELF file (architecture, abi), then the metadata."""
    folder = os.path.dirname(so_path)
    toml_path, row_path = os.path.join(folder, TOML_NAME), os.path.join(folder, ROW_NAME)
    with ElfFile(so_path) as elf:
        check_host(elf)
        if elf.symbol(SYM_META) is not None:
            raise ExpertAbiError(f"{so_path}: a bundle's .so defines {SYM_META}: expected"
                                 f" only {SYM_FORWARD} (its metadata is {TOML_NAME}); drop a"
                                 " .so with its own metadata alone, without a bundle",
                                 path=so_path)
        fwd = elf.symbol(SYM_FORWARD)
        if fwd is None or not fwd.dynamic or fwd.type != STT_FUNC:
            raise ExpertAbiError(f"{so_path}: no exported function {SYM_FORWARD!r}: expected"
                                 " `int ffn_forward(const float*, float*, int, int)` with"
                                 " default visibility", path=so_path)
        size = elf.size
    fields = _read_toml(toml_path)
    offset, row = _read_row(row_path)
    hidden = int(row.size)
    if hidden_size is not None and hidden != hidden_size:
        raise ExpertMetadataError(f"{row_path}: router row of {hidden} values (the expert's"
                                  f" hidden size), expected the model's hidden_size"
                                  f" {hidden_size}", path=row_path)
    meta = ExpertMeta(abi_version=fields["abi_version"],
                      flags=(FLAG_THREAD_SAFE if fields["thread_safe"] else 0)
                      | (FLAG_PORTABLE if fields["portable"] else 0),
                      hidden_size=hidden, intermediate_size=0, group_size=0,
                      layers=fields["layers"], router_bias=fields["router_bias"],
                      name=fields["name"], version=fields["version"],
                      target=f"bundle {os.path.basename(so_path)}",
                      base_model=fields["base_model"])
    check_against_model(toml_path, meta, hidden_size, moe_layers, fingerprint)
    return ExpertFileInfo(so_path, size, meta, Part(offset, 4 * hidden), None,
                          router_file=row_path)


def _toml_module():
    try:
        import tomllib
        return tomllib
    except ModuleNotFoundError:
        pass
    try:
        import tomli                      # the same parser, installed on Python 3.10
        return tomli
    except ModuleNotFoundError:
        return None


def _read_toml(path: str) -> dict:
    toml = _toml_module()
    if toml is None:
        raise BundleRefused(f"{path}: reading {TOML_NAME} needs Python >= 3.11 (tomllib) or"
                            f" the tomli package on Python {sys.version_info[0]}."
                            f"{sys.version_info[1]}: `pip install tomli`, or build a regular"
                            " expert with `colibri expert build --from-c`", path=path)
    with open(path, "rb") as f:
        raw = f.read(MAX_TOML_BYTES + 1)
    if len(raw) > MAX_TOML_BYTES:
        raise ExpertMetadataError(f"{path}: more than {MAX_TOML_BYTES} bytes, expected a few"
                                  f" keys ({', '.join(TOML_KEYS)})", path=path)
    try:
        doc = guarded(toml.loads, raw.decode("utf-8"))
    except (UnicodeDecodeError, toml.TOMLDecodeError, TooDeep) as e:
        raise ExpertMetadataError(f"{path}: not valid TOML ({e})", path=path) from None

    def bad(key: str, expected: str):
        return ExpertMetadataError(f"{path}: {key} = {doc[key]!r}, expected {expected}",
                                   path=path)
    unknown = sorted(set(doc) - set(TOML_KEYS))
    if unknown:
        raise ExpertMetadataError(f"{path}: unknown key(s) {', '.join(unknown)}, expected"
                                  f" only {', '.join(TOML_KEYS)}", path=path)
    missing = [k for k in ("name", "version", "layers") if k not in doc]
    if missing:
        raise ExpertMetadataError(f"{path}: missing {', '.join(missing)}, expected name ="
                                  ' "...", version = "...", layers = [N, ...]', path=path)
    name, version, layers = doc["name"], doc["version"], doc["layers"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise bad("name", "1-63 characters of [A-Za-z0-9_.-]")
    if (not isinstance(version, str) or not version.isprintable()
            or len(version.encode()) >= VERSION_LEN):
        raise bad("version", f"printable text of at most {VERSION_LEN - 1} bytes")
    if (not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS
            or not all(type(v) is int and v >= 0 for v in layers)
            or len(set(layers)) != len(layers)):
        raise bad("layers", f"a list of 1..{MAX_LAYERS} distinct global layer indices >= 0")
    bias = doc.get("router_bias", 0.0)
    if type(bias) not in (int, float) or not math.isfinite(bias) \
            or abs(bias) > float(np.finfo(np.float32).max):
        raise bad("router_bias", "a finite number")
    thread_safe = doc.get("thread_safe", False)
    if type(thread_safe) is not bool:
        raise bad("thread_safe", "true or false")
    portable = doc.get("portable", False)
    if type(portable) is not bool:
        raise bad("portable", "true or false")
    base_model = doc.get("base_model", "")
    if "base_model" in doc:
        from ...model.fingerprint import parse_fingerprint
        try:
            base_model = parse_fingerprint(base_model, "base_model") if \
                isinstance(base_model, str) else parse_fingerprint("?", "")
        except ValueError:
            raise bad("base_model", "the model's fingerprint, 64 hex digits") from None
    abi = doc.get("abi_version", 1)
    if type(abi) is not int or abi not in SUPPORTED_ABI_VERSIONS:
        raise ExpertAbiError(f"{path}: abi_version = {abi!r}, expected one of"
                             f" {sorted(SUPPORTED_ABI_VERSIONS)}", path=path)
    return {"name": name, "version": version, "layers": tuple(layers),
            "router_bias": float(np.float32(bias)), "thread_safe": thread_safe,
            "abi_version": abi, "base_model": base_model, "portable": portable}


def _read_row(path: str) -> tuple[int, np.ndarray]:
    """(data offset, float32 values) of router_row.npy, checked: 1-D little-endian float32,
    finite, nothing after the data."""
    fmt = np.lib.format
    with open(path, "rb") as f:
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f"format version {version}")
        except ValueError as e:
            raise ExpertMetadataError(f"{path}: not a .npy file of format 1.0/2.0 ({e}),"
                                      " expected np.save(path, row.astype(np.float32))",
                                      path=path) from None
        offset = f.tell()
        if dtype != np.dtype("<f4") or len(shape) != 1 or shape[0] < 1:
            raise ExpertMetadataError(f"{path}: array {dtype.str}{list(shape)}, expected"
                                      " float32 [hidden] (np.save(path,"
                                      " row.astype(np.float32)))", path=path)
        nbytes = 4 * shape[0]
        raw = f.read(nbytes + 1)
    if len(raw) != nbytes:
        raise ExpertMetadataError(f"{path}: {len(raw)} data bytes after the header, expected"
                                  f" {nbytes} (float32 [{shape[0]}])", path=path)
    row = np.frombuffer(raw, "<f4")
    if not np.isfinite(row).all():
        raise ExpertMetadataError(f"{path}: non-finite values, expected a finite router row",
                                  path=path)
    return offset, row
