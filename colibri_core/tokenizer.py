"""Text <-> token ids, with UTF-8-safe incremental decoding for streaming."""
from __future__ import annotations

from pathlib import Path

from .errors import ModelFormatError, RequestError


class Tokenizer:
    def __init__(self, path: Path, vocab_size: int):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelFormatError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0]})") from None
        self.path = Path(path)
        self.vocab_size = vocab_size
        n = self._tok.get_vocab_size(with_added_tokens=True)
        # A model vocabulary padded above the tokenizer's size is normal; the reverse is not.
        if n > vocab_size:
            raise ModelFormatError(f"{path}: tokenizer has {n} tokens but the model's "
                                   f"vocab_size is {vocab_size}; ids >= {vocab_size} would "
                                   f"be out of range (wrong tokenizer for this model?)")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, s: str):
        return self._tok.token_to_id(s)


class StreamDecoder:
    """Emits text as tokens arrive, never splitting a UTF-8 character: text that ends in
    an incomplete byte sequence (decoded as U+FFFD) is held back until it completes."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.emitted = 0        # characters of the decoded text already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted:]
        self.emitted = len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new = text[self.emitted:]
        self.emitted = len(text)
        return new
