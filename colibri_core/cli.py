"""`colibri` command line: arguments -> config -> engine -> stream.

    colibri run [--config FILE | --model DIR] [--prompt TEXT | --prompt-ids 1,2,3 |
                --prompt-file PATH] [-n N] [--top-k K] ...
    colibri inspect MODEL_DIR [--verify]
    colibri convert HF_DIR OUT_DIR [--bits 4|8|16|32] [--group-size G] [--calibration FILE]
                    [--lm-head-bits B] [--embed-bits B] [--kv-bits B]
                    [--tensor-bits CLASS=B,..] [--q4-clip mse|minmax] [--progress] [--force]
    colibri verify HF_DIR MODEL_DIR [--prompts FILE] [-n N] [--max-error X]
    colibri serve [--config NAME | --model DIR] [--host H] [--port P] ...  (docs/SERVE.md)
    colibri serve --ray [--replicas N | --autoscale MIN:MAX] ...            (docs/SCALE.md)

User mistakes (bad options included) print one line `colibri: error: ...` and exit 2;
Ctrl-C exits 130.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from .errors import ColibriError


ECHO_MAX_CHARS = 200        # a longer prompt is echoed as "…" + its last this many characters


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


def dir_kind(path: Path) -> str:
    """What a folder holds: "colibri" (a Colibri model: config.json with `format`/`files`),
    "hf" (a Hugging Face checkpoint: config.json with `model_type`, or *.safetensors),
    "missing", "file", or "other". A config.json that is there but not a regular file
    (a FIFO, a device, a folder) raises ConfigError naming it: it is never waited on."""
    from .errors import ConfigError
    from .files import check_regular, read_text
    from .nesting import json_loads
    try:
        if not path.exists():
            return "missing"
        if not path.is_dir():
            return "file"
        cfg = path / "config.json"
        cfg_there = cfg.exists()
    except OSError as e:            # a folder we may not search (mode 000): say so
        raise ConfigError(f"{path}: cannot read the folder: {e.strerror}") from None
    data = None
    if cfg_there:
        check_regular(cfg, cfg.stat(), ConfigError)
        try:
            data = json_loads(read_text(cfg, ConfigError))
        except (ColibriError, ValueError):
            return "colibri"          # a damaged model: let the loader name the problem
    if isinstance(data, dict) and ("format" in data or "files" in data):
        return "colibri"
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        return "hf"
    if data is None and any(path.glob("*.safetensors")):
        return "hf"
    return "colibri" if data is not None else "other"


def require_model_dir(path, what: str = "model directory") -> Path:
    """A Colibri model directory, or a one-line ColibriError saying what `path` is instead
    and what to do (convert a checkpoint, or the model folder found inside it)."""
    path = Path(path)
    kind = dir_kind(path)
    if kind == "colibri":
        return path
    if kind == "missing":
        raise ColibriError(f"{path}: {what} not found")
    if kind == "file":
        raise ColibriError(f"{path}: is a file; expected a Colibri {what} (a folder with "
                           f"config.json and the model's .bin files)")
    if kind == "hf":
        raise ColibriError(f"{path} is a Hugging Face checkpoint, not a Colibri model "
                           f"directory; convert it with `colibri convert {path} OUT_DIR`")
    inside = sorted(str(c.parent) for c in path.glob("*/config.json")
                    if dir_kind(c.parent) == "colibri")[:3]
    hint = (f"did you mean {' or '.join(inside)}?" if inside else
            "convert a Hugging Face checkpoint with `colibri convert HF_DIR OUT_DIR`")
    raise ColibriError(f"{path} is not a Colibri model directory (no config.json); {hint}")


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
        overrides["debug"] = args.debug
    # one limit from the command line replaces the config file's of either kind
    if getattr(args, "max_resident_mb", None) is not None:
        overrides["max_resident_mb"] = args.max_resident_mb
        overrides["process_limit_mb"] = None
    if getattr(args, "process_limit_mb", None) is not None:
        overrides["process_limit_mb"] = args.process_limit_mb
        overrides["max_resident_mb"] = None
    if getattr(args, "kv_dtype", None):
        overrides["kv_dtype"] = args.kv_dtype
    from .server.serve import speculation_overrides
    speculation_overrides(args, overrides)
    if args.model:
        base = EngineConfig()
        model_dir = require_model_dir(args.model)
    else:
        path = find_config(args.config or "builtin")
        if path.is_dir() and dir_kind(path) != "colibri":
            raise ColibriError(f"--config {args.config}: is a folder; expected a run config "
                               f"file (YAML/JSON with `model:` and `engine:`) or a shipped "
                               f"config's name")
        if path.is_dir() or path.name == "config.json" and dir_kind(path.parent) == "colibri":
            model = path if path.is_dir() else path.parent
            raise ColibriError(f"--config {args.config}: this is a model "
                               f"{'directory' if path.is_dir() else 'config.json'}, not a run "
                               f"config (YAML/JSON with `model:` and `engine:`); run it with "
                               f"--model {model}")
        cfg, model_dir = load_run_config(path)
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


def _prompt_from_args(args, eng):
    """-> (prompt for Engine.generate: text or token ids, the text to echo)."""
    if args.prompt_ids is not None:
        ids = args.prompt_ids
        shown = eng.tokenizer.decode(ids) if eng.tokenizer is not None else " ".join(map(str, ids))
        return ids, shown
    if args.prompt_file is not None:
        src = args.prompt_file
        try:
            text = sys.stdin.read() if src == "-" else Path(src).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ColibriError(f"--prompt-file {src}: file not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ColibriError(f"--prompt-file {src}: cannot read it as UTF-8 text: "
                               f"{str(e).splitlines()[0]}") from None
        if not text.strip():
            raise ColibriError(f"--prompt-file {src}: empty; expected the prompt's text")
        prompt = text
    else:
        prompt = "The " if args.prompt is None else args.prompt
    if eng.tokenizer is None:
        raise ColibriError(f"{eng.model_dir}: the model has no tokenizer (no tokenizer.json), "
                           f"so text prompts cannot be encoded; give token ids with "
                           f"--prompt-ids 1,2,3")
    shown = prompt.split("|", 1)[1] if prompt.startswith("MODE:") and "|" in prompt else prompt
    return prompt, shown


def _budget_lines(eng) -> list[str]:
    """The budget's split and what the expert cache holds, from the plan."""
    plan = eng.model.residency.plan
    if plan is None:
        return []
    from .residency import MiB
    cap = eng.model.residency.capacity
    lines = []
    if plan.process_limit:
        lines.append(f"colibri: process limit {plan.process_limit / MiB:.0f} MB = fixed overhead "
                     f"{plan.overhead / MiB:.1f} (measured at start) + budget "
                     f"{plan.budget / MiB:.1f} MB")
    lines += [f"colibri: budget {plan.budget / MiB:.0f} MB = non-expert weights "
             f"{plan.dense / MiB:.1f} + KV cache {plan.kv / MiB:.1f} ({plan.kv_tokens} "
             f"positions, {eng.config.kv_dtype}) + activations "
             f"{plan.act / MiB:.1f} (prefill chunks of {plan.chunk_tokens} tokens) + expert "
             f"cache {cap / MiB:.1f} MB ({eng.config.load_mode})"]
    if plan.n_experts:
        each = plan.experts_total / plan.n_experts
        have = (f"colibri: experts: the model has {plan.n_experts} routed experts, "
                f"{plan.experts_total / MiB:.1f} MB ({each / MiB:.2f} MB each); ")
        if cap >= plan.experts_total:
            have += (f"the cache holds all of them, {(cap - plan.experts_total) / MiB:.1f} MB "
                     f"of the budget unused")
        else:
            fit = cap // max(plan.expert_bytes, 1)
            have += (f"the cache holds {fit} of them at a time "
                     f"({100 * fit / plan.n_experts:.0f}%)")
        lines.append(have)
    return lines


