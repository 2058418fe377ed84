"""Larger than memory (issue 31): a real-size MoE shape in a memory cgroup smaller than the
model, Colibri with its budget beside llama.cpp with its mmap, same limit, same threads.

    python -m benchmarks.speed.bench_outofmem --shape qwen3-30b-a3b --limit-gb 8
    python -m benchmarks.speed.bench_outofmem --shape mixtral-8x7b --limit-gb 12
    python -m benchmarks.speed.bench_outofmem ... --routing skewed --colibri copy-spec,copy

Models: _realscale_models.py writes both files of the shape (random weights; the routers
of both engines are the same arrays, written into both files by `set_routing`: "uniform"
the random routers, near-uniform routing; "skewed" each layer's rows scaled by popularity
rank, see _realscale_routing.SKEW_A).

Each run is a fresh process in a fresh child memory cgroup (benchmarks/robustness/cgroups.py;
v1 or v2; memory limit --limit-gb, swap limit 0) started with the engine's own model files
dropped from the page cache (posix_fadvise DONTNEED, never drop_caches): one sequence, a
greedy first token then --warmup tokens, then --tokens timed tokens (EOS ignored); --runs
runs per engine and setting, the engines alternating. The token fed at each step is drawn
at random (one stream, the same for both engines and every run): greedy argmax fed back
collapses to one repeated token in a random-weight model, and one token's routing is the
same at every step (a 100 % hit rate that says nothing). Per run: tok/s of the timed tokens,
the bytes the process read from storage over them (/proc/self/io read_bytes: page-cache
misses, readahead, O_DIRECT reads) per token, the hit rate (Colibri: its expert cache's;
llama.cpp: implied, 1 - bytes read / routed expert bytes, both per token), memory.peak
(v1 memory.max_usage_in_bytes), OOM kills (memory.events / memory.oom_control), the swap
the cgroup used (v1 memsw peak - memory peak), and each MoE layer's share of its 8 most
routed experts (Colibri: Engine.routed_tokens; llama.cpp: its graph's ffn_moe_topk
tensors through the eval callback of _llama_decode.c, over warm-up and timed tokens).

Colibri: `process_limit_mb` = the cgroup's limit less --margin-mb (the engine measures its
own overhead and budgets the rest), `kv_pool_tokens` 128; settings by name (SETTINGS).
llama.cpp: _llama_decode.c (built and run by _llama_driver.py), mmap, no repack (its
repacked copy is anonymous memory the size of the experts: the default load is run once
with --llama-default to show what it does under the limit).

The disk: cold reads of expert files not read before in this run, one file at a time
(sequential) and four files at once (4 threads, 4-way parallel), each file in one
os.preadv into a private buffer then dropped; MB/s, measured before each routing variant.

The I/O model per run: compute seconds per token (the same decode with the model's files
in the page cache, no cgroup, no budget; --compute-runs runs, the fastest) + bytes read
per token / the 4-way parallel read rate. ratio = measured seconds per token / the model's
(the issue's gate: <= 1.3).

Writes benchmarks/out/outofmem_runs.json (every run) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, git_commit, machine
from benchmarks.robustness.cgroups import Cgroup
from benchmarks.speed import _realscale_models as RM
from benchmarks.speed import _realscale_routing as RR
from benchmarks.speed._llama_driver import IDS, build_driver, llama_cmd, llama_row, write_ids

MiB = 1 << 20
PROMPT = 1
SETTINGS = {
    "mmap": {},
    "mmap-spec": {"residency": {"speculative": True}},
    "copy": {"load_mode": "copy"},
    "copy-spec": {"load_mode": "copy", "residency": {"speculative": True}},
    "copy-spec3": {"load_mode": "copy", "residency": {"speculative": True, "speculative_layers": 3}},
    # far guesses evicting any expert (the cost rule off: far_guess_margin 0), for its A/B
    "copy-spec3-any": {"load_mode": "copy", "residency": {"speculative": True, "speculative_layers": 3,
                                                          "far_guess_margin": 0}},
}



def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- children

def child(job: dict) -> None:
    from colibri_core.engine import Engine
    from colibri_core.memstat import proc_read_bytes
    from benchmarks.speed.bench_pipeline import batch_step
    t0 = time.perf_counter()
    settings = {"threads": job["threads"], **job.get("settings", {})}
    if job.get("limit_mb"):
        settings.update(process_limit_mb=job["limit_mb"], kv_pool_tokens=128)
    eng = Engine.from_model_dir(job["model"], **settings)
    load_s = time.perf_counter() - t0
    res = eng.model.residency
    eng.count_routed_tokens()
    V = eng.model_cfg.vocab_size
    cache = eng.model.new_cache(PROMPT + job["warmup"] + job["tokens"] + 4)
    ids = [int(x) % V for x in Path(job["ids"]).read_text().split()]

    def counters():
        return {"read": proc_read_bytes() or 0, "hits": getattr(res, "hits", 0),
                "misses": getattr(res, "misses", 0), "stall_s": getattr(res, "stall_s", 0.0),
                "loaded": getattr(res, "loaded_bytes", 0), "t": time.perf_counter()}
    pos = 0
    lg = batch_step(eng, [[ids[0]]], [cache])
    for _ in range(job["warmup"]):
        pos += 1
        lg = batch_step(eng, [[ids[pos]]], [cache])
    c1 = counters()
    for _ in range(job["tokens"]):
        assert np.isfinite(lg[0]).all(), "non-finite logits"
        pos += 1
        lg = batch_step(eng, [[ids[pos]]], [cache])
    c2 = counters()
    d = {k: c2[k] - c1[k] for k in c1}
    n = job["tokens"]
    hm = d["hits"] + d["misses"]
    out = {"load_s": load_s, "s_per_token": d["t"] / n, "tok_s": n / d["t"],
           "read_per_token": d["read"] / n, "loaded_per_token": d["loaded"] / n,
           "hit_rate": d["hits"] / hm if hm else None, "stall_per_token": d["stall_s"] / n,
           "routed": {str(L): c.tolist() for L, c in eng.routed_tokens().items()}}
    plan = getattr(res, "plan", None)
    if plan is not None:
        out["plan"] = {k: v for k, v in plan.as_dict().items() if isinstance(v, (int, float, str))}
        out["capacity"] = res.capacity
        rep = res.report(page_cache=False)
        out["speculation"] = rep.get("speculation")
        out["o_direct"] = rep.get("o_direct")
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def child_read(job: dict) -> None:
    """Cold read rate of `files` (dropped before by the parent): one at a time, or
    `ways` threads each taking the next file."""
    from colibri_core.memstat import proc_read_bytes
    files = [Path(f) for f in job["files"]]
    ways = job["ways"]
    size = max(f.stat().st_size for f in files)
    bufs = [np.empty(size, np.uint8) for _ in range(ways)]
    it = iter(files)
    lock = threading.Lock()
    total = [0]

    def work(i):
        while True:
            with lock:
                f = next(it, None)
            if f is None:
                return
            fd = os.open(f, os.O_RDONLY)
            try:
                n = os.fstat(fd).st_size
                got = 0
                while got < n:
                    got += os.preadv(fd, [memoryview(bufs[i])[got:n]], got)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            with lock:
                total[0] += n
    r0, t0 = proc_read_bytes() or 0, time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(ways)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    print("RESULT " + json.dumps({"bytes": total[0], "s": dt, "MBps": total[0] / dt / 1e6,
                                  "read_bytes": (proc_read_bytes() or 0) - r0, "ways": ways,
                                  "files": len(files)}), flush=True)


# ----------------------------------------------------------------------------- parent

def drop(files) -> int:
    from colibri_core.memstat import drop_file_cache, file_cache_bytes
    for f in files:
        drop_file_cache(f, sync=True)
    return sum(file_cache_bytes(f) for f in files)


def warm(files) -> None:
    buf = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def spawn(cmd: list, cg: Cgroup | None, timeout: int) -> dict:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                           preexec_fn=cg.enter if cg is not None else None)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    row = {"rc": rc, "wall_s": time.time() - t0}
    got = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if got and rc == 0:
        row.update(json.loads(got[-1][7:]))
    else:
        row["error"] = (err.strip().splitlines() or [f"(no output, rc {rc})"])[-1][-300:]
    return row


def in_cgroup(cmd: list, limit: int, timeout: int) -> dict:
    cg = Cgroup.create(f"outofmem-{os.getpid()}-{time.time_ns() % 10**9}", limit)
    try:
        row = spawn(cmd, cg, timeout)
        r = cg.result()
        row.update(memory_peak=r.get("memory_peak"), oom_kills=r.get("oom_kill") or 0,
                   limit_hits=r.get("limit_hits"), cgroup=r.get("cgroup"),
                   cgroup_why=r.get("cgroup_why"))
        if r.get("memsw_peak") is not None and r.get("memory_peak") is not None:
            row["swap_peak"] = max(0, r["memsw_peak"] - r["memory_peak"])
        return row
    finally:
        cg.close()


def colibri_cmd(job: dict) -> list:
    return [sys.executable, "-m", "benchmarks.speed.bench_outofmem", "--child", json.dumps(job)]


def top8_share(routed: dict, k: int = 8) -> dict:
    """Per layer, the share of routed selections its k most routed experts took (k: the
    shape's top_k; 8 for Qwen3-30B-A3B, 2 for Mixtral-8x7B, whose 8 experts would all be
    its top 8)."""
    shares = []
    for L, c in routed.items():
        c = np.sort(np.asarray(c))[::-1]
        if c.sum():
            shares.append(float(c[:k].sum() / c.sum()))
    if not shares:
        return {}
    return {"median": float(np.median(shares)), "min": float(min(shares)), "max": float(max(shares)),
            "layers": len(shares)}


def read_rates(mdir: Path, a, used: set) -> dict:
    files = sorted(mdir.glob("expert_*.bin"))
    rng = np.random.default_rng(len(used))
    free = [f for f in files if f not in used]
    # --read-files, or ~245 MB and at least 8 files (96 of Qwen3's 2.55 MB, 8 of Mixtral's 95 MB)
    n = a.read_files or max(8, round(245e6 / files[0].stat().st_size))
    pick = [free[i] for i in rng.choice(len(free), 2 * n, replace=False)]
    used.update(pick)
    out = {}
    for ways, part in ((1, pick[:n]), (4, pick[n:])):
        drop(part)
        r = spawn([sys.executable, "-m", "benchmarks.speed.bench_outofmem", "--child-read",
                   json.dumps({"files": [str(f) for f in part], "ways": ways})], None, 600)
        out["sequential" if ways == 1 else "parallel4"] = r
        log(f"  cold read, {ways} way(s): {r.get('MBps', 0):.0f} MB/s ({r.get('bytes', 0) / 1e6:.0f} MB)")
    return out


def compute_refs(a, mdir: Path, gguf: Path, cfiles: list, cfg) -> dict:
    """Seconds per token with the model's files in the page cache, no cgroup, no budget."""
    out = {}
    if a.compute_runs == 0:
        return out
    job = {"model": str(mdir), "threads": a.threads, "warmup": a.warmup, "tokens": a.tokens,
           "ids": str(IDS)}
    if "colibri" in a.engines:
        warm(cfiles)
        rows = [spawn(colibri_cmd({**job, "seed": i}), None, 1800) for i in range(a.compute_runs)]
        ok = [r["s_per_token"] for r in rows if "s_per_token" in r]
        out["colibri"] = {"s_per_token": min(ok) if ok else None, "runs": rows}
        log(f"  compute, colibri: {out['colibri']['s_per_token']}")
        drop(cfiles)
    if "llama" in a.engines:
        warm([gguf])
        rows = [llama_row(spawn(llama_cmd(gguf, a), None, 1800), 1.0, a.tokens)
                for _ in range(a.compute_runs)]
        ok = [r["s_per_token"] for r in rows if "s_per_token" in r]
        out["llama"] = {"s_per_token": min(ok) if ok else None, "runs": rows}
        log(f"  compute, llama.cpp: {out['llama']['s_per_token']}")
        drop([gguf])
    return out


