"""`colibri expert build` (the builder's own parser) and `colibri experts list |
fingerprint`: what is live, read-only beside a running engine that holds the folder."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .args import CliParser, int_at_least, model_options
from .modeldir import engine_from_args, require_model_dir


def cmd_expert_build(args) -> int:
    from ..experts.hotplug.authoring.builder import main as build_main
    return build_main(args.rest, parser_class=CliParser)


def cmd_experts_list(args) -> int:
    held = _held_state_dir(args)
    if held is not None:              # a running engine (a server) holds the folder
        return _experts_list_read_only(args, *held)
    eng = engine_from_args(args)
    try:
        cfg = eng.model_cfg
        rows = []
        for L in cfg.moe_layers:
            for e in eng.weights.layers[L].experts:
                rows.append({"slot": e.index, "name": e.name, "version": "", "layers": [L],
                             "origin": "model file", "sha256": cfg.files[f"{e.name}.bin"].sha256,
                             "isolation": "inprocess", "status": "active", "refused": None,
                             "binding": "", "file": f"{e.name}.bin"})
        refused = []
        if eng.hotplug is not None:
            rows += eng.hotplug.list()
            refused = eng.hotplug.refused()
        if args.json:
            print(json.dumps({"expert_set_generation": eng.expert_set_generation,
                              "expert_set_id": eng.expert_set_id,
                              "model_fingerprint": eng.model_fingerprint, "experts": rows,
                              "refused": refused}, indent=1))
            return 0
        from ..experts.hotplug.listing import format_rows
        print(f"expert set generation {eng.expert_set_generation}, id {eng.expert_set_id}, "
              f"model fingerprint {eng.model_fingerprint[:16]}")
        print("\n".join(format_rows(rows)))
        keeps = {r["refused"]["path"]: r for r in rows if r.get("refused") and r["status"] == "active"}
        for f in refused:
            kept = keeps.get(f["path"])
            # a newer file rolled back from is not a failed check: say what it is
            what = "rolled back from" if f["reason"] == "rolled-back" else "refused"
            tail = f" ({kept['name']} {kept['version']} stays active)" \
                if kept and what == "refused" else ""
            print(f"{what} {f['path']}: {f['reason']}: {f['message']}{tail}")
    finally:
        eng.close()
    return 0


def _held_state_dir(args):
    """(experts_dir, state_dir) when a running manager holds the hot-plug state folder
    `experts list` would use (a server runs on it), else None."""
    from ..config import find_config, load_run_config
    from ..experts.hotplug.state import state_dir_in_use
    experts_dir, state_dir = getattr(args, "experts_dir", None), None
    if not args.model:
        cfg, _ = load_run_config(find_config(args.config or "builtin"))
        experts_dir = experts_dir or cfg.engine.experts_dir
        state_dir = cfg.engine.hotplug.state_dir
    if experts_dir is None:
        return None
    state_dir = state_dir or str(Path(experts_dir) / ".colibri-state")
    return (experts_dir, state_dir) if state_dir_in_use(state_dir) else None


def _experts_list_read_only(args, experts_dir: str, state_dir: str) -> int:
    """`experts list` beside a running engine: its state file and the folder, read-only
    (no lock taken, nothing loaded or written; the running engine's own view, with its
    refusals and history: GET /v1/experts, /v1/experts/events)."""
    from ..experts.hotplug.listing import folder_view, format_view
    view = folder_view(experts_dir, state_dir)
    if args.json:
        print(json.dumps({"read_only": True, "experts_dir": experts_dir,
                          "state_dir": state_dir, **view}, indent=1))
        return 0
    print(f"read-only: {state_dir} is held by a running engine; from its state file and the"
          f" folder (the engine's own view: GET /v1/experts, /v1/experts/events)")
    print("\n".join(format_view(view)))
    return 0


def cmd_experts_fingerprint(args) -> int:
    from ..model.fingerprint import fingerprint_for
    model = require_model_dir(args.model) if args.model else None
    print(fingerprint_for(args.config, model))
    return 0


def add_parsers(sub, engine_defaults: str, shipped: str) -> None:
    """`expert build` and `experts list | fingerprint`."""
    eb = sub.add_parser("expert", help="expert authoring: `colibri expert build ...`")
    eb_sub = eb.add_subparsers(dest="expert_command", required=True, metavar="SUBCOMMAND")
    b = eb_sub.add_parser("build", help="build a hot-pluggable expert .so from an .npz "
                                        "(`colibri expert build --help`)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER,
                   help="the builder's arguments (`colibri expert build --help`)")
    b.set_defaults(func=cmd_expert_build)

    el = sub.add_parser("experts", help="hot-plugged experts: `colibri experts list`")
    el_sub = el.add_subparsers(dest="experts_command", required=True, metavar="SUBCOMMAND")
    ls = el_sub.add_parser("list", help="what is live: model experts and hot-plugged ones")
    model_options(ls, "its model's experts are listed", engine_defaults, shipped)
    ls.add_argument("--experts-dir", dest="experts_dir", metavar="DIR",
                    help="the watched folder whose experts are checked and listed")
    ls.add_argument("--threads", type=int_at_least(1, 512), metavar="N",
                    help="compute threads (default: the config's)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_experts_list)
    fp = el_sub.add_parser("fingerprint", help="the model fingerprint an expert built for "
                                               "this model records (its base_model)")
    model_options(fp, "its model's fingerprint is printed", engine_defaults, shipped)
    fp.set_defaults(func=cmd_experts_fingerprint)
    pl = el_sub.add_parser("place", help="expert placement for N expert shards: a plan "
                                         "file (docs/SCALE.md, \"A model larger than one machine\")")
    pl.add_argument("model", metavar="MODEL", help="the model directory (or builtin)")
    pl.add_argument("--shards", type=int_at_least(1, 4096), required=True, metavar="N",
                    help="how many expert shards share each layer's routed experts")
    pl.add_argument("--load", metavar="JSON", help="routing statistics to balance by: "
                    "{\"<layer>\": [routed tokens per expert]} (default: by bytes alone)")
    pl.add_argument("--replicate", type=int_at_least(0, 4096), default=0, metavar="K",
                    help="the K hottest experts per layer on two shards (needs --load)")
    pl.add_argument("-o", "--output", required=True, metavar="PLAN.json",
                    help="where the plan is written (JSON, checked against the model at load)")
    pl.set_defaults(func=cmd_experts_place)
    from .candidates import add_candidate_parsers
    add_candidate_parsers(el_sub)
    from .train import add_train_parser
    add_train_parser(el_sub)


def cmd_experts_place(args) -> int:
    from ..files import write_atomic
    from ..fleet.expertplan import place, read_load
    model = args.model
    if model == "builtin" and not Path(model).exists():
        model = Path(__file__).resolve().parent.parent / "models" / "builtin"
    model = require_model_dir(model)
    plan = place(model, args.shards, read_load(args.load) if args.load else None, args.replicate)
    write_atomic(args.output, json.dumps(plan, indent=1) + "\n")
    mib = ", ".join(f"{b / 2**20:.1f}" for b in plan["bytes"])
    print(f"{args.output}: {len(plan['owners'])} MoE layers x {plan['num_experts']} experts "
          f"on {args.shards} shards; routed-expert MiB per shard: {mib}")
    return 0