def cmd_run(args) -> int:
    eng = _engine_from_args(args)
    try:
        prompt, shown = _prompt_from_args(args, eng)
        gen = eng.generate(prompt, max_new_tokens=args.n, top_k=args.top_k,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           stop=args.stop)
        ctx = eng.model_cfg.max_position_embeddings
        room = ctx - len(gen.prompt_ids) + 1        # the last token needs no KV position
        if args.n > room:
            print(f"colibri: warning: -n {args.n} is capped at {room} new tokens by the "
                  f"model's context of {ctx} positions (prompt {len(gen.prompt_ids)} tokens)",
                  file=sys.stderr)
        out = sys.stdout
        if not args.quiet:
            print(f"colibri: model {eng.model_dir} | {eng.model_cfg.architecture}, "
                  f"{eng.model_cfg.num_layers} layers ({len(eng.model_cfg.moe_layers)} MoE), "
                  f"k={gen.k} ({gen.k_source}), threads={eng.config.threads}, "
                  f"prompt {len(gen.prompt_ids)} tokens", file=sys.stderr)
            for line in _budget_lines(eng):
                print(line, file=sys.stderr)
            # the prompt is echoed before the text it continues, its tail only when long
            if len(shown) > ECHO_MAX_CHARS:
                shown = "…" + shown[-ECHO_MAX_CHARS:]
            out.write(shown)
            out.flush()
        from .residency import proc_read_bytes
        read0 = proc_read_bytes()
        t0 = time.perf_counter()
        first = None
        sep = "" if args.quiet else " "
        for ev in gen:
            if first is None:
                first = time.perf_counter() - t0
            if eng.tokenizer is not None:
                out.write(ev.text)
            else:                       # a model without a tokenizer streams its token ids
                out.write(f"{sep}{ev.token_id}")
                sep = " "
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
    from . import mapguard  # noqa: F401 - every mapping under the SIGBUS guard (a file
    #                         truncated while --verify reads it is reported, not fatal)
    from .weights import load_model, verify_checksums
    path = require_model_dir(args.model_dir)
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


