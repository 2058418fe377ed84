"""`colibri expert build`: turn trained expert weights (.npz) into a hot-pluggable .so.

The .npz holds float arrays `w1` [I, H] (gate), `w3` [I, H] (up), `w2` [H, I] (down),
`router_row` [H] and optionally `router_bias` (a scalar). The builder

1. quantizes the three matrices with `quant.quantize_q4` (docs/FORMAT.md `q4` layout) and
   the clipping given (`q4_clip`: "mse" or "minmax"; an expert is built with the rounding
   it was trained and validated with, so this is the builder's own setting, recorded in
   the metadata's `target` text, and never follows the quantizer's default),
2. writes each part (data, scales, zeros) and the router row to a binary file and embeds
   them with `.incbin` in an assembler file, one exported symbol per part
   (`colibri_w1_data`, ..., `colibri_router_row`), 64-byte aligned, with exact `.size`,
3. generates a C file with the metadata record and a plain C `ffn_forward` that runs the
   same INT4 weights (the fallback; the engine prefers its own kernels on the q4 symbols),
4. compiles with `gcc -shared -fPIC -O3` to a hidden temporary name beside the output,
   checks that file as the engine would (`meta.read_expert_file`) and only then renames
   it into place: a watching engine never sees a half-written file, and a refused build
   leaves nothing at the output path (a file already there is left as it was).

The compiler, its flags and the q4 clipping are recorded in the metadata's `target` field
(`... -O3 q4-clip=minmax`).

`--from-c SOURCE.c --router-row ROW.npy --layer N` (`build_from_c`) turns a reference-design
expert -- a plain C file exporting only `ffn_forward`, as `gcc -shared -fPIC` builds it --
into a regular expert: the same source compiled together with a generated metadata record
(hidden size = the router row's length, no q4 weights) and the router row embedded with
`.incbin`. The source keeps its default symbol visibility (no -fvisibility=hidden), so its
`ffn_forward` is exported as it would be in the reference build.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ....files import open_regular
from ....format.quant import DEFAULT_GROUP, Q4_CLIPS, quantize_q4
from . import buildsrc
from ..errors import ExpertBuildError, ExpertRejected, HotplugError
from ..meta import MAX_LAYERS, NAME_RE, TARGET_LEN, VERSION_LEN, ExpertFileInfo, read_expert_file

DEFAULT_CFLAGS = ("-O3",)
BASE_FLAGS = ("-shared", "-fPIC", "-fvisibility=hidden")


def include_dir() -> Path:
    """Folder holding colibri_expert.h (pass it to the compiler with -I)."""
    return Path(__file__).resolve().parents[3] / "include"


BUILD_Q4_CLIP = "mse"      # the builder's default, stated here: see the module docstring


def target_string(cc: str, flags: Sequence[str], suffix: str = "") -> str:
    """`<machine> <compiler> <version> <flags> <suffix>`, the flags truncated so that the
    whole fits the metadata field with the suffix kept."""
    try:
        ver = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        ver = "?"
    text = " ".join([platform.machine(), Path(cc).name, ver or "?", *flags])
    tail = f" {suffix}" if suffix else ""
    room = TARGET_LEN - 1 - len(tail.encode())
    return text.encode()[:room].decode("utf-8", "ignore") + tail


def compile_shared(sources: Sequence[str | os.PathLike], out_so: str | os.PathLike, *,
                   cc: str = "gcc", cflags: Sequence[str] = DEFAULT_CFLAGS,
                   defines: dict[str, str | int] | None = None,
                   target: str | None = None, target_suffix: str = "",
                   check: Optional[Callable[[Path], object]] = None,
                   hidden_visibility: bool = True) -> str:
    """Compile C/assembler sources into a shared object, atomically.

    The compiler writes a hidden temporary file beside `out_so`; `check(tmp)`, when given,
    inspects it (raising an ExpertRejected refuses it); only then is it renamed to
    `out_so`. On any failure, interrupts included, the temporary file is removed and
    `out_so` is not touched. `defines` become -D options; EXPERT_TARGET (the metadata
    `target` text, ending in `target_suffix`) is added unless given.
    `hidden_visibility=False` leaves out -fvisibility=hidden (a source that exports by
    default visibility). Returns the target string. Raises ExpertBuildError with the
    compiler's or the check's message.
    """
    out_so = Path(out_so)
    base = BASE_FLAGS if hidden_visibility else tuple(f for f in BASE_FLAGS
                                                      if f != "-fvisibility=hidden")
    flags = [*base, *cflags]
    target = target if target is not None else target_string(cc, flags, target_suffix)
    defs = {"EXPERT_TARGET": _c_string(target), **(defines or {})}
    tmp = out_so.with_name(f".{out_so.name}.{os.getpid()}.tmp")
    cmd = [cc, *flags, f"-I{include_dir()}", *(f"-D{k}={v}" for k, v in defs.items()),
           "-o", str(tmp), *map(str, sources), "-lm"]
    try:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise ExpertBuildError(f"{out_so}: cannot run the compiler {cc!r}: {e}",
                                   path=str(out_so)) from None
        if res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["(no output)"])
            errs = [line for line in first if "error" in line] or first
            raise ExpertBuildError(f"{out_so}: compiler failed ({shlex.join(cmd[:1])}): "
                                   f"{errs[0]}", path=str(out_so))
        if check is not None:
            try:
                check(tmp)
            except ExpertRejected as e:          # its message names the temporary file
                detail = str(e).replace(f"{tmp}: ", "").replace(str(tmp), out_so.name)
                raise ExpertBuildError(f"{out_so}: the built file fails the expert checks, "
                                       f"not written: {detail}", path=str(out_so)) from None
        try:
            os.chmod(tmp, 0o644)
            os.replace(tmp, out_so)
        except OSError as e:
            raise ExpertBuildError(f"{out_so}: cannot write the output: {e.strerror}",
                                   path=str(out_so)) from None
    finally:
        tmp.unlink(missing_ok=True)          # gone already after a successful rename
    return target


def build_expert(npz_path: str | os.PathLike, out_so: str | os.PathLike,
                 layer: int | Sequence[int], name: str, version: str, *,
                 group_size: int = DEFAULT_GROUP, router_bias: float | None = None,
                 q4_clip: str = BUILD_Q4_CLIP, base_model: str | None = None,
                 portable: bool = False,
                 cc: str = "gcc", cflags: Sequence[str] = DEFAULT_CFLAGS,
                 keep_sources: str | os.PathLike | None = None) -> ExpertFileInfo:
    """Build a hot-pluggable expert .so from an .npz of float weights; return its checked info.

    `base_model`: the fingerprint (fingerprint.py) of the model the weights were trained
    for, recorded in the metadata: another model refuses the expert. `portable=True`
    instead, for an expert meant to run on any model of its shape. One of them is required.

    `layer` is one global layer index or several. `router_bias` overrides the .npz's.
    `q4_clip` is the q4 rounding ("mse" or "minmax", quant.q4_group_params): pass the one
    the weights were validated with; it is recorded in the metadata's `target`.
    `keep_sources`, when given, is a folder that receives the generated .c/.S/.bin files.
    """
    npz_path, out_so = Path(npz_path), Path(out_so)
    layers = _check_identity(out_so, layer, name, version)
    if q4_clip not in Q4_CLIPS:
        raise ExpertBuildError(f"{out_so}: q4 clip {q4_clip!r}, expected one of"
                               f" {', '.join(Q4_CLIPS)}", path=str(out_so))
    w1, w3, w2, row, bias = _load_npz(npz_path)
    binding = _binding_defines(out_so, base_model, portable)
    if router_bias is not None:
        bias = float(router_bias)
    inter, hidden = w1.shape
    try:
        q = {m: quantize_q4(w, group_size, clip=q4_clip)
             for m, w in (("w1", w1), ("w3", w3), ("w2", w2))}
    except ValueError as e:
        raise ExpertBuildError(f"{npz_path}: cannot quantize: {e}", path=str(npz_path)) from None

    with tempfile.TemporaryDirectory(prefix="colibri-build-") as tmpdir:
        work = Path(keep_sources) if keep_sources is not None else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        blobs = {"colibri_router_row": row.astype("<f4").tobytes()}
        for m, t in q.items():
            blobs[f"colibri_{m}_data"] = np.ascontiguousarray(t.data, np.uint8).tobytes()
            blobs[f"colibri_{m}_scales"] = np.ascontiguousarray(t.scales, "<f4").tobytes()
            blobs[f"colibri_{m}_zeros"] = np.ascontiguousarray(t.zeros, np.uint8).tobytes()
        asm = [buildsrc.ASM_HEAD]
        for sym, payload in blobs.items():
            blob = (work / f"{sym}.bin").resolve()
            blob.write_bytes(payload)
            asm.append(buildsrc.ASM_BLOB.format(sym=sym, path=_asm_path(blob)))
        (work / "expert_data.S").write_text("".join(asm))
        (work / "expert.c").write_text(buildsrc.C_SOURCE)
        defines = {"H": hidden, "I": inter, "G": group_size,
                   "LAYERS": "{" + ",".join(map(str, layers)) + "}", "N_LAYERS": len(layers),
                   "ROUTER_BIAS": f"{bias!r}f",
                   "EXPERT_NAME": _c_string(name), "EXPERT_VERSION": _c_string(version),
                   **binding}
        out_so.parent.mkdir(parents=True, exist_ok=True)
        compile_shared([work / "expert.c", work / "expert_data.S"], out_so, cc=cc,
                       cflags=cflags, defines=defines, target_suffix=f"q4-clip={q4_clip}",
                       check=lambda tmp: read_expert_file(str(tmp), hidden))
    return read_expert_file(str(out_so), hidden)


def build_from_c(source: str | os.PathLike, out_so: str | os.PathLike,
                 router_row: str | os.PathLike, layer: int | Sequence[int], name: str,
                 version: str, *, router_bias: float = 0.0, thread_safe: bool = False,
                 base_model: str | None = None, portable: bool = False, cc: str = "gcc",
                 cflags: Sequence[str] = DEFAULT_CFLAGS,
                 keep_sources: str | os.PathLike | None = None) -> ExpertFileInfo:
    """Build a regular expert .so from a reference-design C source (only `ffn_forward`)
    and its router row (.npy, [hidden]); return its checked info.

    The hidden size is the router row's length. `thread_safe` sets COLIBRI_FLAG_THREAD_SAFE
    (default: calls are serialized). `base_model` / `portable`: as build_expert's.
    Raises ExpertBuildError, or an ExpertRejected subclass
    when the result is not a valid expert (e.g. the source does not export ffn_forward).
    """
    source, out_so, row_path = Path(source), Path(out_so), Path(router_row)
    layers = _check_identity(out_so, layer, name, version)
    if not source.is_file():
        raise ExpertBuildError(f"{source}: no such C source, expected the expert's .c file"
                               " (exporting ffn_forward)", path=str(source))
    try:
        row = np.load(row_path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ExpertBuildError(f"{row_path}: cannot read the router row: {e}",
                               path=str(row_path)) from None
    if row.ndim != 1 or row.size < 1 or row.dtype.kind not in "fiu":
        raise ExpertBuildError(f"{row_path}: array {row.dtype}{list(row.shape)}, expected the"
                               " router row, numbers [hidden]", path=str(row_path))
    row = row.astype("<f4")
    if not np.isfinite(row).all():
        raise ExpertBuildError(f"{row_path}: non-finite values in the router row",
                               path=str(row_path))
    if not np.isfinite(np.float32(router_bias)):
        raise ExpertBuildError(f"{out_so}: router bias {router_bias}, expected a finite"
                               " number", path=str(out_so))
    binding = _binding_defines(out_so, base_model, portable)
    with tempfile.TemporaryDirectory(prefix="colibri-build-") as tmpdir:
        work = Path(keep_sources) if keep_sources is not None else Path(tmpdir)
        work.mkdir(parents=True, exist_ok=True)
        blob = (work / "colibri_router_row.bin").resolve()
        blob.write_bytes(row.tobytes())
        (work / "expert_data.S").write_text(
            buildsrc.ASM_HEAD
            + buildsrc.ASM_BLOB.format(sym="colibri_router_row", path=_asm_path(blob)))
        (work / "expert_meta.c").write_text(buildsrc.META_C_SOURCE)
        defines = {"H": row.size, "LAYERS": "{" + ",".join(map(str, layers)) + "}",
                   "N_LAYERS": len(layers), "ROUTER_BIAS": f"{float(router_bias)!r}f",
                   "FLAGS": f"({'COLIBRI_FLAG_THREAD_SAFE' if thread_safe else '0u'}"
                            f" | {binding.pop('EXTRA_FLAGS')})",
                   "EXPERT_NAME": _c_string(name), "EXPERT_VERSION": _c_string(version),
                   **binding}
        out_so.parent.mkdir(parents=True, exist_ok=True)
        compile_shared([source.resolve(), work / "expert_meta.c", work / "expert_data.S"],
                       out_so, cc=cc, cflags=cflags, defines=defines,
                       target_suffix=f"from-c={source.name}", hidden_visibility=False,
                       check=lambda tmp: read_expert_file(str(tmp), int(row.size)))
    return read_expert_file(str(out_so), int(row.size))


def _check_identity(out_so: Path, layer, name: str, version: str) -> list[int]:
    layers = [int(layer)] if isinstance(layer, (int, np.integer)) else [int(v) for v in layer]
    if not 1 <= len(layers) <= MAX_LAYERS or min(layers) < 0 or len(set(layers)) != len(layers):
        raise ExpertBuildError(f"{out_so}: layers {layers}, expected 1..{MAX_LAYERS} distinct"
                               " global layer indices >= 0", path=str(out_so))
    if not NAME_RE.match(name):
        raise ExpertBuildError(f"{out_so}: expert name {name!r}, expected 1-63 characters of"
                               " [A-Za-z0-9_.-]", path=str(out_so))
    if len(version.encode()) >= VERSION_LEN or not version.isprintable():
        raise ExpertBuildError(f"{out_so}: version {version!r}, expected printable text of"
                               f" at most {VERSION_LEN - 1} bytes", path=str(out_so))
    return layers


def _binding_defines(out_so: Path, base_model: str | None, portable: bool) -> dict:
    """-D options for the metadata's base_model and PORTABLE flag (one of them required)."""
    from ....model.fingerprint import parse_fingerprint
    if base_model is None and not portable:
        raise ExpertBuildError(f"{out_so}: no base model: expected the model the expert is built"
                               " for (--config NAME, --model DIR or --base-model HEX; Python:"
                               " base_model=), or --portable", path=str(out_so))
    try:
        fp = parse_fingerprint(base_model, "base_model") if base_model is not None else None
    except ValueError as e:
        raise ExpertBuildError(f"{out_so}: {e}", path=str(out_so)) from None
    return {"BASE_MODEL": c_bytes(fp) if fp else "{0}",
            "EXTRA_FLAGS": "COLIBRI_FLAG_PORTABLE" if portable else "0u"}


