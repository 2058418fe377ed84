"""Hot-plug while the engine decodes: rename -> routable, bursts, hanging probes, and what
an expert-set change costs the token that adopts it. Also the probe alone, and per-call
costs of in-process vs isolated experts.

    python -m benchmarks.speed.bench_hotplug [--drops 100] [--bursts 3] [--burst-size 20]
        [--hang-rounds 3] [--calls] [--json benchmarks/out/hotplug.json]
    python -m benchmarks.speed.bench_hotplug --code /path/to/other/checkout     # its colibri_core
    python -m benchmarks.speed.bench_hotplug --vs /path/to/other/checkout --md  # both, one table

The engine: the built-in model (Engine.from_config("builtin"), 2 threads, default hot-plug
settings: settle 0.2 s, probe timeout 5 s, 2 probe slots where the code has them),
generating 400-token requests back to back in a thread for the whole run. Experts are
built up front (builder.build_expert: random INT4 weights, hidden 128, MoE layers 1-3; cached
in benchmarks/out/hotplug_builds), each a distinct file (a distinct sha256: every drop is
checked, staged and probed; a hash already adopted would skip the probe). A drop is a
rename from a scratch folder on the same filesystem into the watched one; "routable" is
the moment the engine adopts the expert between two tokens: the manager's "loaded" event,
emitted on the engine's thread by the drain() whose changes are swapped in right after.

1. drops: `--drops` builds, one at a time (each waited for, then 30-80 ms of pause), over
   10 names (the first drop of a name adds it, the next ones replace it).
2. bursts: `--bursts` times `--burst-size` builds renamed in at once (new names the first
   time, replacements after); time from the first rename to the last adoption.
3. hanging probes: P-1 experts whose ffn_forward never returns, then a good one 5 ms
   later (`--hang-rounds` times); then P of them and a good one (once). P = 2, the default
   probe slots (code without slots probes one file at a time). The hanging ones are refused
   at the probe timeout.
4. tokens: for each expert-set change adopted mid-request (10 tokens of the same request
   before it), that token's latency divided by the median of the 10 before (TokenEvent
   latency: from the previous token to this one); plus token p50/p99 over the whole run
   and over a quiet stretch before any drop.
5. probe alone: a fresh interpreter per file (probe.run_probe) and, where the code has it,
   the warm helper's child (probepool.ProbePool); `--calls`: per-call cost of in-process
   vs isolated experts (y = tanh x).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, REPO, import_colibri_core, machine, read_bandwidth

P_SLOTS = 2
H, I = 128, 64                    # the built-in model's hidden size; the experts' intermediate


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))] if v else float("nan")


def summary(values, scale=1e3) -> dict:
    return {"p50": pct(values, 50) * scale, "p90": pct(values, 90) * scale,
            "p99": pct(values, 99) * scale, "min": min(values) * scale,
            "max": max(values) * scale, "n": len(values)} if values else {"n": 0}


# ----------------------------------------------------------------------------- experts

def build_pool(out: Path, specs: list[tuple[str, str, int, int]]) -> dict:
    """(name, version, layer, seed) -> .so path, built once (cached by those four)."""
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    out.mkdir(parents=True, exist_ok=True)
    got = {}
    for name, version, layer, seed in specs:
        so = out / f"{name}-{version}-L{layer}-s{seed}.so"
        if not so.exists():
            rng = np.random.default_rng(seed)
            npz = out / f".{so.stem}.npz"
            np.savez(npz, w1=rng.standard_normal((I, H)) / np.sqrt(H),
                     w3=rng.standard_normal((I, H)) / np.sqrt(H),
                     w2=rng.standard_normal((H, I)) / np.sqrt(I),
                     router_row=(rng.standard_normal(H) * 0.05).astype(np.float32),
                     router_bias=np.float32(0.0))
            build_expert(npz, so, layer=layer, name=name, version=version,
                         portable=True)       # random weights: no base model
            npz.unlink()
        got[(name, version)] = so
    return got


# ----------------------------------------------------------------------------- the run

class Decoder(threading.Thread):
    """The engine's token loop: 400-token requests back to back; logs every token."""

    def __init__(self, eng):
        super().__init__(daemon=True, name="bench-decoder")
        self.eng, self.stop = eng, threading.Event()
        self.log: list[tuple] = []          # (time, request, step, set version, latency)
        self.error = None

    def run(self):
        r = 0
        try:
            while not self.stop.is_set():
                g = self.eng.generate([1, 2, 3], max_new_tokens=400, temperature=0.7,
                                      seed=r)
                for ev in g:
                    self.log.append((time.perf_counter(), r, ev.step, ev.expert_set_generation,
                                     ev.latency_s))
                    if self.stop.is_set():
                        break
                r += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e


