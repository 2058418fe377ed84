"""The module map of docs/ARCHITECTURE.md, enforced.

The doc's first `text` block lists the modules bottom-up; every import in every module
(top-level, deferred inside a function, under `if TYPE_CHECKING:`) is read with `ast` and
must point to a module listed above the importer (or to the importer's own package).
Besides: no import cycle at all, every module listed, nothing below the composition root
(engine.py) imports hot-plug, nothing imports the built-in plugins package, only kernels.py
imports the compiled extension.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ARCHITECTURE.md"
PKG = "colibri_core"
# colibri_core.builtin_plugins is the repo's plugins/ folder (setup.py's package_dir)
FOLDERS = {"builtin_plugins": REPO / "plugins"}
EXTENSION = f"{PKG}._colibri_kernels"            # the compiled kernels (cffi)
ROOT = "engine.py"                                # the composition root
HOTPLUG, BUILTINS = f"{PKG}.experts.hotplug", f"{PKG}.builtin_plugins"


def listed_order(text: str) -> list[str]:
    """Entries of the doc's module list, bottom first: "x.py" or "pkg/"."""
    block = re.search(r"```text\n(.*?)```", text, re.S)
    assert block, f"{DOC}: no ```text block with the module list"
    out = []
    for line in block.group(1).splitlines():
        if not line or line[0].isspace():
            continue                                   # a description's continuation
        names = re.split(r"\s{2,}", line.strip())[0]
        out += [n.strip() for n in names.split(",")]
    bad = [n for n in out if not re.fullmatch(r"[A-Za-z_][\w]*(\.py|/)", n)]
    assert not bad, f"{DOC}: module list entries {bad} are neither 'name.py' nor 'package/'"
    return out