def c_bytes(hex_text: str) -> str:
    """A C initializer {0x12,0x34,...} of the bytes of `hex_text` (for base_model)."""
    return "{" + ",".join(f"0x{b:02x}" for b in bytes.fromhex(hex_text)) + "}"


def _load_npz(path: Path):
    fd = open_regular(path, lambda msg: ExpertBuildError(      # a FIFO is refused, not waited on
        f"{path}: cannot read the .npz: {msg.removeprefix(f'{path}: ')}", path=str(path)))
    try:
        with os.fdopen(fd, "rb") as f:
            z = np.load(f)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive (a single array?)")
            with z:
                arrays = {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError) as e:
        raise ExpertBuildError(f"{path}: cannot read the .npz: {e}", path=str(path)) from None
    missing = [k for k in ("w1", "w3", "w2", "router_row") if k not in arrays]
    if missing:
        raise ExpertBuildError(f"{path}: missing arrays {missing}, expected w1 [I,H], w3 [I,H],"
                               " w2 [H,I], router_row [H] (+ optional router_bias)",
                               path=str(path))
    w1, w3, w2, row = (arrays[k].astype(np.float32) for k in ("w1", "w3", "w2", "router_row"))
    if w1.ndim != 2:
        raise ExpertBuildError(f"{path}: w1 has shape {w1.shape}, expected [I, H]",
                               path=str(path))
    inter, hidden = w1.shape
    for k, arr, want in (("w3", w3, (inter, hidden)), ("w2", w2, (hidden, inter)),
                         ("router_row", row, (hidden,))):
        if arr.shape != want:
            raise ExpertBuildError(f"{path}: {k} has shape {arr.shape}, expected {want}"
                                   f" (from w1 [I={inter}, H={hidden}])", path=str(path))
    for k, arr in (("w1", w1), ("w3", w3), ("w2", w2), ("router_row", row)):
        if not np.isfinite(arr).all():
            raise ExpertBuildError(f"{path}: {k} has non-finite values", path=str(path))
    rb = np.asarray(arrays.get("router_bias", 0.0), dtype=np.float64).reshape(-1)
    if rb.size != 1 or not np.isfinite(rb[0]):
        raise ExpertBuildError(f"{path}: router_bias {rb.tolist()}, expected one finite"
                               " number", path=str(path))
    bias = float(rb[0])
    return w1, w3, w2, row, bias