class Events:
    """The hot-plug manager's events, timed where they happen: "loaded" inside drain() on
    the engine's thread, between two tokens (a plain function wrapped around the engine's
    own listener: ~1 µs, no plugin whose hook dispatch would be counted in the token
    measured); "rejected" on the worker. Nothing wakes a thread (that would compete with
    the very token measured): the benchmark's thread polls every POLL_S."""

    POLL_S = 0.002

    def __init__(self):
        self.loaded: dict[tuple, float] = {}
        self.rejected: list[tuple] = []

    def attach(self, manager) -> None:
        inner, loaded, rejected = manager.on_event, self.loaded, self.rejected

        def on_event(kind, info):
            if kind == "loaded":
                loaded[(info["name"], info["version"])] = time.perf_counter()
            elif kind == "rejected":
                rejected.append((time.perf_counter(), info.get("path"), info.get("message")))
            inner(kind, info)
        manager.on_event = on_event

    def wait(self, keys, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not all(k in self.loaded for k in keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(self.POLL_S)
        return True

    def wait_rejected(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.rejected) < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(self.POLL_S)
        return True


def run(args) -> dict:
    from colibri_core import kernels
    from colibri_core.config import HotplugConfig
    from colibri_core.engine import Engine
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert

    names = [f"solo{i}" for i in range(10)]
    solo_specs = [(names[i % 10], f"v{i}", 1 + i % 3, 1000 + i) for i in range(args.drops)]
    burst_specs = [[(f"burst{i}", f"b{b}", 1 + i % 3, 5000 + 100 * b + i)
                    for i in range(args.burst_size)] for b in range(args.bursts)]
    good_specs = [(f"after{i}", "1", 1 + i % 3, 9000 + i) for i in range(args.hang_rounds + 1)]
    builds = build_pool(Path(args.builds), solo_specs + [s for b in burst_specs for s in b]
                        + good_specs)

    work = Path(tempfile.mkdtemp(prefix="colibri-bench-hotplug-"))
    folder, scratch = work / "experts", work / "scratch"
    folder.mkdir(mode=0o755)
    scratch.mkdir()
    hangs = [compile_test_expert(scratch / f"hang{i}.so", hidden=H, layer=1 + i % 3,
                                 name=f"hang{i}", fault="hang")
             for i in range((P_SLOTS - 1) * args.hang_rounds + P_SLOTS)]
    hp = {}
    slots = "probe_slots" in HotplugConfig.model_fields
    if slots:
        hp["probe_slots"] = P_SLOTS
    cfg = HotplugConfig(**hp)
    eng = Engine.from_config("builtin", experts_dir=str(folder), hotplug=cfg)
    events = Events()
    events.attach(eng.hotplug)
    dec = Decoder(eng)
    res: dict = {"settle_s": cfg.settle_s, "probe_timeout_s": cfg.probe_timeout_s,
                 "probe_slots": P_SLOTS if slots else None, "backend": kernels.backend(),
                 "threads": eng.config.threads}

    def drop(key, name: str | None = None) -> float:
        so = builds[key] if isinstance(key, tuple) else key
        tmp = scratch / f"{os.getpid()}-{time.monotonic_ns()}.so"
        with open(so, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.chmod(tmp, 0o644)
        t = time.perf_counter()
        os.rename(tmp, folder / f"{name or key[0]}.so")
        return t

    try:
        dec.start()
        time.sleep(1.5)                               # quiet stretch: no hot-plug yet
        t_quiet = time.perf_counter()
        rnd = random.Random(0)

        # 1. one drop at a time
        lat = []
        for name, version, _, _ in solo_specs:
            t0 = drop((name, version))
            if not events.wait([(name, version)], 30):
                raise RuntimeError(f"{name} {version} never became routable")
            lat.append(events.loaded[(name, version)] - t0)
            time.sleep(rnd.uniform(0.03, 0.08))
        res["drop"] = summary(lat)

        t_solo_end = time.perf_counter()
        # 2. bursts
        bursts = []
        for specs in burst_specs:
            time.sleep(1.0)
            t0 = None
            for name, version, _, _ in specs:
                t = drop((name, version))
                t0 = t0 if t0 is not None else t
            keys = [(n, v) for n, v, _, _ in specs]
            if not events.wait(keys, 60):
                raise RuntimeError("a burst never became routable")
            bursts.append(max(events.loaded[k] for k in keys) - t0)
        res["burst"] = {"size": args.burst_size, "s": bursts,
                        **summary(bursts)}

        # 3. hanging probes, then a good file
        hang_iter = iter(hangs)

        def hang_round(n_hang: int, good) -> dict:
            time.sleep(1.0)
            before = len(events.rejected)
            for _ in range(n_hang):
                h = next(hang_iter)
                drop(h, h.stem)
            time.sleep(0.005)
            t0 = drop(good)
            ok = events.wait([good], 60)
            got = events.loaded[good] - t0 if ok else float("nan")
            events.wait_rejected(before + n_hang, 60)        # the hanging ones, refused
            reasons = [r for _, _, r in events.rejected[before:]]
            return {"hanging": n_hang, "good_s": got, "refusals": reasons}
        rounds = [hang_round(P_SLOTS - 1, good_specs[i][:2]) for i in range(args.hang_rounds)]
        full = hang_round(P_SLOTS, good_specs[-1][:2])
        res["hang"] = {"p_minus_1": rounds, "p": full,
                       "good_s_median": statistics.median(r["good_s"] for r in rounds)}
        time.sleep(0.5)
        res["engine_expert_changes"] = dict(getattr(eng, "expert_change_stats", {}))
    finally:
        dec.stop.set()
        dec.join(30)
        eng.close()
    if dec.error is not None:
        raise dec.error

    # 4. tokens
    log = dec.log
    ratios, extra, solo = [], [], []
    for i in range(1, len(log)):
        t, r, step, ver, lat_s = log[i]
        if ver == log[i - 1][3] or step < 11 or log[i - 1][1] != r:
            continue
        prev = [x[4] for x in log[i - 10:i]]
        if any(x[1] != r or x[2] < 1 for x in log[i - 10:i]):
            continue
        m = statistics.median(prev)
        ratios.append(lat_s / m)
        extra.append(lat_s - m)
        if t_quiet < t < t_solo_end:
            solo.append(lat_s / m)
    decode = [x[4] for x in log if x[2] >= 1]
    quiet = [x[4] for x in log if x[2] >= 1 and x[0] < t_quiet]
    res["tokens"] = {"changes": len(ratios),
                     "first_after_change_ratio": {"median": pct(ratios, 50),
                                                  "p90": pct(ratios, 90),
                                                  "max": max(ratios) if ratios else None},
                     "first_after_change_extra_ms": {"median": pct(extra, 50) * 1e3,
                                                     "p90": pct(extra, 90) * 1e3},
                     "first_after_change_ratio_solo_drops": {"median": pct(solo, 50),
                                                             "p90": pct(solo, 90),
                                                             "n": len(solo)},
                     "all_ms": summary(decode), "quiet_ms": summary(quiet)}

    # 5. probe alone
    res["probe"] = bench_probe(scratch, builds[solo_specs[0][:2]])
    if args.calls:
        res["calls"] = bench_calls(work)
    return res


def bench_probe(work: Path, so: Path, n: int = 15) -> dict:
    from colibri_core.experts.hotplug.probe import run_probe
    out = {}
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run_probe(str(so), H, 10.0)
        times.append(time.perf_counter() - t)
    out["fresh_interpreter_ms"] = summary(times)
    try:
        from colibri_core.experts.hotplug.probepool import ProbePool
        from colibri_core.experts.hotplug.probe import interpret
    except ImportError:
        return out
    pool = ProbePool(P_SLOTS, cwd=str(work))
    pool.start()
    try:
        times = []
        for _ in range(n):
            done = threading.Event()
            got = {}

            def cb(raw, err, got=got, done=done):
                got["raw"], got["err"] = raw, err
                done.set()
            t = time.perf_counter()
            pool.submit(str(so), H, 10.0, cb, cwd=str(work))
            done.wait(30)
            times.append(time.perf_counter() - t)
            interpret(str(so), got["raw"], 10.0)
        out["warm_helper_ms"] = summary(times)
    finally:
        pool.close()
    return out


def bench_calls(work: Path) -> list[dict]:
    from colibri_core.experts.hotplug import HotplugManager
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    rows = []
    for hidden in (64, 2048):
        folder, state = work / f"calls{hidden}", work / f"calls{hidden}-state"
        folder.mkdir()
        os.chmod(folder, 0o755)
        compile_test_expert(folder / "inproc.so", hidden=hidden, name="inproc")
        compile_test_expert(folder / "iso.isolated.so", hidden=hidden, name="iso")
        mgr = HotplugManager(folder, hidden, {1}, 64, state, settle_s=0.01, watch=False)
        mgr.start()
        mgr.wait_idle(30)
        experts = {c.expert.name: c.expert for c in mgr.drain()}
        for n_tokens in (1, 16):
            x = np.random.default_rng(0).standard_normal((n_tokens, hidden)).astype(np.float32)
            y = np.empty_like(x)
            row = {"hidden": hidden, "n_tokens": n_tokens}
            for label, e in (("inprocess", experts["inproc"]), ("isolated", experts["iso"])):
                for _ in range(200):
                    e.forward(x, y)
                reps = 2000 if hidden == 64 else 500
                samples = []
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(reps):
                        e.forward(x, y)
                    samples.append((time.perf_counter() - t) / reps)
                row[f"{label}_us"] = statistics.median(samples) * 1e6
            row["overhead_us"] = row["isolated_us"] - row["inprocess_us"]
            rows.append(row)
        mgr.close()
    return rows


# ----------------------------------------------------------------------------- report

def commit_of(code: Path) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, text=True,
                             capture_output=True, check=True).stdout.strip()
        branch = subprocess.run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=code,
                                text=True, capture_output=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                "colibri_core"], cwd=code, text=True,
                               capture_output=True).stdout.strip()
        return f"{branch} {rev}" + (" +dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def table(results: list[tuple[str, dict]]) -> str:
    def ms(v):
        return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"
    head = "| measured (built-in model, generating, 2 cores) | " + \
        " | ".join(label for label, _ in results) + " | target |"
    rows = [head, "|---|" + "---|" * len(results) + "---|"]

    def row(what, fn, target):
        rows.append(f"| {what} | " + " | ".join(fn(r) for _, r in results) + f" | {target} |")
    row("rename() into the folder → routable, p50 / p99 (n)",
        lambda r: f"{r['drop']['p50']:.0f} ms / {r['drop']['p99']:.0f} ms ({r['drop']['n']})",
        "≤ 50 ms / ≤ 200 ms")
    row(f"burst of {results[0][1]['burst']['size']} drops → all routable, median (min–max)",
        lambda r: f"{ms(r['burst']['p50'] / 1e3)} ({ms(r['burst']['min'] / 1e3)}–"
                  f"{ms(r['burst']['max'] / 1e3)})", "≤ 500 ms")
    row(f"a good file dropped 5 ms after {P_SLOTS - 1} whose ffn_forward hangs (P = {P_SLOTS}),"
        " live after, median; its delay over the drop p50",
        lambda r: f"{ms(r['hang']['good_s_median'])}; "
                  f"+{max(0.0, r['hang']['good_s_median'] * 1e3 - r['drop']['p50']):.0f} ms",
        "delayed ≤ 100 ms")
    row(f"the same after {P_SLOTS} hanging (as many as probe slots)",
        lambda r: ms(r["hang"]["p"]["good_s"]), "(reported)")
    row("first token after an expert-set change ÷ median of the 10 tokens before,"
        " median (p90) over the changes; extra ms",
        lambda r: f"{r['tokens']['first_after_change_ratio']['median']:.2f}× "
                  f"({r['tokens']['first_after_change_ratio']['p90']:.2f}×, "
                  f"n={r['tokens']['changes']}); "
                  f"+{r['tokens']['first_after_change_extra_ms']['median']:.2f} ms",
        "≤ 1.5×")
    row("decode token p50 / p99: quiet, before any drop | whole run",
        lambda r: f"{r['tokens']['quiet_ms']['p50']:.2f} / {r['tokens']['quiet_ms']['p99']:.2f}"
                  f" | {r['tokens']['all_ms']['p50']:.2f} / {r['tokens']['all_ms']['p99']:.2f} ms",
        "")
    row("probe alone (hidden 128), p50: fresh interpreter | warm helper's child",
        lambda r: f"{r['probe']['fresh_interpreter_ms']['p50']:.0f} ms | " + (
            f"{r['probe']['warm_helper_ms']['p50']:.1f} ms" if "warm_helper_ms" in r["probe"]
            else "–"), "")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drops", type=int, default=100)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-size", type=int, default=20)
    ap.add_argument("--hang-rounds", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="also the per-call costs")
    ap.add_argument("--builds", default=str(OUT / "hotplug_builds"))
    ap.add_argument("--code", default=None, help="checkout whose colibri_core is measured")
    ap.add_argument("--vs", default=None, help="measure this checkout's code, then this one's")
    ap.add_argument("--md", action="store_true", help="print the markdown table")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.vs:
        return compare(args)
    code = Path(args.code).resolve() if args.code else REPO
    colibri_core = import_colibri_core(code)
    res = {"code": str(code), "commit": commit_of(code),
           "colibri_core": os.path.dirname(colibri_core.__file__),
           "machine": machine(), "python": sys.version.split()[0],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": os.getloadavg()[0]}
    res.update(run(args))
    res["load_after"] = os.getloadavg()[0]
    res["bandwidth_GBps"] = read_bandwidth(2, 512, 5)["GBps"]
    out = json.dumps(res, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(out)
    print(out if not args.md else table([(res["commit"], res)]))
    return 0


def compare(args) -> int:
    """This benchmark on `--vs`'s code, then on this checkout's: one table."""
    results = []
    for code in (Path(args.vs).resolve(), REPO):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = [sys.executable, "-m", "benchmarks.speed.bench_hotplug", "--code", str(code),
               "--drops", str(args.drops), "--bursts", str(args.bursts),
               "--burst-size", str(args.burst_size), "--hang-rounds", str(args.hang_rounds),
               "--builds", args.builds, "--json", path]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(code)
        print(f"measuring {code} ...", file=sys.stderr)
        subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        res = json.loads(Path(path).read_text())
        os.unlink(path)
        results.append((res["commit"], res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({label: r for label, r in results}, indent=1))
    for label, r in results:
        print(f"{label}: {r['date']}, {r['machine']}, backend {r['backend']}, "
              f"{r['threads']} threads, read bandwidth {r['bandwidth_GBps']:.1f} GB/s, "
              f"load {r['load_before']:.1f} -> {r['load_after']:.1f}; hot-plug settle "
              f"{r['settle_s']} s, probe timeout {r['probe_timeout_s']} s, probe slots "
              f"{r['probe_slots'] or '– (one probe at a time)'}")
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
