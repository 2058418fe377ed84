"""`colibri` command line: arguments -> config -> engine -> stream.

    colibri run [--config FILE | --model DIR] [--prompt TEXT] [-n N] [--top-k K] ...
    colibri inspect MODEL_DIR [--verify]
    colibri convert HF_DIR OUT_DIR [--bits 4|8|16|32] [--group-size G] [--calibration FILE]
                    [--lm-head-bits B] [--embed-bits B] [--kv-bits B] [--q4-clip mse|minmax]
                    [--progress] [--force]
    colibri verify HF_DIR MODEL_DIR [--prompts FILE] [-n N] [--max-error X]
    colibri serve [--config NAME | --model DIR] [--host H] [--port P] ...  (docs/SERVE.md)

User mistakes print one line `colibri: error: ...` and exit 2; Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from .errors import ColibriError


def _engine_from_args(args):
    from .config import EngineConfig, find_config, load_run_config, parse
    from .engine import Engine
    overrides = {}
    if args.threads is not None:
        overrides["threads"] = args.threads
    if getattr(args, "load_mode", None):
        overrides["load_mode"] = args.load_mode
    if getattr(args, "routing", None):
        overrides["routing"] = args.routing
    if getattr(args, "activations", None):
        overrides["activations"] = args.activations
    if getattr(args, "plugins_dir", None):
        overrides["plugins_dir"] = args.plugins_dir
    if getattr(args, "experts_dir", None):
        overrides["experts_dir"] = args.experts_dir
    if getattr(args, "debug", None):
        kinds = [k.strip() for k in args.debug.split(",") if k.strip()]
        overrides["debug"] = ["routing", "memory", "timing"] if kinds == ["all"] else kinds
    if getattr(args, "max_resident_mb", None) is not None:
        overrides["max_resident_mb"] = args.max_resident_mb
    if args.model:
        base = EngineConfig()
        model_dir = Path(args.model)
    else:
        cfg, model_dir = load_run_config(find_config(args.config or "builtin"))
        base = cfg.engine
    res = {}
    if getattr(args, "expert_cache", None):
        res["policy"] = args.expert_cache
    if getattr(args, "speculative", False):
        res["speculative"] = True
    if res:
        overrides["residency"] = {**base.residency.model_dump(), **res}
    engine_cfg = parse(EngineConfig, {**base.model_dump(), **overrides}, "command line")
    return Engine(model_dir, engine_cfg)


def cmd_run(args) -> int:
    eng = _engine_from_args(args)
    try:
        prompt = args.prompt
        if prompt is None:
            prompt = "The "
        gen = eng.generate(prompt, max_new_tokens=args.n, top_k=args.top_k,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           stop=args.stop)
        out = sys.stdout
        if not args.quiet:
            print(f"colibri: model {eng.model_dir} | {eng.model_cfg.architecture}, "
                  f"{eng.model_cfg.num_layers} layers ({len(eng.model_cfg.moe_layers)} MoE), "
                  f"k={gen.k} ({gen.k_source}), threads={eng.config.threads}", file=sys.stderr)
            plan = eng.model.residency.plan
            if plan is not None:
                from .residency import MiB
                cap = eng.model.residency.capacity
                print(f"colibri: budget {plan.budget / MiB:.0f} MB = non-expert weights "
                      f"{plan.dense / MiB:.1f} + KV cache {plan.kv / MiB:.1f} + activations "
                      f"{plan.act / MiB:.1f} (prefill chunks of {plan.chunk_tokens} tokens) + "
                      f"expert cache {cap / MiB:.1f} MB ({cap // max(plan.expert_bytes, 1)} "
                      f"experts of {plan.expert_bytes / MiB:.2f} MB, {eng.config.load_mode})",
                      file=sys.stderr)
        shown = prompt.split("|", 1)[1] if prompt.startswith("MODE:") and "|" in prompt else prompt
        out.write(shown)
        out.flush()
        from .residency import proc_read_bytes
        read0 = proc_read_bytes()
        t0 = time.perf_counter()
        first = None
        for ev in gen:
            if first is None:
                first = time.perf_counter() - t0
            out.write(ev.text)
            out.flush()
        dt = time.perf_counter() - t0
        out.write("\n")
        n = len(gen.token_ids)
        if not args.quiet:
            decode = (n - 1) / (dt - first) if n > 1 and first is not None and dt > first else 0.0
            print(f"colibri: {n} tokens, stop={gen.stop_reason}, first token "
                  f"{(first or 0) * 1000:.0f} ms, decode {decode:.1f} tok/s", file=sys.stderr)
            print(_memory_line(eng, read0, n), file=sys.stderr)
    finally:
        eng.close()
    return 0


def _memory_line(eng, read0, n_tokens: int) -> str:
    """`colibri: memory ...`: the budget, what is resident (RSS, the model files' page
    cache), the expert cache's hit rate, bytes read from disk per generated token."""
    from .residency import MiB, proc_read_bytes
    r = eng.memory_report()
    pc = r.get("page_cache", {})
    parts = []
    if r.get("budget"):
        parts.append(f"budget {r['budget'] / MiB:.0f} MB")
    parts.append(f"RSS {r.get('VmRSS', 0) / MiB:.0f} MB (peak {r.get('VmHWM', 0) / MiB:.0f})")
    parts.append(f"model page cache {sum(pc.values()) / MiB:.0f} MB "
                 f"(experts {pc.get('expert_files', 0) / MiB:.0f})")
    if r.get("budget"):
        parts.append(f"expert cache {r['expert_cache_bytes'] / MiB:.0f}/{r['capacity'] / MiB:.0f} MB")
        if r.get("hit_rate") is not None:
            parts.append(f"hit rate {100 * r['hit_rate']:.1f}%")
        spec = r.get("speculation")
        if spec and spec.get("hit_rate") is not None:
            parts.append(f"speculation {100 * spec['hit_rate']:.1f}%")
    rb = proc_read_bytes()
    if rb is not None and read0 is not None:
        per = (rb - read0) / max(n_tokens, 1)
        parts.append(f"read {(rb - read0) / MiB:.1f} MB ({per / MiB:.2f} MB/token)")
    return "colibri: memory: " + " | ".join(parts)