def _c_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _asm_path(path: Path) -> str:
    s = str(path)
    if any(c in s for c in '"\\\n'):
        raise ExpertBuildError(f"{path}: build folder path has quote/backslash/newline"
                               " characters, which .incbin cannot name", path=s)
    return s


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap = parser_class(prog="colibri expert build",
                      description="Build a hot-pluggable expert .so from an .npz"
                      " (w1 [I,H], w3 [I,H], w2 [H,I], router_row [H],"
                      " optional router_bias), or with --from-c from a C source that"
                      " exports only ffn_forward and its router row (.npy).")
    ap.add_argument("npz", metavar="WEIGHTS.npz", nargs="?",
                    help="float weights: w1 [I,H], w3 [I,H], w2 [H,I], router_row [H], "
                         "optional router_bias (not with --from-c)")
    ap.add_argument("--from-c", dest="from_c", metavar="SOURCE.c", default=None,
                    help="build from this C source instead, which exports only "
                         "`int ffn_forward(const float*, float*, int, int)` (the reference "
                         "design); needs --router-row")
    ap.add_argument("--router-row", dest="router_row", metavar="ROW.npy", default=None,
                    help="with --from-c: the expert's router row, numbers [hidden] (its "
                         "length is the hidden size)")
    ap.add_argument("--thread-safe", dest="thread_safe", action="store_true",
                    help="with --from-c: ffn_forward may run on several threads at once "
                         "(default: calls are serialized)")
    ap.add_argument("-o", "--output", default=None,
                    help="the .so to write (required with an .npz; with --from-c the "
                         "default is SOURCE with .so for .c)")
    ap.add_argument("--layer", type=int, action="append",
                    help="global layer index, an MoE layer of the model (repeat for several;"
                         " required)")
    ap.add_argument("--name", default=None,
                    help="the expert's identity, 1-63 characters of [A-Za-z0-9_.-] "
                         "(required with an .npz; with --from-c the default is the source's "
                         "file name without .c)")
    ap.add_argument("--version", default=None,
                    help="free printable version text (required with an .npz; with --from-c "
                         "the default is 1.0)")
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP,
                    help=f"INT4 group size, a multiple of 64 (default {DEFAULT_GROUP})")
    ap.add_argument("--q4-clip", choices=Q4_CLIPS, default=BUILD_Q4_CLIP, dest="q4_clip",
                    help="INT4 rounding per group: mse (min/max or a shrunk range, the "
                         "smaller squared error) or minmax (plain round-to-nearest); use the "
                         f"one the weights were validated with (default {BUILD_Q4_CLIP}; "
                         "recorded in the metadata)")
    bind = ap.add_mutually_exclusive_group()
    bind.add_argument("--config", metavar="NAME|FILE", default=None,
                      help="the run config whose model the expert is built for: its "
                           "fingerprint is recorded and other models refuse the expert")
    bind.add_argument("--model", metavar="DIR", default=None,
                      help="the model directory the expert is built for (as --config)")
    bind.add_argument("--base-model", dest="base_model", metavar="HEX", default=None,
                      help="that model's fingerprint, 64 hex digits (`colibri experts "
                           "fingerprint`)")
    bind.add_argument("--portable", action="store_true",
                      help="built to run on any model of its hidden size and layers")
    ap.add_argument("--router-bias", type=float, default=None,
                    help="added to the expert's router logit (overrides the .npz's)")
    ap.add_argument("--cc", default=os.environ.get("CC", "gcc"),
                    help="C compiler (default $CC or gcc)")
    ap.add_argument("--cflags", default=" ".join(DEFAULT_CFLAGS),
                    help="compiler flags (recorded in the metadata), default -O3")
    ap.add_argument("--keep-sources", default=None, metavar="DIR",
                    help="also write the generated .c/.S/.bin files to DIR")
    return ap