def summarize(rows: list, compute_s: float | None, rate_Bps: float | None, k: int = 8) -> dict:
    ok = [r for r in rows if "tok_s" in r]
    s = {"runs": len(rows), "ok": len(ok), "oom_kills": sum(r.get("oom_kills") or 0 for r in rows),
         "errors": [r["error"] for r in rows if "error" in r],
         "swap_peak": max((r.get("swap_peak") or 0 for r in rows), default=0),
         "memory_peak": max((r.get("memory_peak") or 0 for r in rows), default=None)}
    if not ok:
        return s
    med = lambda k: statistics.median(r[k] for r in ok if r.get(k) is not None)   # noqa: E731
    s.update(tok_s=med("tok_s"), tok_s_all=[round(r["tok_s"], 3) for r in ok],
             read_mb_token=med("read_per_token") / 1e6,
             hit_rate=med("hit_rate") if any(r.get("hit_rate") is not None for r in ok) else None,
             s_per_token=med("s_per_token"))
    shares = [top8_share(r.get("routed", {}), k).get("median") for r in ok]
    shares = [x for x in shares if x is not None]
    s["top8_share"] = statistics.median(shares) if shares else None
    if rate_Bps:        # the reads alone (no compute): a floor for either engine
        s["io_only_s"] = s["read_mb_token"] * 1e6 / rate_Bps
    if compute_s and rate_Bps:
        model = compute_s + s["read_mb_token"] * 1e6 / rate_Bps
        s.update(io_model_s=model, io_model_tok_s=1 / model, ratio_to_model=s["s_per_token"] / model)
    if rate_Bps and all(r.get("stall_per_token") is not None for r in ok):
        # the same run's compute: its seconds a token less the time it waited for loads
        # (on a shared machine the separate in-memory run may see another load)
        per = [r["s_per_token"] / (r["s_per_token"] - r["stall_per_token"]
                                   + r["read_per_token"] / rate_Bps) for r in ok]
        s.update(compute_same_run_s=med("s_per_token") - med("stall_per_token"),
                 stall_s=med("stall_per_token"), ratio_to_model_same_run=statistics.median(per))
    return s


