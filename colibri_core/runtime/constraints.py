"""Constrained decoding: a grammar that every sampled token must keep the output inside.

One library does the work: llguidance (Microsoft's guidance project; Rust, a small
wheel, no torch), chosen by measured per-token mask cost on a 151,643-token vocabulary
(docs/SERVE.md, "Structured output": 11 us p50 for a JSON schema against xgrammar's 64 and
outlines-core's 29, compile 1.3 ms against 32 ms and 1 s). It is an optional extra
(`pip install 'colibri[structured]'`); without it a request that asks for a grammar gets
one line saying so.

A `Grammar` is data (what kind, its text): SamplingParams carries it, and it pickles. Each
sequence's Sampler makes its own `Constraint` from it (a matcher: the grammar's state
after the tokens so far) with the model's tokenizer, whose llguidance twin is built once
per tokenizer (1-3 s and 83 MiB for 150k tokens) and cached. Per token the sampler asks the
constraint; a sampler without one does no work for it at all.

JSON comes out in one layout (`", "` and `": "`, no other whitespace): a flexible
layout lets a model loop on whitespace forever and never close the document.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

# JSON's layout in every schema-made grammar: separators as OpenAI's models write them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 256 * 1024


class GrammarError(ValueError):
    """A grammar the library refuses; the message is one line."""


def _lib():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("constrained decoding needs the llguidance package: pip install "
                           "'colibri[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a sequence's output must match. `kind`: "json_schema" (text: the schema as
    JSON), "gbnf" (llama.cpp's grammar format), "lark", "regex", or "llguidance" (the
    library's own JSON grammar list: what tool calls use). Build with the classmethods,
    which check it (GrammarError, one line)."""
    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema) -> "Grammar":
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls._checked("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def gbnf(cls, text: str) -> "Grammar":
        return cls._checked("gbnf", text)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        return cls._checked("lark", text)

    @classmethod
    def regex(cls, text: str) -> "Grammar":
        return cls._checked("regex", text)

    @classmethod
    def llguidance(cls, grammars: list) -> "Grammar":
        return cls._checked("llguidance", json.dumps({"grammars": grammars}))

    @classmethod
    def _checked(cls, kind: str, text: str) -> "Grammar":
        if not isinstance(text, str) or not text:
            raise GrammarError(f"a {kind} grammar is non-empty text")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{len(text):,} characters, at most {MAX_GRAMMAR_CHARS:,}")
        g = cls(kind, text)
        err, msgs = _lib().LLMatcher.validate_grammar_with_warnings(g.compiled())
        if err:
            raise GrammarError(_one_line(msgs[0] if msgs else "invalid grammar"))
        return g

    def compiled(self) -> str:
        """The library's grammar text."""
        ll = _lib()
        M = ll.LLMatcher
        try:
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if isinstance(schema, dict):
                    schema = {**schema, "x-guidance": {**JSON_OPTIONS,
                                                       **schema.get("x-guidance", {})}}
                return M.grammar_from_json_schema(schema)
            if self.kind == "gbnf":
                return ll.grammar_from("gbnf", self.text)
            if self.kind == "lark":
                return M.grammar_from_lark(self.text)
            if self.kind == "regex":
                return M.grammar_from_regex(self.text)
            if self.kind == "llguidance":
                return self.text
        except (ValueError, TypeError) as e:
            raise GrammarError(_one_line(str(e))) from None
        raise GrammarError(f"unknown grammar kind {self.kind!r}")


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())[:300]


# ----------------------------------------------------------------------------- tokenizers

_ll_tokenizers: dict = {}               # (id(tokenizer), n_vocab, eos) -> (tokenizer, LLTokenizer)
_ll_lock = threading.Lock()


def ll_tokenizer(tokenizer, n_vocab: int, eos_ids) -> object:
    """The tokenizer's llguidance twin, built once (1-3 s for 150k tokens): its
    tokens as bytes, `n_vocab` the model's logit count (ids past the tokenizer's are
    never allowed), EOS what ends the grammar."""
    eos = tuple(int(t) for t in eos_ids)
    key = (id(tokenizer), n_vocab, eos)
    with _ll_lock:
        hit = _ll_tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        ll = _lib()
        text = tokenizer._tok.to_str()
        lt = ll.LLTokenizer(text, n_vocab=n_vocab, eos_token=list(eos) if len(eos) > 1
                            else (eos[0] if eos else None))
        _ll_tokenizers[key] = (tokenizer, lt)
        return lt


# ----------------------------------------------------------------------------- per sequence

class Constraint:
    """One sequence's matcher: which tokens may come next, and the state after each
    token the sampler chose (`advance`). Used on the scheduler's thread only."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int, eos_ids):
        if tokenizer is None:
            raise GrammarError("constrained decoding needs the model's tokenizer.json")
        ll = _lib()
        self.n_vocab = n_vocab
        self.eos = int(eos_ids[0]) if len(eos_ids) else None
        self.matcher = ll.LLMatcher(ll_tokenizer(tokenizer, n_vocab, eos_ids),
                                    grammar.compiled(), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(_one_line(self.matcher.get_error()))
        self.bits = np.zeros((n_vocab + 31) // 32, np.int32)
        self.tokens = 0                               # tokens consumed

    def allows(self, tok: int) -> bool:
        """Whether `tok` may come next (no mask computed: the greedy fast path)."""
        return self.matcher.validate_tokens([int(tok)]) == 1

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of the logits with every token the grammar forbids at -inf
        (about 10 us for the mask and 80 us to apply it on 150k tokens)."""
        b = self.bits
        self.matcher.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
        n = logits.shape[-1]
        keep = np.unpackbits(b.view(np.uint8), bitorder="little", count=n)
        with np.errstate(divide="ignore"):
            out = np.log(keep, dtype=np.float32)      # 1 -> 0, 0 -> -inf, exactly
        out += logits
        return out

    def advance(self, tok: int) -> None:
        if not self.matcher.consume_token(int(tok)):
            # only a token the mask forbade gets here (a plugin's choice): the rest of
            # the sequence is unconstrained rather than wrong about its state
            self.broken = True

    broken = False

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.matcher.is_stopped()


def constraint(grammar: Optional[Grammar], tokenizer, n_vocab: int,
               eos_ids) -> Optional[Constraint]:
    return None if grammar is None else Constraint(grammar, tokenizer, n_vocab, eos_ids)