def main(argv: Sequence[str] | None = None, parser_class=argparse.ArgumentParser) -> int:
    """`colibri expert build WEIGHTS.npz -o OUT.so --layer L --name N --version V`, or
    `colibri expert build --from-c SOURCE.c --router-row ROW.npy --layer L [-o OUT.so]`.
    Errors print one line `colibri: error: ...` and return 2."""
    ap = build_parser(parser_class)
    args = ap.parse_args(argv)
    if args.from_c is not None:
        if args.npz is not None:
            ap.error(f"both WEIGHTS.npz ({args.npz}) and --from-c given: expected one of them")
        required = (("--router-row", args.router_row), ("--layer", args.layer))
    else:
        required = (("WEIGHTS.npz (or --from-c SOURCE.c)", args.npz),
                    ("-o/--output", args.output), ("--layer", args.layer),
                    ("--name", args.name), ("--version", args.version))
    missing = [opt for opt, value in required if value is None]
    if missing:                           # argparse's own words: one mode or the other
        ap.error(f"the following arguments are required: {', '.join(missing)}")
    if args.from_c is not None:
        src = Path(args.from_c)
        out = args.output or str(src.with_suffix(".so"))
        name, version = args.name or src.stem, args.version or "1.0"
    else:
        if args.router_row is not None or args.thread_safe:
            ap.error("--router-row and --thread-safe go with --from-c (an .npz holds its"
                     " router_row)")
        out, name, version = args.output, args.name, args.version
    try:
        base_model = args.base_model
        if args.config is not None or args.model is not None:
            from ....model.fingerprint import fingerprint_for
            try:
                base_model = fingerprint_for(args.config, args.model)
            except (ValueError, OSError) as e:   # (ConfigError is a ValueError)
                ap.error(f"--{'config' if args.config else 'model'}: {e}")
        bind = {"base_model": base_model, "portable": args.portable}
        if args.from_c is not None:
            info = build_from_c(args.from_c, out, args.router_row, args.layer, name, version,
                                router_bias=args.router_bias or 0.0,
                                thread_safe=args.thread_safe, cc=args.cc, **bind,
                                cflags=shlex.split(args.cflags),
                                keep_sources=args.keep_sources)
        else:
            info = build_expert(args.npz, out, args.layer, name, version,
                                group_size=args.group_size, router_bias=args.router_bias,
                                q4_clip=args.q4_clip, cc=args.cc, **bind,
                                cflags=shlex.split(args.cflags),
                                keep_sources=args.keep_sources)
    except HotplugError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    m = info.meta
    if args.from_c is not None:
        print(f"built {out}: expert {m.name} {m.version} from {args.from_c}, layers"
              f" {list(m.layers)}, hidden {m.hidden_size}, router bias {m.router_bias:g},"
              f" {'thread-safe' if m.thread_safe else 'serialized calls'}, {info.size} bytes,"
              f" target {m.target!r}, {_binding_text(m)}")
        return 0
    print(f"built {out}: expert {m.name} {m.version}, layers {list(m.layers)},"
          f" hidden {m.hidden_size}, intermediate {m.intermediate_size}, group"
          f" {m.group_size}, q4 clip {args.q4_clip}, {info.size} bytes, target {m.target!r},"
          f" {_binding_text(m)}")
    return 0


def _binding_text(m) -> str:
    return "portable" if m.portable else f"base model {m.base_model}"


if __name__ == "__main__":
    sys.exit(main())