def cmd_inspect(args) -> int:
    from .config import load_model_config
    from .modelfile import ContainerFile
    from .weights import load_model, verify_checksums
    path = Path(args.model_dir)
    w = load_model(path)          # validates sizes, tables and shapes
    cfg = w.cfg
    total = sum(f.size for f in w.files)
    print(f"{path}: {cfg.architecture}, format {cfg.format.major}.{cfg.format.minor}")
    print(f"  layers {cfg.num_layers}: " + "".join("D" if t == "dense" else "M" for t in cfg.layer_types)
          + f"  (D dense, M MoE)")
    print(f"  hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_size}, "
          f"vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}")
    if cfg.moe_layers:
        print(f"  experts {cfg.num_experts} x {cfg.expert_intermediate}, top_k {cfg.top_k}, "
              f"scoring {cfg.scoring_func}, norm_topk_prob {cfg.norm_topk_prob}, shared "
              f"{cfg.shared_expert_intermediate_size or 'none'}")
    print(f"  files {len(w.files)}, {total / 2**20:.2f} MiB")
    main = w.files[0]
    for s in main.sections.values():
        if s.name in ("embed", "lm_head") or s.name.startswith("layer.0."):
            g = f" g{s.group_size}" if s.group_size else ""
            print(f"    {s.name:24s} {s.dtype}{g} {list(s.shape)}")
    w.close()
    if args.verify:
        from .validate import scan_model_dir
        problems = verify_checksums(path)            # sha256 of every file
        values = scan_model_dir(path)                # NaN/Inf in any section
        for p in problems + values:
            print(f"  FAIL {p}")
        if problems or values:
            raise ColibriError(f"{path}: verification failed: {len(problems)} file(s) do not "
                               f"match their sha256, {len(values)} section(s) hold NaN/Inf "
                               f"or bad scales (details above)")
        print(f"  verify: all {len(cfg.files)} files match their sha256; no NaN/Inf in any "
              f"section")
    return 0


