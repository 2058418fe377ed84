"""`colibri experts train`: a training job on a running server (POST /v1/experts/train,
docs/SERVE.md "Training a candidate"), followed until it is built or has failed."""
from __future__ import annotations

import sys
import time

from ..files import read_json_lines
from .args import int_at_least
from .candidates import _answer, _call, server_options


def read_examples(path: str) -> list:
    """The examples of a local JSON-lines file (the server checks each one's fields)."""
    def bad_line(n):
        return SystemExit(f"colibri: --examples {path} line {n}: not JSON; expected one "
                          f"example {{\"prompt\": [token ids], \"target\": token id, "
                          f"\"route\": true|false}} per line")
    try:
        return read_json_lines(path, bad_line)
    except OSError as e:
        raise SystemExit(f"colibri: --examples {path}: {e.strerror}") from None


def new_lines(seen: list, log: list) -> list:
    """The lines of the job's log (its last 8) not printed yet: after the longest overlap
    of what was printed last time with the start of the log now."""
    for k in range(min(len(seen), len(log)), 0, -1):
        if seen[-k:] == log[:k]:
            return log[k:]
    return log


def cmd_train(args) -> int:
    body = {"name": args.name, "version": args.version, "steps": args.steps,
            "seed": args.seed, "routed_weight": args.routed_weight}
    if args.layer is not None:
        body["layer"] = args.layer
    if args.examples:
        body["examples"] = read_examples(args.examples)
    else:
        body["path"] = args.path
    got = _call(args, "POST", "/v1/experts/train", body)
    if got is None or got[0] >= 400:
        return _answer(got)
    job = got[1]
    print(f"{job['id']}: {job['name']} {job['version']} {job['status']}", flush=True)
    if args.no_wait:
        return 0
    status, seen = job["status"], []
    while job["status"] not in ("built", "failed"):
        time.sleep(args.interval)
        got = _call(args, "GET", f"/v1/experts/train/{job['id']}")
        if got is None or got[0] >= 400:
            return _answer(got)
        job = got[1]
        for line in new_lines(seen, job["log"]):
            print(f"{job['id']}: {line}", flush=True)
        seen = job["log"]
        if job["status"] != status:
            status = job["status"]
            if status not in ("built", "failed"):
                print(f"{job['id']}: {status}", flush=True)
    if job["status"] == "failed":
        print(f"colibri: training job {job['id']} failed: {job['reason']}", file=sys.stderr)
        return 1
    r = job["result"] or {}
    acc = ""
    if "accuracy_before" in r and "accuracy_after" in r:
        acc = f"; accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}"
    print(f"{job['id']}: built {job['candidate']} ({r.get('examples', '?')} examples, "
          f"{r.get('routed_examples', '?')} routed{acc}); now a candidate in shadow: "
          f"`colibri experts candidates`", flush=True)
    return 0


def add_train_parser(sub) -> None:
    """Under `colibri experts`."""
    t = server_options(sub.add_parser(
        "train", help="train a new expert on a running server (--allow-expert-training) "
                      "and follow the job until it is a candidate"))
    t.add_argument("name", help="the new expert's name (letters, digits, _.-)")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--examples", metavar="FILE.jsonl",
                     help="a local JSON-lines file of labelled examples, sent in the "
                          "request: {\"prompt\": [token ids], \"target\": id, \"route\": bool}")
    src.add_argument("--path", metavar="NAME.jsonl",
                     help="such a file on the server, under its --train-data-dir")
    t.add_argument("--version", default="1", help="the expert's version (default 1)")
    t.add_argument("--layer", type=int_at_least(0, 4096), metavar="L",
                   help="the MoE layer (default: the last, the only one the recipe trains)")
    t.add_argument("--steps", type=int_at_least(1, 100_000), default=1500, metavar="N",
                   help="the recipe's end-to-end training steps (default 1500)")
    t.add_argument("--seed", type=int_at_least(0, 2**31 - 1), default=0, metavar="S",
                   help="the training seed (default 0)")
    t.add_argument("--routed-weight", dest="routed_weight", type=float, default=0.7,
                   metavar="W", help="the loss weight of the route examples (default 0.7)")
    t.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often the job is polled (default 2)")
    t.add_argument("--no-wait", dest="no_wait", action="store_true",
                   help="print the job's id and return without following it")
    t.set_defaults(func=cmd_train)
