"""Text <-> token ids, with UTF-8-safe incremental decoding for streaming; a prompt given
as token ids, checked (`token_ids`)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import ModelFormatError, RequestError
from ..files import read_text


def library_message(e: BaseException) -> str:
    """The first line of a parsing library's error with every quoted value blanked out:
    the tokenizers library quotes the file's strings ("invalid type: string \"...\""),
    and tokenizer.json may be a symlink to some other file whose content must not reach
    a message. Positions and the library's own words stay."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r'"[^"]*"|\'[^\']*\'', '"…"', first)[:160]


class Tokenizer:
    def __init__(self, path: Path, vocab_size: int):
        from tokenizers import Tokenizer as HFTokenizer
        # Read here (a regular file only), not by the library: a FIFO would block it
        # forever, deaf to Ctrl-C.
        text = read_text(path)
        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as e:
            raise ModelFormatError(f"{path}: unreadable tokenizer ({library_message(e)})") from None
        self.path = Path(path)
        self.vocab_size = vocab_size
        # Special tokens: decode() skips them, so a stream decoder never needs to see them.
        added = getattr(self._tok, "get_added_tokens_decoder", dict)()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        n = self._tok.get_vocab_size(with_added_tokens=True)
        # The largest id it can emit, not its count: a vocabulary may have holes (ids are
        # whatever the file says), and get_vocab_size() counts entries.
        top = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        # An upper bound on the characters one token stands for (its string in the
        # vocabulary is at least as long in UTF-8 bytes): what a long prompt is cut to.
        self.max_token_chars = max((len(t.encode("utf-8"))
                                    for t in self._tok.get_vocab(with_added_tokens=True)),
                                   default=1)
        # A model vocabulary padded above the tokenizer's size is normal; the reverse is not.
        if max(n, top + 1) > vocab_size:
            raise ModelFormatError(f"{path}: tokenizer has {n} tokens (largest id {top}) but "
                                   f"the model's vocab_size is {vocab_size}; ids >= "
                                   f"{vocab_size} would be out of range (wrong tokenizer for "
                                   f"this model?)")

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"prompt is not valid Unicode text: {e.reason} at character "
                               f"{e.start} ({text[e.start]!r})") from None
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except BaseException as e:      # a panic in the Rust library is a BaseException
            raise self._library_error(e, "encoding the prompt") from None

    def decode(self, ids: list[int]) -> str:
        try:
            return self._tok.decode(list(ids), skip_special_tokens=True)
        except BaseException as e:
            raise self._library_error(e, "decoding tokens") from None

    def _library_error(self, e: BaseException, doing: str) -> BaseException:
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)) or \
                type(e).__name__ != "PanicException" and not isinstance(e, Exception):
            return e
        return ModelFormatError(f"{self.path}: the tokenizer failed {doing} "
                                f"({library_message(e)}); "
                                f"check this tokenizer.json (its regex or normalizer)")

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (log-prob listings)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def token_to_id(self, s: str):
        return self._tok.token_to_id(s)


class StreamDecoder:
    """Emits text as tokens arrive, never splitting a UTF-8 character: text that ends in
    an incomplete byte sequence (decoded as U+FFFD) is held back until it completes.

    Only a short window of the latest tokens is decoded at each step (constant work per
    token, not the whole text again): the tokens from `prefix` to `read` were emitted
    already, and decoding them together with the new ones, then dropping their text,
    keeps whatever the decoder does at a sequence's start (a leading space) out of it.
    The window always moves on: special tokens (which decode() skips) never enter it, and
    a U+FFFD is held for at most HOLD tokens (below), so a model that emits stray bytes or
    specials for thousands of tokens still costs the same per token."""

    # A UTF-8 character is at most 4 bytes and every other token adds at least one byte,
    # so past this many held tokens only the last 3 can still complete a character.
    HOLD = 4

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.skip = getattr(tok, "special_ids", frozenset())
        self.ids: list[int] = []
        self.prefix = 0         # the window's start: context for decoding what follows
        self.read = 0           # tokens up to here are emitted

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        self.ids.append(token_id)
        return self._take(final=False)

    def flush(self) -> str:
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        ids, decode = self.ids, self.tok.decode
        done = decode(ids[self.prefix:self.read])
        text = decode(ids[self.prefix:])
        if final or not text.endswith("\ufffd"):
            return self._commit(len(ids), text, done)
        if len(ids) - self.read <= self.HOLD:
            return ""
        # Held too long: emit up to a cut before the last 3 tokens whose text is already
        # final (a prefix of the window's text: no character straddles the cut).
        for cut in range(len(ids) - 3, self.read, -1):
            head = decode(ids[self.prefix:cut])
            if len(head) >= len(done) and text.startswith(head):
                return self._commit(cut, head, done)
        return self._commit(len(ids), text, done)

    def _commit(self, end: int, text: str, done: str) -> str:
        self.prefix, self.read = self.read, end
        if self.prefix >= 4096:              # ids before the window are never read again
            del self.ids[:self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        return text[len(done):]


def token_ids(prompt) -> list[int]:
    """A prompt given as token ids: a sequence (or 1-D array) of integers."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise RequestError("prompt is bytes: pass text (str) or a list of token ids")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or (prompt.size and prompt.dtype.kind not in "iu"):
            raise RequestError(f"token ids: expected a 1-D integer array, got shape "
                               f"{list(prompt.shape)} of {prompt.dtype}")
        return [int(t) for t in prompt]
    try:
        items = list(prompt)
    except TypeError:
        raise RequestError(f"prompt of type {type(prompt).__name__}: pass text (str) or a "
                           f"list of token ids") from None
    for i, t in enumerate(items):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise RequestError(f"token id at position {i} is {t!r:.40} "
                               f"({type(t).__name__}): token ids are integers")
    return [int(t) for t in items]
