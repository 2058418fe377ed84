"""What every `colibri` subcommand's parser shares: the parser class with the project's
one-line errors, the argument types (ranges, token ids, trace kinds), and the
--config / --model options with the defaults their help names."""
from __future__ import annotations

import argparse
import re


class CliParser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: `colibri: error: ...`, exit 2."""

    def error(self, message):
        self.exit(2, f"colibri: error: {message} (see `{self.prog} --help`)\n")


def int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer in lo..hi, with a message naming both."""
    want = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"

    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}")
        return v
    conv.__name__ = "integer"
    return conv


def number_in(lo: float, hi: float | None = None, lo_open: bool = False):
    """An argparse type: a number >= lo (> lo when lo_open) and <= hi."""
    want = (f"a number {'>' if lo_open else '>='} {lo:g}"
            + (f" and <= {hi:g}" if hi is not None else ""))

    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}") from None
        if not (v > lo if lo_open else v >= lo) or (hi is not None and v > hi) or v != v:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {want}")
        return v
    conv.__name__ = "number"
    return conv


def renamed(parser, old: str, new: str) -> None:
    """An option that was renamed: refused with one line naming the new one."""
    class Refuse(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None):
            p.error(f"{old} was renamed: use {new}")
    parser.add_argument(old, nargs="?", action=Refuse, metavar="_",
                        help=f"renamed: refused, use {new}")


def token_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3` (commas and/or spaces) -> [1, 2, 3]."""
    parts = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    bad = next((t for t in parts if not t.isdigit()), None)
    if not parts or bad is not None:
        shown = repr(bad) if bad is not None else "nothing"
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}: expected token ids as integers >= 0 separated by commas "
            f"(e.g. 1,2,3), got {shown}")
    return [int(t) for t in parts]


DEBUG_KINDS = ("routing", "memory", "timing")


def debug_kinds(text: str) -> list[str]:
    """`--debug routing,timing` (or `all`) -> the trace kinds."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if kinds == ["all"]:
        return list(DEBUG_KINDS)
    bad = [k for k in kinds if k not in DEBUG_KINDS]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(DEBUG_KINDS)}, or all")
    return kinds


def defaults_help() -> tuple[str, str, str]:
    """What applies without --config / with --model: the engine defaults, the built-in
    config's sampling settings and the shipped configs' names (read from EngineConfig and
    configs/, not repeated here)."""
    from ..config import EngineConfig, configs_dir, find_config, read_mapping
    d = EngineConfig().sampling
    engine_defaults = (f"temperature {d.temperature:g}, top-p {d.top_p:g}, "
                       f"seed {'random' if d.seed is None else d.seed}, threads "
                       f"{EngineConfig().threads}")
    try:
        b = read_mapping(find_config("builtin")).get("engine", {}).get("sampling", {})
        builtin = (f"temperature {b.get('temperature', d.temperature):g}, top-p "
                   f"{b.get('top_p', d.top_p):g}, seed {b.get('seed', 'random')}")
    except Exception:           # the help must print even from a damaged install
        builtin = "see configs/builtin.yaml"
    shipped = ", ".join(sorted(p.stem for p in configs_dir().glob("*.y*ml"))) or "none"
    return engine_defaults, builtin, shipped


def model_options(ap, what: str, engine_defaults: str, shipped: str) -> None:
    """--config / --model, shared by `run` and `experts list`."""
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE|NAME",
                     help=f"run config (YAML/JSON: `model:` and `engine:` settings) or the name "
                          f"of a shipped one: {shipped} (default: builtin); {what}")
    src.add_argument("--model", metavar="DIR",
                     help=f"a converted model directory, run with the engine defaults "
                          f"({engine_defaults}), not a config's settings; to give it "
                          f"settings, write a config with `model: DIR` and use --config")