def measure(a) -> dict:
    cfg = RM.model_config(a.shape)
    llama = "llama" in a.engines
    p = RM.paths(a.shape, a.dir)
    if not (p["colibri"] / "config.json").exists() or (llama and not p["gguf"].exists()):
        p = RM.ensure(a.shape, a.dir, gguf=llama)     # writes them (other shapes deleted)
    mdir, gguf = p["colibri"], p["gguf"]
    cfiles = sorted(x for x in mdir.iterdir() if x.suffix in (".bin", ".json"))
    if llama:
        build_driver()
    write_ids(cfg.vocab_size)
    limit = int(a.limit_gb * (1 << 30))
    expert_bytes = sorted(mdir.glob("expert_*.bin"))[0].stat().st_size
    routed_bytes = expert_bytes * cfg.top_k * len(cfg.moe_layers)
    res = {"shape": a.shape, "limit_bytes": limit, "threads": a.threads, "warmup": a.warmup,
           "tokens": a.tokens, "colibri_bytes": sum(x.stat().st_size for x in cfiles),
           "gguf_bytes": gguf.stat().st_size if gguf.exists() else None, "expert_file_bytes": expert_bytes,
           "routed_expert_bytes_per_token": routed_bytes, "loadavg_before": os.getloadavg(),
           "variants": {}}
    used: set = set()
    compute = None
    for variant in a.routing:
        log(f"{a.shape}: routing {variant}")
        RR.set_routing(a.shape, variant, a.dir)
        drop(cfiles + ([gguf] if gguf.exists() else []))
        v = {"read_rates": read_rates(mdir, a, used), "rows": {}}
        if compute is None or a.compute_each:
            compute = compute_refs(a, mdir, gguf, cfiles, cfg)
        v["compute"] = compute
        rate = v["read_rates"]["parallel4"].get("MBps")
        rate = rate * 1e6 if rate else None
        order = []
        for name in a.colibri:
            order.append(("colibri", name))
        if "llama" in a.engines:
            order.append(("llama", "mmap"))
        rows = {f"{e}:{n}": [] for e, n in order}
        if a.llama_default and variant == a.routing[0]:
            left = drop([gguf])
            r = in_cgroup(llama_cmd(gguf, a, repack=1), limit, a.timeout)
            r = llama_row(r, routed_bytes, a.tokens)
            r["cache_left_before"] = left
            v["llama_default"] = r
            log(f"  llama.cpp default (repack): rc {r['rc']}, OOM kills {r.get('oom_kills')}, "
                f"peak {(r.get('memory_peak') or 0) / MiB:.0f} MiB")
        for i in range(a.runs):
            for eng, name in (order if i % 2 == 0 else order[::-1]):
                if eng == "colibri":
                    left = drop(cfiles)
                    job = {"model": str(mdir), "threads": a.threads, "warmup": a.warmup,
                           "tokens": a.tokens, "ids": str(IDS), "settings": SETTINGS[name],
                           "limit_mb": int(limit / MiB) - a.margin_mb}
                    r = in_cgroup(colibri_cmd(job), limit, a.timeout)
                else:
                    left = drop([gguf])
                    r = llama_row(in_cgroup(llama_cmd(gguf, a), limit, a.timeout), routed_bytes, a.tokens)
                r["cache_left_before"] = left
                rows[f"{eng}:{name}"].append(r)
                log(f"  run {i + 1} {eng}:{name}: tok/s {r.get('tok_s', 0):.3f}, "
                    f"read {r.get('read_per_token', 0) / 1e6:.0f} MB/tok, hit "
                    f"{r.get('hit_rate')}, peak {(r.get('memory_peak') or 0) / MiB:.0f} MiB, "
                    f"OOM {r.get('oom_kills')}, top-k share "
                    f"{top8_share(r.get('routed', {}), cfg.top_k).get('median')}"
                    + (f", stall {r['stall_per_token']:.3f} s/tok" if "stall_per_token" in r else "")
                    + (f", error {r['error']}" if "error" in r else ""))
        v["rows"] = rows
        v["summary"] = {k: summarize(rs, compute.get(k.split(":")[0], {}).get("s_per_token"), rate,
                                     cfg.top_k) for k, rs in rows.items()}
        lsum = v["summary"].get("llama:mmap", {})
        for k, s in v["summary"].items():
            if k.startswith("colibri") and s.get("tok_s") and lsum.get("tok_s"):
                s["vs_llama"] = s["tok_s"] / lsum["tok_s"]
                # per run pair (the engines alternate: run i of each side by side)
                s["vs_llama_per_run"] = [c / l for c, l in zip(s["tok_s_all"], lsum["tok_s_all"])]
        res["variants"][variant] = v
        save(a, res)
    res["loadavg_after"] = os.getloadavg()
    return res