def tensor_bits_arg(text: str) -> dict:
    """--tensor-bits CLASS=BITS[,CLASS=BITS...] -> {class: bits} (the converter checks
    the classes and values)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        cls, eq, b = item.partition("=")
        if not eq or not b.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected CLASS=BITS, e.g. lm_head=6")
        out[cls.strip()] = int(b)
    return out


def cmd_convert(args) -> int:
    from .convert import TOKENIZER_FILES, convert
    t0 = time.perf_counter()
    kind = dir_kind(Path(args.hf_dir))
    if kind == "colibri":
        raise ColibriError(f"{args.hf_dir} is already a Colibri model directory; `colibri "
                           f"convert` reads a Hugging Face checkpoint (config.json with "
                           f"model_type, *.safetensors)")
    if kind in ("missing", "file", "other"):
        raise ColibriError(f"{args.hf_dir}: " + {"missing": "not found", "file": "is a file"}
                           .get(kind, "no config.json") + "; expected a Hugging Face "
                           "checkpoint folder (config.json, *.safetensors) as HF_DIR")
    cfg = convert(args.hf_dir, args.out_dir, bits=args.bits, group_size=args.group_size,
                  lm_head_bits=args.lm_head_bits, embed_bits=args.embed_bits,
                  kv_bits=args.kv_bits, tensor_bits=args.tensor_bits, q4_clip=args.q4_clip,
                  calibration=args.calibration, progress=args.progress or sys.stderr.isatty(),
                  overwrite=args.force)
    q = cfg.quantization
    print(f"colibri: converted {args.hf_dir} -> {args.out_dir} ({cfg.architecture}, "
          f"{q.get('method', '?')} {q.get('bits', '?')}-bit, {len(cfg.files)} files) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    from .convert import tensor_classes
    rows = tensor_classes(args.out_dir)
    print("colibri: tensor classes (stored bits per weight: data, scales, zero points)",
          file=sys.stderr)
    for r in rows:
        print(f"  {r['class']:<11} {r['count']:>5} x {r['formats']:<10} {r['bits']:6.2f} bits, "
              f"{r['bytes'] / 2**20:8.2f} MiB", file=sys.stderr)
    tot_b, tot_w = sum(r["bytes"] for r in rows), sum(r["weights"] for r in rows)
    print(f"  {'all':<11} {sum(r['count'] for r in rows):>5} matrices     "
          f"{8 * tot_b / max(tot_w, 1):6.2f} bits, {tot_b / 2**20:8.2f} MiB", file=sys.stderr)
    copied = [n for n in TOKENIZER_FILES if n in cfg.files]
    absent = [n for n in TOKENIZER_FILES if n not in cfg.files]
    if copied:
        print(f"colibri: copied {', '.join(copied)}", file=sys.stderr)
    if absent:
        print(f"colibri: not in {args.hf_dir}: {', '.join(absent)}"
              + ("; without tokenizer.json the model runs from token ids only "
                 "(colibri run --prompt-ids 1,2,3)" if "tokenizer.json" in absent else ""),
              file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from .convert.verify import verify
    hf, model = Path(args.hf_dir), Path(args.model_dir)
    kinds = dir_kind(hf), dir_kind(model)
    if kinds == ("colibri", "hf"):
        raise ColibriError(f"the two folders look swapped: {hf} is a Colibri model and {model} "
                           f"a Hugging Face checkpoint; expected `colibri verify HF_DIR "
                           f"MODEL_DIR`, i.e. `colibri verify {model} {hf}`")
    if kinds[0] == "colibri":
        raise ColibriError(f"{hf} is a Colibri model directory; expected the Hugging Face "
                           f"checkpoint it was converted from as the first argument "
                           f"(`colibri verify HF_DIR MODEL_DIR`)")
    if kinds[0] in ("missing", "file", "other"):
        raise ColibriError(f"{hf}: " + {"missing": "not found",
                                        "file": "is a file"}.get(kinds[0], "no config.json")
                           + "; expected a Hugging Face checkpoint folder as HF_DIR")
    require_model_dir(model, "MODEL_DIR (a converted Colibri model)")
    res = verify(args.hf_dir, args.model_dir, args.prompts, n_new=args.n,
                 routing=args.routing, activations=args.activations)
    if args.max_error is not None and any(r.max_rel_err is not None and r.max_rel_err > args.max_error
                                          for r in res):
        raise ColibriError(f"max relative logit error above --max-error {args.max_error}")
    return 0


def cmd_expert_build(args) -> int:
    from .hotplug.builder import main as build_main
    return build_main(args.rest, parser_class=CliParser)


def cmd_experts_list(args) -> int:
    held = _held_state_dir(args)
    if held is not None:              # a running engine (a server) holds the folder
        return _experts_list_read_only(args, *held)
    eng = _engine_from_args(args)
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
        from .hotplug.listing import format_rows
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
    from .config import find_config, load_run_config
    from .hotplug.state import state_dir_in_use
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
    from .hotplug.listing import folder_view, format_view
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
    from .fingerprint import fingerprint_for
    model = require_model_dir(args.model) if args.model else None
    print(fingerprint_for(args.config, model))
    return 0


def _defaults_help() -> tuple[str, str, str]:
    """What applies without --config / with --model: the engine defaults, the built-in
    config's sampling settings and the shipped configs' names (read from EngineConfig and
    configs/, not repeated here)."""
    from .config import EngineConfig, configs_dir, find_config, read_mapping
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


def _model_options(ap, what: str, engine_defaults: str, shipped: str) -> None:
    """--config / --model, shared by `run` and `experts list`."""
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE|NAME",
                     help=f"run config (YAML/JSON: `model:` and `engine:` settings) or the name "
                          f"of a shipped one: {shipped} (default: builtin); {what}")
    src.add_argument("--model", metavar="DIR",
                     help=f"a converted model directory, run with the engine defaults "
                          f"({engine_defaults}), not a config's settings; to give it "
                          f"settings, write a config with `model: DIR` and use --config")


def cmd_serve(args) -> int:
    """`colibri serve`: one engine here (server/), or with --ray a fleet (fleet/)."""
    if args.ray:
        from .fleet import main as fleet_main
        return fleet_main(args)
    from .server import main as serve_main
    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    engine_defaults, builtin, shipped = _defaults_help()
    p = CliParser(prog="colibri", description="CPU-first MoE inference engine")
    from .server.surface import VersionAction
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="generate text, streaming tokens to the terminal",
                       description="Generate text from a prompt and stream it to stdout; "
                                   "progress and figures go to stderr.")
    _model_options(r, "its engine settings apply", engine_defaults, shipped)
    pr = r.add_mutually_exclusive_group()
    pr.add_argument("--prompt", "-p", metavar="TEXT",
                    help='prompt text, may start with MODE:kN| (default: "The ")')
    pr.add_argument("--prompt-ids", type=token_ids, dest="prompt_ids", metavar="IDS",
                    help="the prompt as token ids, e.g. 1,2,3 (for models without a "
                         "tokenizer; output is then token ids too)")
    pr.add_argument("--prompt-file", dest="prompt_file", metavar="PATH",
                    help="read the prompt text from a UTF-8 file (- for standard input)")
    r.add_argument("-n", type=int_at_least(0), default=64,
                   help="max new tokens (default 64; capped by the model's context, with a "
                        "warning)")
    r.add_argument("--top-k", type=int_at_least(1), dest="top_k", metavar="K",
                   help="experts per token for this request (default: MODE: prefix, plugin, "
                        "length policy, then the model's top_k)")
    r.add_argument("--threads", type=int_at_least(1, 512), metavar="N",
                   help="compute threads (default: the config's; engine default 2)")
    samp = (f"; default: the config's sampling settings (builtin: {builtin}; with --model: "
            f"{engine_defaults.rsplit(', threads', 1)[0]})")
    r.add_argument("--seed", type=int_at_least(0), metavar="S",
                   help="sampling seed, for repeatable output" + samp)
    r.add_argument("--temperature", type=number_in(0.0), metavar="T",
                   help="sampling temperature, 0 for greedy" + samp)
    r.add_argument("--top-p", type=number_in(0.0, 1.0, lo_open=True), dest="top_p", metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this total "
                        "probability, in (0, 1]" + samp)
    r.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when the output contains this text (repeatable)")
    r.add_argument("--load-mode", choices=["mmap", "copy"],
                   help="mmap the model files (default) or copy them into memory at load")
    r.add_argument("--routing", choices=["fixed", "float"],
                   help="expert weights by fixed-point softmax (default) or float softmax")
    r.add_argument("--activations", choices=["int8", "float"],
                   help="activations quantized to int8 per group (default) or kept float")
    r.add_argument("--experts-dir", dest="experts_dir", metavar="DIR",
                   help="watch this folder for hot-plugged expert .so files (docs/HOTPLUG.md)")
    r.add_argument("--debug", metavar="KINDS", type=debug_kinds,
                   help="trace lines to stderr: routing,memory,timing (or all)")
    r.add_argument("--plugins-dir", dest="plugins_dir", metavar="DIR",
                   help="load every plugin module of this folder (docs/PLUGINS.md)")
    r.add_argument("--max-resident-mb", type=number_in(0.0, lo_open=True),
                   dest="max_resident_mb", metavar="MB",
                   help="cap (MiB) on the memory the model occupies: weights in RSS and page "
                        "cache, KV cache and activations, the rest caching experts; the "
                        "split is printed at start")
    r.add_argument("--process-limit-mb", type=int, dest="process_limit_mb", metavar="MB",
                   help="cap (MiB) on the whole process (RSS + the model's page cache): "
                        "--max-resident-mb becomes this minus the overhead measured at start "
                        "(configs/small-256mb.yaml sets 256)")
    r.add_argument("--kv-dtype", choices=["f32", "f16", "q8"], dest="kv_dtype",
                   help="KV cache rows as float32 (default), IEEE half, or int8 with a scale "
                        "per row (docs/BENCHMARKS.md, \"KV cache storage types\")")
    r.add_argument("--expert-cache", choices=["lru", "lfu"], dest="expert_cache",
                   help="expert cache policy under --max-resident-mb (default lfu)")
    r.add_argument("--speculative", action="store_true",
                   help="under --max-resident-mb: guess the next layer's experts and load "
                        "them early")
    from .server.serve import add_speculation_arguments
    add_speculation_arguments(r)
    r.add_argument("--quiet", "-q", action="store_true",
                   help="print only the generated text (no prompt echo, no figures)")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="describe (and optionally verify) a model directory")
    i.add_argument("model_dir", metavar="MODEL_DIR", help="a converted Colibri model directory")
    i.add_argument("--verify", action="store_true",
                   help="check every file's sha256 and every section for NaN/Inf")
    i.set_defaults(func=cmd_inspect)

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
    _model_options(ls, "its model's experts are listed", engine_defaults, shipped)
    ls.add_argument("--experts-dir", dest="experts_dir", metavar="DIR",
                    help="the watched folder whose experts are checked and listed")
    ls.add_argument("--threads", type=int_at_least(1, 512), metavar="N",
                    help="compute threads (default: the config's)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_experts_list)
    fp = el_sub.add_parser("fingerprint", help="the model fingerprint an expert built for "
                                               "this model records (its base_model)")
    _model_options(fp, "its model's fingerprint is printed", engine_defaults, shipped)
    fp.set_defaults(func=cmd_experts_fingerprint)

    from .fleet import add_arguments as fleet_arguments
    from .server import add_arguments as serve_arguments
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with live experts "
                                      "(docs/SERVE.md; --ray: a fleet, docs/SCALE.md)")
    serve_arguments(sv)
    fleet_arguments(sv)
    sv.set_defaults(func=cmd_serve)
    from . import replay
    rp = sub.add_parser("replay", help="re-score an audit log's items under the expert set "
                                       "each names; report outputs that differ (docs/SERVE.md)")
    replay.add_arguments(rp)
    rp.set_defaults(func=replay.main)

    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    c.add_argument("hf_dir", metavar="HF_DIR",
                   help="Hugging Face checkpoint folder (config.json, *.safetensors)")
    c.add_argument("out_dir", metavar="OUT_DIR",
                   help="the Colibri model directory to write (with its tokenizer files)")
    c.add_argument("--bits", type=int, default=4, choices=[4, 8, 16, 32],
                   help="4: q4 (lm_head q6, embedding and K/V q8), 8: q8, 16: the checkpoint's "
                        "own bf16/f16, 32: f32")
    c.add_argument("--group-size", type=int, default=128, dest="group_size",
                   help="quantization group size, a multiple of 64 (default 128)")
    c.add_argument("--kv-bits", type=int, choices=[4, 6, 8, 16, 32], dest="kv_bits",
                   help="attention K/V projections (default 8 under --bits 4; 6: q6)")
    c.add_argument("--lm-head-bits", type=int, choices=[4, 6, 8, 16, 32], dest="lm_head_bits",
                   help="override the lm_head's precision (default: 6, i.e. q6, under --bits 4)")
    c.add_argument("--embed-bits", type=int, choices=[4, 6, 8, 16, 32], dest="embed_bits",
                   help="override the embedding's precision (default: 8 under --bits 4; "
                        "the lm_head's when tied; 6: q6)")
    c.add_argument("--tensor-bits", type=tensor_bits_arg, dest="tensor_bits",
                   metavar="CLASS=BITS[,...]",
                   help="per tensor class: embed, lm_head, attn_qo, attn_kv (4, 6, 8, 16, 32), "
                        "dense_ffn, shared_ffn, experts (4, 8, 16, 32); e.g. "
                        "attn_qo=6,lm_head=6 (docs/CONVERT.md, Precision)")
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
    v.add_argument("hf_dir", metavar="HF_DIR", help="the Hugging Face checkpoint converted from")
    v.add_argument("model_dir", metavar="MODEL_DIR", help="the converted Colibri model directory")
    v.add_argument("--prompts", metavar="FILE", help="one prompt per line (text, or token ids)")
    v.add_argument("-n", type=int_at_least(0), default=16,
                   help="greedy tokens compared per prompt (default 16)")
    v.add_argument("--routing", choices=["fixed", "float"], default="fixed",
                   help="Colibri's expert weights: fixed-point (default) or float softmax")
    v.add_argument("--activations", choices=["int8", "float"], default="int8",
                   help="Colibri's activations: int8 per group (default) or float")
    v.add_argument("--max-error", type=number_in(0.0), dest="max_error", metavar="X",
                   help="exit non-zero when a prompt's max relative logit error exceeds this")
    v.set_defaults(func=cmd_verify)
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
        args = argparse.Namespace(func=cmd_expert_build, rest=argv[2:])
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


if __name__ == "__main__":
    sys.exit(main())