def cmd_convert(args) -> int:
    from .convert import convert
    t0 = time.perf_counter()
    cfg = convert(args.hf_dir, args.out_dir, bits=args.bits, group_size=args.group_size,
                  lm_head_bits=args.lm_head_bits, embed_bits=args.embed_bits,
                  kv_bits=args.kv_bits, q4_clip=args.q4_clip,
                  calibration=args.calibration, progress=args.progress or sys.stderr.isatty(),
                  overwrite=args.force)
    q = cfg.quantization
    print(f"colibri: converted {args.hf_dir} -> {args.out_dir} ({cfg.architecture}, "
          f"{q.get('method', '?')} {q.get('bits', '?')}-bit, {len(cfg.files)} files) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from .convert.verify import verify
    res = verify(args.hf_dir, args.model_dir, args.prompts, n_new=args.n,
                 routing=args.routing, activations=args.activations)
    if args.max_error is not None and any(r.max_rel_err is not None and r.max_rel_err > args.max_error
                                          for r in res):
        raise ColibriError(f"max relative logit error above --max-error {args.max_error}")
    return 0


def cmd_expert_build(args) -> int:
    from .hotplug.builder import main as build_main
    return build_main(args.rest)


def cmd_experts_list(args) -> int:
    eng = _engine_from_args(args)
    try:
        cfg = eng.model_cfg
        rows = []
        for L in cfg.moe_layers:
            for e in eng.weights.layers[L].experts:
                rows.append({"slot": e.index, "name": e.name, "version": "", "layers": [L],
                             "origin": "model file", "sha256": cfg.files[f"{e.name}.bin"].sha256,
                             "isolation": "inprocess", "status": "active"})
        if eng.hotplug is not None:
            rows += eng.hotplug.list()
        if args.json:
            print(json.dumps({"expert_set_version": eng.expert_set_version, "experts": rows}, indent=1))
            return 0
        print(f"expert set version {eng.expert_set_version}")
        print(f"{'slot':>4}  {'name':20s} {'version':8s} {'layers':10s} {'origin':12s} "
              f"{'isolation':10s} {'status':9s} sha256")
        for r in rows:
            print(f"{r['slot']:>4}  {r['name']:20.20s} {r['version']:8.8s} "
                  f"{','.join(map(str, r['layers'])):10s} {r['origin']:12s} {r['isolation']:10s} "
                  f"{r['status']:9s} {r['sha256'][:12]}")
    finally:
        eng.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri", description="CPU-first MoE inference engine")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="generate text, streaming tokens to the terminal")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--config", help="run config file or shipped config name (default: builtin)")
    src.add_argument("--model", help="model directory (engine defaults)")
    r.add_argument("--prompt", "-p", help="prompt text; may start with MODE:kN|")
    r.add_argument("-n", type=int, default=64, help="max new tokens (default 64)")
    r.add_argument("--top-k", type=int, dest="top_k", help="experts per token for this request")
    r.add_argument("--threads", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--temperature", type=float)
    r.add_argument("--top-p", type=float, dest="top_p")
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--load-mode", choices=["mmap", "copy"])
    r.add_argument("--routing", choices=["fixed", "float"])
    r.add_argument("--activations", choices=["int8", "float"])
    r.add_argument("--experts-dir", dest="experts_dir", help="watch this folder for hot-plugged experts")
    r.add_argument("--debug", help="trace lines to stderr: routing,memory,timing (or all)")
    r.add_argument("--plugins-dir", dest="plugins_dir", help="folder of plugin modules")
    r.add_argument("--max-resident-mb", type=float, dest="max_resident_mb",
                   help="hard budget (MiB) for the model's resident memory: weights in RSS "
                        "and page cache, KV cache, activations (expert cache)")
    r.add_argument("--expert-cache", choices=["lru", "lfu"], dest="expert_cache",
                   help="expert cache policy under a budget (default lfu)")
    r.add_argument("--speculative", action="store_true",
                   help="under a budget: guess the next layer's experts and load them early")
    r.add_argument("--quiet", "-q", action="store_true", help="print only the text")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="describe (and optionally verify) a model directory")
    i.add_argument("model_dir")
    i.add_argument("--verify", action="store_true", help="check every file's sha256")
    i.set_defaults(func=cmd_inspect)

    eb = sub.add_parser("expert", help="expert authoring: `colibri expert build ...`")
    eb_sub = eb.add_subparsers(dest="expert_command", required=True)
    b = eb_sub.add_parser("build", help="build a hot-pluggable expert .so from an .npz",
                          add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_expert_build)

    el = sub.add_parser("experts", help="hot-plugged experts: `colibri experts list`")
    el_sub = el.add_subparsers(dest="experts_command", required=True)
    ls = el_sub.add_parser("list", help="what is live: model experts and hot-plugged ones")
    src = ls.add_mutually_exclusive_group()
    src.add_argument("--config")
    src.add_argument("--model")
    ls.add_argument("--experts-dir", dest="experts_dir", help="the watched folder")
    ls.add_argument("--threads", type=int)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_experts_list)

    from .server import add_arguments as serve_arguments, main as cmd_serve
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with live experts "
                                      "(docs/SERVE.md)")
    serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    c.add_argument("--bits", type=int, default=4, choices=[4, 8, 16, 32],
                   help="4: q4 (embedding, lm_head and K/V q8), 8: q8, 16: the checkpoint's "
                        "own bf16/f16, 32: f32")
    c.add_argument("--group-size", type=int, default=128, dest="group_size",
                   help="quantization group size, a multiple of 64 (default 128)")
    c.add_argument("--kv-bits", type=int, choices=[4, 8, 16, 32], dest="kv_bits",
                   help="attention K/V projections (default 8 under --bits 4)")
    c.add_argument("--lm-head-bits", type=int, choices=[4, 8, 16, 32], dest="lm_head_bits",
                   help="override the lm_head's precision (default: 8 under --bits 4)")
    c.add_argument("--embed-bits", type=int, choices=[4, 8, 16, 32], dest="embed_bits",
                   help="override the embedding's precision (default: 8 under --bits 4; "
                        "the lm_head's when tied)")
    c.add_argument("--q4-clip", choices=["mse", "minmax"], dest="q4_clip",
                   help="q4 scale/zero point per group: mse (min/max or a shrunk range, "
                        "whichever has the smaller squared error) or minmax (plain RTN); "
                        "default mse, minmax with --calibration")
    c.add_argument("--calibration", metavar="FILE",
                   help="text file: AWQ activation-aware scales from the model's activations")
    c.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    c.add_argument("--force", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=cmd_convert)

    v = sub.add_parser("verify", help="compare a converted model with its Hugging Face source")
    v.add_argument("hf_dir")
    v.add_argument("model_dir")
    v.add_argument("--prompts", metavar="FILE", help="one prompt per line (text, or token ids)")
    v.add_argument("-n", type=int, default=16, help="greedy tokens compared per prompt")
    v.add_argument("--routing", choices=["fixed", "float"], default="fixed")
    v.add_argument("--activations", choices=["int8", "float"], default="int8")
    v.add_argument("--max-error", type=float, dest="max_error",
                   help="exit non-zero when a prompt's max relative logit error exceeds this")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv=None) -> int:
    logging.basicConfig(format="colibri: warning: %(message)s", level=logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["expert", "build"]:          # its own parser, options and all
        args = argparse.Namespace(func=cmd_expert_build, rest=argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ColibriError as e:
        for line in str(e).splitlines():
            print(f"colibri: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
