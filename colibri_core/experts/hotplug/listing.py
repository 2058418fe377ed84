"""What `colibri experts list`, `GET /v1/experts` and rollback show and accept.

`manager_rows(book)`: the rows of a running manager (HotplugManager.list(); book.py).
`folder_view(experts_dir, state_dir)`: the same from the state file and the folder alone,
read-only, for when a running engine (a server) holds the state folder: its lock is not
taken, nothing is written, nothing is loaded (the metadata is read from the ELF files).
`resolve_name(book, text)`: rollback's argument, a metadata name or the file that provides
it, so that the names `list` shows are the names rollback takes.
"""
from __future__ import annotations

import hashlib
import os
import stat

from .bundle import bundle_identity, is_bundle_name, read_bundle
from .errors import HotplugError
from .meta import read_expert_file
from .state import load_state
from .watcher import is_expert_name


def manager_rows(book) -> list[dict]:
    """Active experts by slot, then known inactive names. `file` is the base name of the
    file in the watched folder that provides (provided) it: rollback accepts it too."""
    rows = []
    with book.lock:
        refused = book.refused
        for e in sorted(book.active.values(), key=lambda e: e.slot):
            rows.append({"slot": e.slot, "name": e.name, "version": e.version,
                         "layers": list(e.layers), "origin": "hot-plugged",
                         "sha256": e.sha256, "isolation": e.isolation,
                         "status": e.status if e.status != "active" or e.alive
                         else "crashed", "binding": e.binding,
                         "file": os.path.basename(e.source_path),
                         "refused": _copy(refused.get(e.source_path))})
        for name, rec in sorted(book.records.items(), key=lambda kv: kv[1].slot):
            if name in book.active or rec.last is None:   # (a slot a candidate keeps)
                continue
            last = rec.last
            rows.append({"slot": rec.slot, "name": name,
                         "version": last.version if last else "",
                         "layers": list(last.layers) if last else [],
                         "origin": "hot-plugged",
                         "sha256": last.sha256 if last else "",
                         "isolation": last.isolation if last else "",
                         "status": "disabled" if rec.disabled and rec.current is None
                         else "removed", "binding": last.binding if last else "",
                         "file": os.path.basename(last.source) if last else "",
                         "refused": _copy(refused.get(last.source)) if last else None})
    return rows


def _copy(r: dict | None) -> dict | None:
    return dict(r) if r is not None else None


def resolve_name(book, text: str) -> str:
    """The active expert's metadata name for `text`: that name itself, or the file (base
    name or path) in the watched folder it came from. Unknown text is returned as is (the
    caller's "not active" error names it)."""
    with book.lock:
        if text in book.active:
            return text
        base = os.path.basename(text.rstrip("/"))
        for e in book.active.values():
            if os.path.basename(e.source_path) == base:
                return e.name
    return text


def folder_view(experts_dir: str, state_dir: str) -> dict:
    """{"experts": rows as manager_rows gives them (status from the state file: the
    version active when it was last saved), "files": one entry per expert file of the
    folder}. A file entry: file, sha256, name, version, binding (from its metadata, or
    `error`), and `state`: active (the version in use), rolled-back (a newer version rolled
    back from: not adopted again), previous (an older adopted version), or new (not
    adopted: waiting, or refused -- the running engine's refusals say why)."""
    _, records = load_state(state_dir)
    rows = []
    by_sha: dict[str, tuple[str, str]] = {}
    for name, rec in sorted(records.items(), key=lambda kv: kv[1].slot):
        v = rec.current or rec.last
        status = "active" if rec.current else "disabled" if rec.disabled else "removed"
        rows.append({"slot": rec.slot, "name": name, "version": v.version if v else "",
                     "layers": list(v.layers) if v else [], "origin": "hot-plugged",
                     "sha256": v.sha256 if v else "", "isolation": v.isolation if v else "",
                     "status": status, "binding": v.binding if v else "",
                     "file": os.path.basename(v.source) if v else "", "refused": None})
        for sha in rec.rolled_back:
            by_sha.setdefault(sha, ("rolled-back", name))
        for h in rec.history:
            by_sha.setdefault(h.sha256, ("previous", name))
        if rec.current:
            by_sha[rec.current.sha256] = ("active", name)
    files = []
    for n in sorted(os.listdir(experts_dir)):
        path = os.path.join(experts_dir, n)
        if not is_expert_name(n) or not _plain(path):
            continue                      # (a FIFO is never opened: it would block)
        entry = {"file": n, "sha256": None, "name": None, "version": None,
                 "binding": None, "state": "new", "error": None}
        try:
            bundle = is_bundle_name(n)
            entry["sha256"] = bundle_identity(path) if bundle else _sha256(path)
            if bundle:
                so = [f for f in sorted(os.listdir(path)) if f.endswith(".so")]
                meta = read_bundle(os.path.join(path, so[0])).meta if so else None
            else:
                meta = read_expert_file(path).meta
            if meta is not None:
                entry.update(name=meta.name, version=meta.version, binding=meta.binding)
        except (HotplugError, OSError, IndexError) as e:
            entry["error"] = str(e)
        state = by_sha.get(entry["sha256"])
        if state is not None:
            entry["state"] = state[0]
        files.append(entry)
    return {"experts": rows, "files": files}


def _plain(path: str) -> bool:
    """A regular file, or a folder of regular files (no symlinks, FIFOs, devices)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        return all(stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode)
                   for n in os.listdir(path))
    return stat.S_ISREG(st.st_mode)


def format_rows(rows: list) -> list[str]:
    """The table of `colibri experts list` (rows as manager_rows gives them, model experts
    too): `file` is what rollback also accepts."""
    out = [f"{'slot':>4}  {'name':20s} {'version':8s} {'layers':8s} {'origin':12s} "
           f"{'isolation':10s} {'status':9s} {'binding':9s} {'sha256':12s} file"]
    for r in rows:
        # a refused file beside the version that stays active (docs/HOTPLUG.md)
        ref = r.get("refused")
        beside = "" if not ref else "  (a newer file, rolled back from)" \
            if ref["reason"] == "rolled-back" else f"  (its file is refused: {ref['reason']})"
        out.append(f"{r['slot']:>4}  {r['name']:20.20s} {r['version']:8.8s} "
                   f"{','.join(map(str, r['layers'])):8s} {r['origin']:12s} "
                   f"{r['isolation']:10s} {r['status']:9s} {r.get('binding') or '-':9s} "
                   f"{r['sha256'][:12]:12s} {r.get('file') or ''}{beside}")
    return out


_FILE_STATES = {"active": "the active version", "previous": "an older adopted version",
                "rolled-back": "rolled back from: not adopted again",
                "new": "not adopted: waiting or refused"}


def format_view(view: dict) -> list[str]:
    """folder_view() as text: the table, then one line per file of the folder."""
    out = format_rows(view["experts"])
    for f in view["files"]:
        meta = f"{f['name']} {f['version']} ({f['binding']})" if f["name"] else \
            f"unreadable: {f['error']}"
        out.append(f"file {f['file']}: {meta}, sha256 {(f['sha256'] or '')[:12]}:"
                   f" {_FILE_STATES[f['state']]}")
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
