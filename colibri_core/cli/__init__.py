"""`colibri` command line: arguments -> config -> engine -> stream.

    colibri run [--config FILE | --model DIR] [--prompt TEXT | --prompt-ids 1,2,3 |
                --prompt-file PATH] [-n N] [--experts-per-token K] ...
    colibri inspect MODEL_DIR [--verify]
    colibri convert HF_DIR OUT_DIR [--bits 4|8|16|32] [--group-size G] [--calibration FILE]
                    [--lm-head-bits B] [--embed-bits B] [--kv-bits B]
                    [--tensor-bits CLASS=B,..] [--q4-clip mse|minmax] [--progress] [--force]
    colibri verify HF_DIR MODEL_DIR [--prompts FILE] [-n N] [--max-error X]
    colibri serve [--config NAME | --model DIR] [--host H] [--port P] ...  (docs/SERVE.md)
    colibri serve --ray [--replicas N | --autoscale MIN:MAX] ...            (docs/SCALE.md)

User mistakes (bad options included) print one line `colibri: error: ...` and exit 2;
Ctrl-C exits 130.

This package: main() and the parser assembled from one module per subcommand group
(run.py, inspect.py, convert.py: convert and verify, experts.py: expert build and experts
list | fingerprint; serve and replay are wired here, their options live in server/,
fleet/ and replay.py); args.py the shared parser class and argument types, modeldir.py
what a folder holds and the engine from --config / --model.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from ..errors import ColibriError
from . import convert, experts, inspect, run
from .args import CliParser, defaults_help, renamed


def cmd_serve(args) -> int:
    """`colibri serve`: one engine here (server/), or with --ray a fleet (fleet/)."""
    if args.ray:
        from ..fleet import main as fleet_main
        return fleet_main(args)
    from ..server import main as serve_main
    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    engine_defaults, builtin, shipped = defaults_help()
    p = CliParser(prog="colibri", description="CPU-first MoE inference engine")
    from ..server.surface import VersionAction
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_parser(sub, engine_defaults, builtin, shipped)
    inspect.add_parser(sub)
    experts.add_parsers(sub, engine_defaults, shipped)
    from ..fleet import add_arguments as fleet_arguments
    from ..server import add_arguments as serve_arguments
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with live experts "
                                      "(docs/SERVE.md; --ray: a fleet, docs/SCALE.md)")
    serve_arguments(sv)
    renamed(sv, "--top-k", "--experts-per-token K (experts per token)")
    fleet_arguments(sv)
    sv.set_defaults(func=cmd_serve)
    from .. import replay
    rp = sub.add_parser("replay", help="re-score an audit log's items under the expert set "
                                       "each names; report outputs that differ (docs/SERVE.md)")
    replay.add_arguments(rp)
    rp.set_defaults(func=replay.main)
    convert.add_parsers(sub)
    return p


def main(argv=None) -> int:
    logging.basicConfig(format="colibri: warning: %(message)s", level=logging.WARNING)
    # Generated text may hold characters a non-UTF-8 terminal cannot show: replaced, not a
    # UnicodeEncodeError in the middle of a run.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower() not in ("utf-8", "utf8"):
            stream.reconfigure(errors="replace")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["expert", "build"]:          # its own parser, options and all
        args = argparse.Namespace(func=experts.cmd_expert_build, rest=argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()                  # a full disk is reported here, not at exit
        return rc
    except ColibriError as e:
        for line in str(e).splitlines():
            line = line.removeprefix("colibri: ")      # some messages already carry it
            print(f"colibri: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EBADF):
            raise
        # stdout could not be written (a full disk, /dev/full): nothing more goes there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"colibri: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return 2

