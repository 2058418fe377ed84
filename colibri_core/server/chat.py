"""Chat templates: the checkpoint's own Jinja template turns messages into a prompt.

Where it comes from, first found wins: `chat_template.jinja` in the model directory, or
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: the
one named "default"). The converter keeps both files. It is rendered as Hugging Face
renders it: jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
the loop controls extension, `raise_exception`, `strftime_now` and a `tojson` that keeps
non-ASCII text and takes indent/separators/sort_keys, with the tokenizer's special tokens
(bos_token, eos_token, ...) and add_generation_prompt=True.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Optional

from ..files import read_text
from ..nesting import json_loads
from .errors import ApiError, bad_request

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                  "cls_token", "mask_token")


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, source: str, specials: Optional[dict] = None, origin: str = ""):
        self.source = source
        self.origin = origin
        self.specials = specials or {}
        self._compiled = compile_template(source)

    @classmethod
    def from_model_dir(cls, model_dir) -> Optional["ChatTemplate"]:
        """The model's template, or None when it has none."""
        d = Path(model_dir)
        cfg = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json_loads(read_text(tc))
            except (OSError, ValueError) as e:     # TooDeep is a ValueError
                cfg = {}
                logging.getLogger("colibri.server").warning(
                    "%s: not read (%s); the chat template and special tokens from it are "
                    "not used", tc, str(e).splitlines()[0] if str(e) else type(e).__name__)
            if not isinstance(cfg, dict):
                logging.getLogger("colibri.server").warning(
                    "%s: expected a JSON object, found %s; not used", tc, type(cfg).__name__)
                cfg = {}
        specials = {}
        for name in SPECIAL_TOKENS:
            v = cfg.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                specials[name] = v
        jf = d / "chat_template.jinja"
        if jf.is_file():
            return cls(read_text(jf), specials, str(jf))
        t = cfg.get("chat_template")
        if isinstance(t, list):
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default")
        if isinstance(t, str) and t:
            return cls(t, specials, f"{tc} chat_template")
        return None

    def render(self, messages: list, add_generation_prompt: bool = True,
               tools: Optional[list] = None, **extra) -> str:
        """`tools`: OpenAI's list of {type: function, function: {...}}, passed to the
        template as transformers passes it (None: no tools)."""
        import jinja2
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.specials, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise bad_request(f"messages: the model's chat template refused them: {e}",
                              param="messages", code="chat_template") from None
        except Exception as e:  # noqa: BLE001 - a template bug is the model's, not a crash
            raise ApiError(400, f"messages: the model's chat template ({self.origin}) failed: "
                                f"{type(e).__name__}: {e}", param="messages",
                           code="chat_template") from None

    def prompt_ids(self, messages: list, tokenizer, keep_chars: int,
                   tools: Optional[list] = None, **extra) -> list:
        """The conversation's prompt tokens. Only the end of a prompt longer than the
        context can stay (the engine keeps its last tokens), so no more than `keep_chars`
        characters of the rendered text are tokenized, as the engine does for text.
        `extra`: more template variables (gpt-oss's `reasoning_effort`)."""
        text = self.render(messages, tools=tools, **extra)
        return tokenizer.encode(text[-keep_chars:] if len(text) > keep_chars else text)