def save(a, res: dict) -> None:
    OUT.mkdir(exist_ok=True)
    pth = OUT / "outofmem_runs.json"
    allr = json.loads(pth.read_text()) if pth.exists() else {}
    allr[f"{a.shape}@{a.limit_gb:g}GiB{a.tag}"] = {**res, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                            "commit": git_commit(), "machine": machine()}
    pth.write_text(json.dumps(allr, indent=1, default=str) + "\n")


def table(res: dict) -> str:
    lines = ["| routing | engine | tok/s median (runs) | MB read / token | hit rate | memory.peak MiB "
             "| OOM kills | swap | top-8 share | I/O model tok/s | measured / model | vs llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=2: "–" if x is None else f"{x:.{d}f}"        # noqa: E731
    for variant, v in res["variants"].items():
        for k, s in v["summary"].items():
            lines.append(
                f"| {variant} | {k} | {f(s.get('tok_s'), 3)} ({', '.join(map(str, s.get('tok_s_all', [])))}) "
                f"| {f(s.get('read_mb_token'), 0)} | {f(s.get('hit_rate'), 3)} "
                f"| {f((s.get('memory_peak') or 0) / MiB, 0)} | {s['oom_kills']} | {s.get('swap_peak', 0)} "
                f"| {f(s.get('top8_share'), 3)} | {f(s.get('io_model_tok_s'), 3)} "
                f"| {f(s.get('ratio_to_model'))} | {f(s.get('vs_llama'))} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(RM.GGUF_ARCH), default="qwen3-30b-a3b")
    ap.add_argument("--limit-gb", type=float, default=8.0)
    ap.add_argument("--routing", type=lambda s: s.split(","), default=list(RR.ROUTING))
    ap.add_argument("--colibri", type=lambda s: s.split(","), default=["copy-spec"],
                    help=f"Colibri settings to run, of {', '.join(SETTINGS)}")
    ap.add_argument("--engines", type=lambda s: s.split(","), default=["colibri", "llama"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-files", type=int, default=None,
                    help="files per cold-read measurement (default: ~245 MB, at least 8)")
    ap.add_argument("--compute-runs", type=int, default=1, help="0: no compute reference")
    ap.add_argument("--compute-each", action="store_true", help="compute reference per routing")
    ap.add_argument("--margin-mb", type=int, default=384, help="cgroup limit - process_limit_mb")
    ap.add_argument("--llama-default", action="store_true", help="one run of llama.cpp's default load")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    ap.add_argument("--dir", type=Path, default=RM.DEFAULT_DIR)
    ap.add_argument("--tag", default="", help="appended to the run's key in outofmem_runs.json")
    ap.add_argument("--child")
    ap.add_argument("--child-read")
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    if a.child_read:
        return child_read(json.loads(a.child_read))
    t0 = time.time()
    res = measure(a)
    res["minutes"] = (time.time() - t0) / 60
    save(a, res)
    print(table(res))


if __name__ == "__main__":
    main()
