"""JSON and YAML that nest too deep: one typed line, never a RecursionError or a crash.

Every file Colibri parses nests a few levels (a run config, config.json, a section
table, the hot-plug state, an audit log line, a probe's verdict). A file of 100,000 `[`
used to end in a RecursionError traceback (json) or kill the process with SIGSEGV
(libyaml's composer recurses in C). `TooDeep` is a ValueError, so every reader that
already turns a ValueError into its own typed error (naming the file) does so here too.
"""
from __future__ import annotations

import json
from typing import Any

# YAML is checked on its event stream before it is composed (C parser, no recursion);
# Python's composer recurses twice per level, so this leaves room under its limit.
YAML_MAX_DEPTH = 200


class TooDeep(ValueError):
    pass


def json_loads(data: str | bytes) -> Any:
    """json.loads, with nesting past the parser's recursion limit (about 1,000 levels)
    raised as TooDeep."""
    try:
        return json.loads(data)
    except RecursionError:
        raise TooDeep("arrays/objects nested deeper than the JSON parser allows (about "
                      "1,000 levels); Colibri's files nest a few levels") from None


def guarded(parse, text) -> Any:
    """parse(text) for any other recursive parser (tomllib: expert.toml), with a
    RecursionError raised as TooDeep."""
    try:
        return parse(text)
    except RecursionError:
        raise TooDeep("nested deeper than the parser allows (about 1,000 levels); "
                      "Colibri's files nest a few levels") from None


def yaml_load(text: str, loader) -> Any:
    """yaml.load(text, Loader=loader), refusing nesting deeper than YAML_MAX_DEPTH before
    anything is composed."""
    import yaml
    depth = 0
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > YAML_MAX_DEPTH:
                raise TooDeep(f"sequences/mappings nested deeper than {YAML_MAX_DEPTH} "
                              f"levels; Colibri's files nest a few levels")
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
    try:
        return yaml.load(text, Loader=loader)
    except RecursionError:
        raise TooDeep("nested deeper than the YAML parser allows") from None
