"""`colibri run`: generate text from a prompt, streamed to stdout; progress, the budget's
split and the figures (first token, decode rate, memory) to stderr."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import ColibriError
from .args import debug_kinds, int_at_least, model_options, number_in, renamed, token_ids
from .modeldir import engine_from_args


ECHO_MAX_CHARS = 200        # a longer prompt is echoed as "…" + its last this many characters


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
    from ..experts.residency import MiB
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
        if plan.holds_whole_model:
            have += (f"the budget holds the whole model ({(cap - plan.experts_total) / MiB:.1f} "
                     f"MB of it unused): run as without one, nothing to evict")
        elif cap >= plan.experts_total:
            have += (f"the cache holds all of them, {(cap - plan.experts_total) / MiB:.1f} MB "
                     f"of the budget unused")
        else:
            fit = cap // max(plan.expert_bytes, 1)
            have += (f"the cache holds {fit} of them at a time "
                     f"({100 * fit / plan.n_experts:.0f}%)")
        lines.append(have)
    return lines


def cmd_run(args) -> int:
    eng = engine_from_args(args)
    try:
        prompt, shown = _prompt_from_args(args, eng)
        gen = eng.generate(prompt, max_new_tokens=args.n, experts_per_token=args.experts_per_token,
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
                  f"experts_per_token={gen.k} ({gen.k_source}), threads={eng.config.threads}, "
                  f"prompt {len(gen.prompt_ids)} tokens", file=sys.stderr)
            for line in _budget_lines(eng):
                print(line, file=sys.stderr)
            # the prompt is echoed before the text it continues, its tail only when long
            if len(shown) > ECHO_MAX_CHARS:
                shown = "…" + shown[-ECHO_MAX_CHARS:]
            out.write(shown)
            out.flush()
        from ..experts.residency import proc_read_bytes
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
    from ..experts.residency import MiB, proc_read_bytes
    r = eng.memory_report()
    pc = r.get("page_cache", {})
    parts = []
    if r.get("budget"):
        parts.append(f"budget {r['budget'] / MiB:.0f} MB")
    parts.append(f"RSS {r.get('VmRSS', 0) / MiB:.0f} MB (peak {r.get('VmHWM', 0) / MiB:.0f})")
    parts.append(f"model page cache {sum(pc.values()) / MiB:.0f} MB "
                 f"(experts {pc.get('expert_files', 0) / MiB:.0f})")
    if r.get("budget"):
        parts.append(f"expert cache {r['expert_cache_bytes'] / MiB:.0f}/{r['capacity'] / MiB:.0f} MB"
                     + (" (the whole model)" if r.get("whole_model") else ""))
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


def add_parser(sub, engine_defaults: str, builtin: str, shipped: str) -> None:
    """`run`, its help naming the defaults (args.defaults_help)."""
    r = sub.add_parser("run", help="generate text, streaming tokens to the terminal",
                       description="Generate text from a prompt and stream it to stdout; "
                                   "progress and figures go to stderr.")
    model_options(r, "its engine settings apply", engine_defaults, shipped)
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
    r.add_argument("--experts-per-token", type=int_at_least(1), dest="experts_per_token",
                   metavar="K",
                   help="experts per token for this request (default: MODE: prefix, plugin, "
                        "length policy, then the model's top_k)")
    renamed(r, "--top-k", "--experts-per-token K (experts per token)")
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
    from ..server.serve import add_speculation_arguments
    add_speculation_arguments(r)
    r.add_argument("--quiet", "-q", action="store_true",
                   help="print only the generated text (no prompt echo, no figures)")
    r.set_defaults(func=cmd_run)