def package_files() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    mods = {}
    folders = [(PKG, REPO / PKG)] + [(f"{PKG}.{k}", v) for k, v in FOLDERS.items()]
    for prefix, root in folders:
        for p in sorted(root.rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            if any(part in FOLDERS for part in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((prefix,) + parts)] = p
    return mods


def rank_of(name: str, ranks: dict[str, int]) -> tuple[str, int] | None:
    """The list entry a module belongs to (its own file, or the package it is in)."""
    rel = name[len(PKG) + 1:] if name.startswith(PKG + ".") else "__init__"
    if rel + ".py" in ranks:
        return rel + ".py", ranks[rel + ".py"]
    top = rel.split(".")[0] + "/"
    return (top, ranks[top]) if top in ranks else None


def imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of `name` inside the package, anywhere in
    the file; `from . import x` names the submodule x when there is one."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[:len(here) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == EXTENSION or t.startswith(EXTENSION + "."):
                out.append((node.lineno, EXTENSION))
                continue
            if t != PKG and not t.startswith(PKG + "."):
                continue
            while t not in mods and "." in t:          # `import pkg.mod.attr` -> the module
                t = t.rsplit(".", 1)[0]
            if t != name:
                out.append((node.lineno, t))
    return out


def violations(doc_text: str, mods: dict[str, Path]) -> list[str]:
    order = listed_order(doc_text)
    ranks = {n: i for i, n in enumerate(order)}
    problems = []
    for entry in order:                                 # every entry names something real
        if entry.endswith("/"):
            key = f"{PKG}.{entry[:-1]}"
            if key not in mods:
                problems.append(f"{DOC.name} lists {entry}, which is not a package of {PKG}")
        elif f"{PKG}.{entry[:-3]}" not in mods and not (entry == "__init__.py" and PKG in mods):
            problems.append(f"{DOC.name} lists {entry}, which is not a module of {PKG}")
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        mine = rank_of(name, ranks)
        if mine is None:
            problems.append(f"{where}: module {name} is missing from {DOC.name}'s module list")
            continue
        graph[name] = set()
        for line, dep in imports(name, path, mods):
            if dep == EXTENSION:
                if name != f"{PKG}.kernels":
                    problems.append(f"{where}:{line} imports the compiled extension: only "
                                    f"kernels/ may")
                continue
            graph[name].add(dep)
            if dep.startswith(BUILTINS) and not name.startswith(BUILTINS):
                problems.append(f"{where}:{line} imports {dep}: load built-in plugins by name "
                                f"(plugins.register_builtin_plugin)")
            if dep.startswith(HOTPLUG) and mine[1] < ranks[ROOT] and not name.startswith(HOTPLUG):
                problems.append(f"{where}:{line} imports {dep}: only the composition root "
                                f"{ROOT} and what is listed after it import hotplug/")
            theirs = rank_of(dep, ranks)
            if theirs is None or theirs[0] == mine[0]:
                continue                                # unlisted (reported) / same package
            if theirs[1] > mine[1]:
                problems.append(f"{where}:{line} imports {dep} ({theirs[0]}), which "
                                f"{DOC.name} lists after {mine[0]}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected part of the graph that has one."""
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


# ----------------------------------------------------------------------------- tests

def test_imports_follow_the_documented_order():
    problems = violations(DOC.read_text(), package_files())
    assert not problems, "\n".join(problems)


def test_the_check_catches_what_it_must(tmp_path):
    """The checker on planted faults: an upward import, a deferred one, a TYPE_CHECKING
    one, a cycle, an unlisted module, and the two forbidden packages."""
    mods = package_files()
    text = DOC.read_text()
    fake = dict(mods)

    def plant(name: str, source: str) -> list[str]:
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(source)
        fake_mods = dict(fake, **{name: path})
        return violations(text, fake_mods)

    upward = plant(f"{PKG}.format.quant", "from ..forward.model import Model\n")
    assert any("quant" in p and "lists after format/" in p for p in upward), upward
    deferred = plant(f"{PKG}.model.routing", "def f():\n    from ..forward import pipeline\n")
    assert any("colibri_core.forward.pipeline" in p for p in deferred), deferred
    typing_only = plant(f"{PKG}.runtime.generate", "from typing import TYPE_CHECKING\n"
                                                   "if TYPE_CHECKING:\n    from ..engine import Engine\n")
    assert any("colibri_core.engine" in p for p in typing_only), typing_only
    hot = plant(f"{PKG}.forward.model", "from ..experts.hotplug.errors import HotplugError\n")
    assert any("only the composition root" in p for p in hot), hot
    builtin = plant(f"{PKG}.engine", "from .builtin_plugins.tracer import Tracer\n")
    assert any("load built-in plugins by name" in p for p in builtin), builtin
    unlisted = plant(f"{PKG}.newthing", "x = 1\n")
    assert any("missing from" in p for p in unlisted), unlisted
    fake[f"{PKG}.errors"] = tmp_path / "errors_cycle.py"
    fake[f"{PKG}.errors"].write_text("from . import memstat\n")
    cyc = plant(f"{PKG}.memstat", "from . import errors\n")
    assert any(p.startswith("import cycle") for p in cyc), cyc


def test_every_kind_of_routed_expert_is_an_Expert(tiny_model_dir):
    """experts/protocol.py's Expert names what the model reads from an expert; each kind has it."""
    from colibri_core.experts.expertcache import CopyInExpert
    from colibri_core.experts.expertset import ExpertSet, HotSlot
    from colibri_core.format.modelfile import expert_name
    from colibri_core.experts.protocol import Expert
    from colibri_core.model.weights import load_model

    w = load_model(tiny_model_dir)
    try:
        ex = w.layers[w.cfg.moe_layers[0]].experts[1]
        copy = CopyInExpert(ex, ex.ffn, 4096, 8192)

        class Hot:                     # what HotSlot and ExpertSet read of a HotExpert
            slot, q4, layers = w.cfg.num_experts, None, (w.cfg.moe_layers[0],)
            name, sha256 = "hot", "0" * 64
            router_row, router_bias = np.zeros(w.cfg.hidden_size, np.float32), 0.0

            def forward(self, x, out):
                out[...] = x

        es = ExpertSet.from_weights(w).with_expert(Hot())
        hot = es.experts[w.cfg.moe_layers[0]][w.cfg.num_experts]
        assert isinstance(hot, HotSlot)
        for e in (ex, copy, hot):
            assert isinstance(e, Expert), type(e).__name__
            assert e.name == expert_name(e.layer, e.index)
        assert hot.ffn is None and hot.nbytes == 0 and ex.nbytes > 0
    finally:
        w.close()


def test_every_package_is_installed_by_setup_py():
    """`pip install .` (not editable) installs only the packages setup.py lists: a new
    subpackage missing there imports fine in the editable checkout and fails for users."""
    import ast
    root = Path(__file__).resolve().parent.parent
    tree = ast.parse((root / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    listed = set(ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages")))
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "colibri_core").rglob("__init__.py")}
    assert found - listed == set(), f"add {sorted(found - listed)} to setup.py's packages"
