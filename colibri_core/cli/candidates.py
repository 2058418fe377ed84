"""`colibri experts candidates | canary | promote | drop | demote`: a running server's
candidate experts (docs/SERVE.md, "Candidates: shadow, canary, promote"), through its
HTTP API (the standard library's urllib: no client dependency)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000"


def _call(args, method: str, path: str, body: dict | None = None):
    """(status, JSON answer) of one request; a line on stderr and None when unreachable."""
    url = args.url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"})
    key = _api_key(args)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": {"message": f"HTTP {e.code} from {url}"}}
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        print(f"colibri: cannot reach {url}: {reason} (is `colibri serve` running there? "
              f"--url URL)", file=sys.stderr)
        return None


def _api_key(args) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                return f.readline().strip()
        except OSError as e:
            raise SystemExit(f"colibri: --api-key-file {args.api_key_file}: {e.strerror}")
    return os.environ.get("COLIBRI_API_KEY")


def _answer(got, quiet_json: bool = False) -> int:
    if got is None:
        return 1
    status, body = got
    if status >= 400:
        msg = (body.get("error") or {}).get("message", body)
        print(f"colibri: {msg}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=1))
    return 0


def cmd_candidates(args) -> int:
    got = _call(args, "GET", "/v1/experts")
    if got is None or got[0] >= 400 or args.json:
        if got is not None and got[0] < 400:
            print(json.dumps(got[1].get("candidates", []), indent=1))
            return 0
        return _answer(got)
    rows = got[1].get("candidates", [])
    if not rows:
        folder = got[1].get("candidates_folder")
        print("no candidates" + (f" (drop one into {folder})" if folder else
                                 " (the server has no shadow/ folder)"))
        return 0
    for c in rows:
        g = c["gate"]
        fb = g["feedback"]
        agree = "-" if g["agreement"] is None else f"{g['agreement']:.4f}"
        print(f"{c['name']} {c['version']} slot {c['slot']} {c['state']} fraction "
              f"{c['fraction']:g}: items {g['items']}, routed {g['routed']}, changed "
              f"{g['changed']} (agreement {agree}), canary {g['canary']}, labelled "
              f"{fb['labelled']} ({fb['positives']} positives compared); set "
              f"{(c['expert_set'] or {}).get('id', '-')[:12]}")
    return 0


def cmd_canary(args) -> int:
    return _answer(_call(args, "POST", f"/v1/experts/candidates/{args.name}",
                         {"fraction": args.fraction}))


def cmd_action(args) -> int:
    return _answer(_call(args, "POST", f"/v1/experts/candidates/{args.name}/{args.action}"))


def server_options(p):
    """--url, --api-key-file, --timeout: the options of a command that talks to a server."""
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="its API key's file (default: $COLIBRI_API_KEY)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the server (default 30)")
    return p


def add_candidate_parsers(sub) -> None:
    """Under `colibri experts`."""
    common = server_options
    ls = common(sub.add_parser("candidates", help="a running server's candidate experts "
                                                  "and their gates"))
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_candidates)
    ca = common(sub.add_parser("canary", help="send a share of requests (by a hash of "
                                              "their id) to a candidate; 0: shadow only"))
    ca.add_argument("name", help="the candidate's name (`colibri experts candidates`)")
    ca.add_argument("fraction", type=_fraction, help="the share of request ids, 0..1")
    ca.set_defaults(func=cmd_canary)
    for action, what in (("promote", "move a candidate into the live set"),
                         ("drop", "move a candidate to shadow/dropped/"),
                         ("demote", "undo a promotion (previous version back, or the "
                                    "file back in shadow/)")):
        p = common(sub.add_parser(action, help=what))
        p.add_argument("name", help="the candidate's name (`colibri experts candidates`)")
        p.set_defaults(func=cmd_action, action=action)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction 0..1")
    return v
