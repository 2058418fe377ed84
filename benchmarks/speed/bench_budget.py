"""Memory budget benchmark: a model 4x larger than its budget, run under the budget.

    python -m benchmarks.speed.bench_budget [--prompt 32] [--tokens 32] [--threads 2]
                                      [--drop-caches] [--no-cgroup] [--write-md]

The model: Mixtral-shaped random INT4 (hidden 1024, 8 MoE layers x 32 experts, top-2,
moe_inter 2816, vocab 32000; ~1.26 GB on disk), built once with
colibri_core.model.testing.write_random_model under benchmarks/out/ (git-ignored).

Each row is a fresh child process, started with the model's pages dropped from the page
cache (fsync + posix_fadvise DONTNEED on every file, checked with mincore; with
--drop-caches also `echo 1 > /proc/sys/vm/drop_caches`, which touches the whole machine).
Where the machine allows, the child runs in a memory cgroup (v2 memory.max, else v1
memory.limit_in_bytes) limited to budget + fixed overhead; the cgroup's peak usage (RSS and
page cache charged to it) and its limit hits (failcnt, v1) are reported.

Per row: peak RSS (VmHWM) and the fixed overhead (RSS of the child after its imports,
before the engine), the peak over the run of the model footprint (page cache of every
model file, mincore, + anonymous memory gained), decode tokens/s, expert-cache hit rate and
bytes read from disk (/proc/self/io read_bytes) per decoded token. --write-md replaces the
"Memory budget" section of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, REPO, bench_model, git_commit, machine

SHAPE = dict(experts=32)                    # ~1.26 GB: >= 4x the 25% budget's expert cache
MiB = 1 << 20
ROWS = [   # (label, budget fraction or None, engine settings)
    ("no budget, mmap (cold start)", None, {}),
    ("no budget, copy-in (whole model read at load)", None, {"load_mode": "copy"}),
    ("100%, mmap, lfu", 1.00, {}),
    ("50%, mmap, lfu", 0.50, {}),
    ("25%, mmap, lfu", 0.25, {}),
    ("25%, mmap, lru", 0.25, {"residency": {"policy": "lru"}}),
    ("25%, mmap, lfu + speculative", 0.25, {"residency": {"speculative": True}}),
    ("25%, copy-in frames, lfu + speculative", 0.25,
     {"load_mode": "copy", "residency": {"speculative": True}}),
]


# ----------------------------------------------------------------------------- child

def child(a) -> None:
    import numpy as np
    from colibri_core.config import EngineConfig
    from colibri_core.engine import Engine
    from colibri_core.experts.residency import proc_memory, proc_read_bytes
    from colibri_core import kernels  # noqa: F401  (imported before the overhead is read)

    settings = json.loads(a.settings)
    overhead = proc_memory()
    t_load = time.perf_counter()
    eng = Engine(a.model, EngineConfig(threads=a.threads, **settings))
    t_load = time.perf_counter() - t_load
    res = eng.model.residency
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, eng.model_cfg.vocab_size, a.prompt).tolist()

    def footprint():
        pc = res.model_cache_bytes()
        m = proc_memory()
        return sum(pc.values()) + max(0, m.get("RssAnon", 0) - overhead.get("RssAnon", 0)), pc

    def stats():
        r = {"read": proc_read_bytes() or 0}
        for k in ("hits", "misses", "loaded_bytes", "stall_s"):
            r[k] = getattr(res, k, 0)
        for k in ("spec_guessed", "spec_correct"):
            r[k] = getattr(res, k, 0)
        return r

    peak_fp, peak_pc = 0, {}
    sampling = 0.0
    g = eng.generate(prompt, max_new_tokens=a.tokens, temperature=0.0)
    t0 = time.perf_counter()
    s0 = stats()
    prefill_s = None
    s1 = None
    for ev in g:
        now = time.perf_counter()
        if prefill_s is None:
            prefill_s = now - t0
            s1 = stats()
            t1 = now
        ts = time.perf_counter()
        fp, pc = footprint()
        if fp > peak_fp:
            peak_fp, peak_pc = fp, pc
        sampling += time.perf_counter() - ts
    t2 = time.perf_counter()
    s2 = stats()
    n = len(g.token_ids)
    decode_s = (t2 - t1) - sampling          # our mincore sampling is not the engine's time
    d = {k: s2[k] - s1[k] for k in s2}
    p = {k: s1[k] - s0[k] for k in s1}
    mem = proc_memory()
    rep = eng.memory_report()
    out = {
        "settings": settings, "load_s": t_load, "prefill_s": prefill_s,
        "prefill_tokens": len(prompt), "tokens": n,
        "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "overhead_rss": overhead.get("VmRSS"), "peak_rss": mem.get("VmHWM"),
        "end_rss": mem.get("VmRSS"), "peak_footprint": peak_fp, "peak_page_cache": peak_pc,
        "prefill_read": p["read"], "decode_read": d["read"],
        "decode_read_per_token": d["read"] / max(n - 1, 1),
        "decode_hit_rate": (d["hits"] / (d["hits"] + d["misses"])
                            if d["hits"] + d["misses"] else None),
        "decode_stall_s": d["stall_s"],
        "spec_hit_rate": (d["spec_correct"] / d["spec_guessed"] if d["spec_guessed"] else None),
        "report": {k: v for k, v in rep.items() if k != "page_cache"},
        "end_page_cache": rep.get("page_cache"),
    }
    eng.close()
    print("RESULT " + json.dumps(out))


# ----------------------------------------------------------------------------- parent

def model_files(model: Path) -> list[Path]:
    return sorted(p for p in model.iterdir() if p.suffix == ".bin")


def drop_model_cache(model: Path, drop_caches: bool) -> tuple[int, str]:
    from colibri_core.experts.residency import drop_file_cache, file_cache_bytes
    note = "posix_fadvise DONTNEED per file"
    for f in model_files(model):
        drop_file_cache(f, sync=True)
    if drop_caches:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("1\n")
            note += " + drop_caches"
        except OSError as e:
            note += f" (drop_caches refused: {e.strerror})"
    return sum(file_cache_bytes(f) for f in model_files(model)), note


class Cgroup:
    """A memory cgroup for one child: v2 (memory.max) where the memory controller is on
    the unified hierarchy, else v1 (memory.limit_in_bytes). `why` says why none."""

    def __init__(self, limit: int):
        self.path, self.kind, self.why = None, None, ""
        self.limit = limit
        name = f"colibri-bench-{os.getpid()}"
        try:
            own = {}
            for line in open("/proc/self/cgroup"):
                _, ctrl, p = line.strip().split(":", 2)
                own[ctrl] = p
        except OSError as e:
            self.why = f"cannot read /proc/self/cgroup ({e.strerror})"
            return
        cands = []
        v2root = Path("/sys/fs/cgroup")
        if (v2root / "cgroup.controllers").exists():
            cands.append(("v2", v2root / own.get("", "/").lstrip("/"), "memory.max"))
        uni = Path("/sys/fs/cgroup/unified")
        if (uni / "cgroup.controllers").exists():
            cands.append(("v2", uni / own.get("", "/").lstrip("/"), "memory.max"))
        if Path("/sys/fs/cgroup/memory").is_dir():
            cands.append(("v1", Path("/sys/fs/cgroup/memory") / own.get("memory", "/").lstrip("/"),
                          "memory.limit_in_bytes"))
        errs = []
        for kind, parent, knob in cands:
            if kind == "v2":
                try:
                    if "memory" not in (parent / "cgroup.controllers").read_text().split():
                        errs.append(f"{kind}: no memory controller at {parent}")
                        continue
                except OSError as e:
                    errs.append(f"{kind}: {e.strerror}")
                    continue
            path = parent / name
            try:
                path.mkdir()
            except OSError as e:
                errs.append(f"{kind}: mkdir {path}: {e.strerror}")
                continue
            try:
                (path / knob).write_text(str(limit))
                if kind == "v1":
                    try:
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                    except OSError:
                        pass
            except OSError as e:
                errs.append(f"{kind}: writing {knob}: {e.strerror}")
                path.rmdir()
                continue
            self.path, self.kind = path, kind
            return
        self.why = "; ".join(errs) or "no cgroup file system"

    def preexec(self):
        if self.path is None:
            return None
        procs = str(self.path / "cgroup.procs")
        return lambda: open(procs, "w").write(str(os.getpid()))

    def result(self) -> dict:
        if self.path is None:
            return {}
        r = {"cgroup": self.kind, "cgroup_limit": self.limit}
        for key, knob in (("cgroup_peak", "memory.max_usage_in_bytes"), ("cgroup_peak", "memory.peak"),
                          ("cgroup_failcnt", "memory.failcnt")):
            try:
                r[key] = int((self.path / knob).read_text().split()[0])
            except (OSError, ValueError):
                pass
        try:
            st = dict(l.split() for l in (self.path / "memory.stat").read_text().splitlines())
            r["cgroup_stat"] = {k: int(st[k]) for k in ("cache", "rss", "mapped_file", "file",
                                                         "anon", "kernel", "slab", "pgmajfault")
                                if k in st}
        except (OSError, ValueError):
            pass
        if self.kind == "v2":
            try:
                ev = dict(l.split() for l in (self.path / "memory.events").read_text().splitlines())
                r["cgroup_failcnt"] = int(ev.get("max", 0))
                r["cgroup_oom_kill"] = int(ev.get("oom_kill", 0))
            except (OSError, ValueError):
                pass
        return r

    def close(self) -> None:
        if self.path is not None:
            for _ in range(50):
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def probe_overhead(a) -> int:
    """RSS of a child after its imports (the fixed overhead a budget does not cover)."""
    code = ("import numpy, colibri_core.engine, colibri_core.kernels;"
            "from colibri_core.experts.residency import proc_memory; print(proc_memory()['VmRSS'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(r.stdout.split()[-1])


def run_row(a, model: Path, label: str, frac, settings: dict, size: int, overhead: int) -> dict:
    settings = dict(settings)
    if frac is not None:
        settings["max_resident_mb"] = round(frac * size / MiB, 1)
    left, note = drop_model_cache(model, a.drop_caches)
    cg = None
    if frac is not None and not a.no_cgroup:
        # budget + the fixed overhead + 48 MB for the interpreter's own heap growth
        cg = Cgroup(int(frac * size) + overhead + 48 * MiB)
    cmd = [sys.executable, "-m", "benchmarks.speed.bench_budget", "--child", "--model", str(model),
           "--settings", json.dumps(settings), "--prompt", str(a.prompt), "--tokens",
           str(a.tokens), "--threads", str(a.threads)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                       preexec_fn=cg.preexec() if cg is not None else None)
    row = {"label": label, "budget": settings.get("max_resident_mb"), "cache_left_before": left,
           "cache_drop": note, "wall_s": time.time() - t0, "returncode": p.returncode}
    if cg is not None:
        row.update(cg.result())
        row["cgroup_why"] = cg.why
        cg.close()
    got = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if got:
        row.update(json.loads(got[-1][len("RESULT "):]))
    else:
        row["error"] = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
    print(f"{label}: " + json.dumps({k: v for k, v in row.items() if k not in ("report",)}),
          file=sys.stderr)
    return row


def merge_runs(runs: list[dict]) -> dict:
    """The median run by decode tokens/s, with the worst (largest) memory figures of all."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r.get("decode_tok_s") or 0.0)
    row = dict(ok[len(ok) // 2])
    for k in ("peak_rss", "peak_footprint", "cgroup_peak", "cgroup_failcnt", "cache_left_before"):
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            row[k] = max(vals)
    row["runs"] = len(runs)
    row["decode_tok_s_all"] = [r.get("decode_tok_s") for r in ok]
    return row


def fmt(v, scale=1.0, nd=0):
    return "–" if v is None else f"{v / scale:.{nd}f}"


def table(rows: list[dict]) -> str:
    head = ("| run | budget MB | peak RSS MB | overhead MB | peak RSS − overhead | peak footprint MB "
            "| cgroup peak MB (limit) | expert cache MB | decode tok/s | prefill s | hit rate "
            "| spec. hit | read MB/token | stall s |")
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | {fmt(r['budget'])} | failed: {r['error']} |")
            continue
        rep = r.get("report", {})
        cg = (f"{fmt(r.get('cgroup_peak'), MiB)} ({fmt(r.get('cgroup_limit'), MiB)}"
              f"{', ' + str(r['cgroup_failcnt']) + ' limit hits' if r.get('cgroup_failcnt') else ''})"
              if r.get("cgroup") else "–")
        hr = r.get("decode_hit_rate")
        sh = r.get("spec_hit_rate")
        lines.append(
            f"| {r['label']} | {fmt(r['budget'])} | {fmt(r['peak_rss'], MiB)} | "
            f"{fmt(r['overhead_rss'], MiB)} | {fmt(r['peak_rss'] - r['overhead_rss'], MiB)} | "
            f"{fmt(r['peak_footprint'], MiB)} | {cg} | "
            f"{fmt(rep.get('capacity'), MiB) if rep.get('budget') else '–'} | "
            f"{fmt(r['decode_tok_s'], 1, 2)} | {fmt(r['prefill_s'], 1, 1)} | "
            f"{'–' if hr is None else f'{100 * hr:.1f}%'} | {'–' if sh is None else f'{100 * sh:.1f}%'} | "
            f"{fmt(r['decode_read_per_token'], MiB, 1)} | {fmt(r.get('decode_stall_s'), 1, 2)} |")
    return "\n".join(lines)


def checks(rows: list[dict]) -> str:
    """What the table shows about the budget, computed from it."""
    b = [r for r in rows if r.get("budget") and "error" not in r]
    if not b:
        return ""
    over_rss = [r["label"] for r in b if r["peak_rss"] - r["overhead_rss"] > r["budget"] * MiB]
    over_fp = [r["label"] for r in b if r["peak_footprint"] > r["budget"] * MiB]
    cgs = [r for r in b if r.get("cgroup") and r.get("cgroup_peak") is not None]
    under = sum(1 for r in cgs if r["cgroup_peak"] < r["cgroup_limit"] - MiB
                and not r.get("cgroup_failcnt"))
    worst = max((r["peak_rss"] - r["overhead_rss"]) / (r["budget"] * MiB) for r in b)
    lines = [f"Budget check over the {len(b)} budgeted runs: peak RSS − overhead within the "
             f"budget in {len(b) - len(over_rss)}/{len(b)} (largest: {100 * worst:.0f}% of it)"
             + (f", over in: {', '.join(over_rss)}" if over_rss else ""),
             f"peak footprint within the budget in {len(b) - len(over_fp)}/{len(b)}"
             + (f", over in: {', '.join(over_fp)}" if over_fp else "")]
    if cgs:
        lines.append(f"cgroup peak below its limit (no reclaim forced by the limit) in "
                     f"{under}/{len(cgs)}")
    return "; ".join(lines) + "."


def write_md(text: str) -> None:
    doc = REPO / "docs" / "BENCHMARKS.md"
    begin, end = "<!-- bench_budget:begin -->", "<!-- bench_budget:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):].lstrip("\n")
    else:
        new = old.rstrip() + "\n\n" + block
    doc.write_text(new)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drop-caches", action="store_true",
                    help="also echo 1 > /proc/sys/vm/drop_caches before each run (whole machine)")
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--only", help="comma-separated row numbers (0-based)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per row: tokens/s is the median run's, memory the maximum")
    ap.add_argument("--write-md", action="store_true")
    ap.add_argument("--from-json", action="store_true",
                    help="re-render the last run (benchmarks/out/bench_budget.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    if a.from_json:
        data = json.loads((OUT / "bench_budget.json").read_text())
        text = render(data["meta"], data["rows"])
        print(text)
        if a.write_md:
            write_md(text)
        return
    model = bench_model(**SHAPE)
    size = sum(f.stat().st_size for f in model_files(model))
    experts = sum(f.stat().st_size for f in model_files(model) if f.name.startswith("expert_"))
    n_experts = sum(1 for f in model_files(model) if f.name.startswith("expert_"))
    overhead = probe_overhead(a)
    load0 = os.getloadavg()
    rows = []
    pick = [int(i) for i in a.only.split(",")] if a.only else range(len(ROWS))
    for i in pick:
        label, frac, settings = ROWS[i]
        runs = [run_row(a, model, label, frac, settings, size, overhead) for _ in range(a.repeat)]
        rows.append(merge_runs(runs))
    load1 = os.getloadavg()
    cmd = "python -m benchmarks.speed.bench_budget " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"cmd": cmd.strip(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "load": [load0[0], load1[0]], "size": size, "experts": experts,
            "n_experts": n_experts, "prompt": a.prompt, "tokens": a.tokens,
            "threads": a.threads, "repeat": a.repeat}
    (OUT / "bench_budget.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = render(meta, rows)
    print(text)
    if a.write_md:
        write_md(text)


def render(m: dict, rows: list[dict]) -> str:
    cg = next((r for r in rows if r.get("cgroup")), None)
    cg_note = (f"cgroup {cg['cgroup']} memory limit = budget + fixed overhead + 48 MB, per run"
               if cg else "no cgroup: " + next((r.get("cgroup_why", "") for r in rows
                                                 if r.get("cgroup_why")), "--no-cgroup"))
    plan = next((r["report"]["plan"] for r in rows if r.get("report", {}).get("plan")), {})
    reserved = (f"the non-expert weights ({plan['dense'] / MiB:.0f} MB), the KV cache of one "
                f"sequence at full context ({plan['kv'] / MiB:.0f} MB) and the activations of one "
                f"prefill chunk" if plan else "the non-expert weights, the KV cache and activations")
    return f"""## Memory budget (`bench_budget.py`)

Command: `{m['cmd']}` — commit {m.get('commit', '?')}, {m['date']}, {m['machine']};
load average {m['load'][0]:.2f} before, {m['load'][1]:.2f} after (other jobs were running on
this machine: the tokens/s figures are noisy, the memory and I/O figures are not).

Model: random Mixtral-shaped INT4 (hidden 1024, 8 MoE layers x 32 experts, top-2,
moe_inter 2816, vocab 32000, context 512): {m['size'] / MiB:.0f} MB on disk, of which
{m['experts'] / MiB:.0f} MB routed experts ({m['experts'] / m['n_experts'] / MiB:.2f} MB
each). Budgets are fractions of the whole model's size. Prompt {m['prompt']} tokens, then
{m['tokens']} greedy tokens, {m['threads']} threads, {m['repeat']} run(s) per row
(tokens/s: the median run; memory: the largest of the runs). Before each run the model's
pages were dropped from the page cache ({rows[0].get('cache_drop', '?')}; mincore found
{max(r.get('cache_left_before', 0) for r in rows) / MiB:.1f} MB left); {cg_note}.

- *peak RSS*: VmHWM of the run's process; *overhead*: its RSS after imports, before the
  engine (interpreter, numpy, kernels) — the fixed part the budget does not cover.
- *peak footprint*: the largest value seen after any token of (page cache of every model
  file, by mincore) + (anonymous memory gained since the imports): what the model really
  occupies, counted once whether a page is mapped or only cached.
- *cgroup peak*: the cgroup's max usage (RSS + page cache charged to it; it also holds
  the interpreter's own anonymous memory).
- *expert cache*: the budget left for experts once {reserved} are reserved.
- *hit rate*, *read MB/token*, *stall*: decode phase only (after the first token);
  read = /proc/self/io read_bytes; stall = time the forward loop waited for expert loads.
  With speculation the hit rate counts experts loaded on a guess as hits; *spec. hit* is
  the share of guesses that the next layer did route to.

{table(rows)}

{checks(rows)}

Mechanisms behind the rows: a copy-in load is one O_DIRECT `preadv` into a preallocated
frame; a mapped load goes through the page cache (allocate, read, map with
`MADV_POPULATE_READ`, later `MADV_DONTNEED` + `POSIX_FADV_DONTNEED` to free), and that
kernel time competes with the compute kernels on a 2-CPU machine. The unbudgeted copy-in
row reads the files through the page cache into private memory, so the model is held
twice until the kernel reclaims the cache (the budgeted copy-in mode drops it and reads
experts with O_DIRECT). The unbudgeted mmap row runs with `EngineConfig.preload`'s default,
`willneed`: every model file is advised once at load, so its reads happen during the
prompt and decode reads almost nothing (before that default, decode read ~6 MB per token
here as experts were first routed to).
"""


if __name__ == "__main__":
    main()
