"""The built-in model's corpus: documents from the running Python's stdlib, split
train/validation by a content hash, and the token stream the model is trained and
evaluated on.  No torch here: the context evaluation and the tests use it too."""

from __future__ import annotations

import ast
import os
import sysconfig
import zlib

import numpy as np

EOS = "<|endoftext|>"

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def _clean(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def _module_docstrings(tree: ast.Module, min_doc_chars: int) -> list[tuple[str, str]]:
    """(dotted name, docstring) of a module's own docstring, classes and functions, in
    source order; nested names are qualified (Class.method)."""
    out: list[tuple[str, str]] = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                doc = ast.get_docstring(child)
                if doc and len(doc) >= min_doc_chars:
                    out.append((name, doc))
                visit(child, name + ".")

    doc = ast.get_docstring(tree)
    if doc and len(doc) >= min_doc_chars:
        out.append(("", doc))
    visit(tree, "")
    return out


def build_corpus(use_docstrings: bool = True, min_doc_chars: int = 40) -> list[str]:
    """Deterministic list of documents from the stdlib: each pydoc topic is one document,
    and each module's docstrings together are one (its own docstring, then every class'
    and function's under its name), so that a document is long and what it says early
    (names, terms) comes back later: the context a 2,048-token model can learn to use."""
    import pydoc_data.topics as topics

    docs: list[str] = []
    for key in sorted(topics.topics):
        docs.append(_clean(topics.topics[key]))
    if use_docstrings:
        stdlib = sysconfig.get_paths()["stdlib"]
        seen_doc: set[str] = set()      # a docstring shared by several functions, once
        for root, dirs, files in os.walk(stdlib):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("lib2to3"))
            for fname in sorted(files):
                if not fname.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(root, fname), encoding="utf-8") as fh:
                        tree = ast.parse(fh.read())
                except Exception:
                    continue
                parts = []
                for name, doc in _module_docstrings(tree, min_doc_chars):
                    doc = _clean(doc)
                    if doc in seen_doc:
                        continue
                    seen_doc.add(doc)
                    parts.append(f"{name}:\n{doc}" if name else doc)
                if parts:
                    docs.append("\n\n".join(parts))
    # drop exact duplicates, keep first occurrence (deterministic order)
    seen: set[str] = set()
    out = []
    for d in docs:
        if d and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def split_docs(docs: list[str], val_mod: int = 20) -> tuple[list[str], list[str]]:
    train, val = [], []
    for d in docs:
        (val if zlib.crc32(d.encode("utf-8")) % val_mod == 0 else train).append(d)
    return train, val


def encode_stream(tok, docs: list[str], eos_id: int) -> np.ndarray:
    """Concatenate docs as  <eos> doc <eos> doc ...  (eos doubles as document separator / bos)."""
    enc = tok.encode_batch(docs, add_special_tokens=False)
    parts = []
    for e in enc:
        parts.append(np.array([eos_id], dtype=np.int32))
        parts.append(np.asarray(e.ids, dtype=np.int32))
    parts.append(np.array([eos_id], dtype=np.int32))
    return np.concatenate(parts)
