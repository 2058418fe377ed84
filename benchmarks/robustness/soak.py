"""Soak: many requests in sequence on the built-in model while hot-plugged experts are
added, replaced and removed now and then; checks that nothing grows.

    python -m benchmarks.robustness.soak --minutes 3 [--json benchmarks/out/soak.json] [--seed 0]
    python -m benchmarks.robustness.soak --tokens 20000

What it does
1. Builds a pool of expert .so files up front (colibri_core.experts.hotplug.authoring.builder.build_expert
   from random .npz weights: three experts, two versions each, hidden 128, on MoE layers
   1, 2 and 3 of the built-in model), so that a hot-plug action during the run is a
   rename into the watched folder, not a compile.
2. Engine.from_config("builtin", experts_dir=<watched folder>).
3. Warm-up: `--warmup-requests` requests without any hot expert.
4. The run: requests in sequence (prompts from a list, 16..160 new tokens, sampled,
   seeded); every `--action-every` requests one hot-plug action: add an expert, replace
   one with its other version (same name), or remove one (delete the file).
5. The end: every hot expert is removed, the removal is waited for, and the counts are
   taken again in the same expert state as after the warm-up (none live).

Reported: tokens, requests, duration, decode tokens/s; RSS (total, anonymous, file-backed)
at start (engine loaded), after warm-up and at the end, plus the slope of RSS over the run
(MiB per 10k tokens, a least-squares fit on a sample after every request); per-token
latency p50/p99 per phase (warm-up, no hot expert live, hot expert(s) live, first token
after an expert-set change; first tokens, which include the prefill, apart); open file
descriptors (/proc/self/fd), memory mappings (/proc/self/maps) and threads
(/proc/self/task) at start, after warm-up, at the end and after close; hot-plug events.

Pass criteria (printed, and the exit status): after warm-up, RSS growth <= --rss-slack-mib
(default 8 MiB); no fd, thread or file-backed mapping (model file, expert .so) left over
at the end compared with after the warm-up (same expert state: none live); anonymous
mappings within --anon-maps-slack (allocator arenas come and go); no expert refused.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_core.config import HotplugConfig
from colibri_core.engine import Engine
from colibri_core.hookspecs import hookimpl
from colibri_core.experts.hotplug.authoring.builder import build_expert

PROMPTS = [
    "The import statement", "A class definition", "The with statement", "Exceptions are",
    "The assert statement", "MODE:k1|The for statement", "Coroutines", "The global statement",
    "Lambda expressions", "MODE:k3|Comparisons", "The del statement", "Boolean operations",
    "Identifiers", "The yield statement", "String literals", "The try statement",
]
EXPERTS = {   # name -> layers (the built-in model: layer 0 dense, layers 1-3 MoE, hidden 128)
    "soak_a": [1], "soak_b": [2], "soak_c": [1, 3],
}
HIDDEN, INTER = 128, 64
PHASES = ("warmup", "base", "hot", "change", "first")


# ----------------------------------------------------------------------------- probes

def rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024          # MiB
    return {"rss_mib": out.get("VmRSS", 0.0), "anon_mib": out.get("RssAnon", 0.0),
            "file_mib": out.get("RssFile", 0.0)}


def counts() -> dict:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps,
            "threads": len(os.listdir("/proc/self/task"))}


def snapshot(label: str, tokens: int) -> dict:
    return {"at": label, "tokens": tokens, **rss(), **counts()}


def maps_by_path() -> dict:
    """Mappings per backing file ('[anon]' for anonymous ones)."""
    out: dict = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else "[anon]"
            out[name] = out.get(name, 0) + 1
    return out


def maps_diff(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b))
            if b.get(k, 0) != a.get(k, 0)}


class Events:
    def __init__(self):
        self.n = {"loaded": 0, "unloaded": 0, "rejected": 0}
        self.rejected = []

    @hookimpl
    def colibri_expert_loaded(self, info):
        self.n["loaded"] += 1

    @hookimpl
    def colibri_expert_unloaded(self, info):
        self.n["unloaded"] += 1

    @hookimpl
    def colibri_expert_rejected(self, path, reason):
        self.n["rejected"] += 1
        self.rejected.append(f"{path}: {reason}")


def pct(a, q):
    return float(np.percentile(np.asarray(a) * 1000, q)) if len(a) else float("nan")


# ----------------------------------------------------------------------------- the run

def build_pool(build: Path, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    pool = {}
    for name, layers in EXPERTS.items():
        for version in ("1", "2"):
            npz = build / f"{name}-{version}.npz"
            np.savez(npz, w1=rng.standard_normal((INTER, HIDDEN)) / np.sqrt(HIDDEN),
                     w3=rng.standard_normal((INTER, HIDDEN)) / np.sqrt(HIDDEN),
                     w2=rng.standard_normal((HIDDEN, INTER)) / np.sqrt(INTER),
                     router_row=(rng.standard_normal(HIDDEN) / np.sqrt(HIDDEN)).astype(np.float32),
                     router_bias=np.float32(2.0))
            so = build / f"{name}-{version}.so"
            build_expert(npz, so, layer=layers, name=name, version=version,
                         portable=True)       # random weights: no base model
            pool[(name, version)] = so
    return pool


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0, help="run length (default 3)")
    ap.add_argument("--tokens", type=int, default=None, help="stop after this many tokens instead")
    ap.add_argument("--warmup-requests", type=int, default=20)
    ap.add_argument("--action-every", type=int, default=6, help="requests between hot-plug actions")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-slack-mib", type=float, default=8.0)
    ap.add_argument("--anon-maps-slack", type=int, default=4,
                    help="anonymous mappings allowed to differ (allocator arenas)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)

    base = snapshot("process start", 0)
    tmp = Path(tempfile.mkdtemp(prefix="colibri-soak-"))
    try:
        watched, build = tmp / "experts", tmp / "build"
        watched.mkdir(mode=0o755)
        build.mkdir()
        t_build = time.perf_counter()
        pool = build_pool(build, args.seed)
        t_build = time.perf_counter() - t_build
        print(f"soak: built {len(pool)} expert .so files in {t_build:.1f} s", file=sys.stderr)

        over = {"experts_dir": str(watched), "hotplug": HotplugConfig(settle_s=0.05)}
        if args.threads:
            over["threads"] = args.threads
        eng = Engine.from_config("builtin", **over)
        events = Events()
        eng.register_plugin(events, name="soak-events")
        # Latencies go into arrays allocated and touched up front, so that the soak's own
        # bookkeeping does not show up as RSS growth (a Python list of floats would).
        cap = args.tokens + 20000 if args.tokens else int(args.minutes * 60 * 3000) + 20000
        lat_s = np.full(cap, np.nan)
        lat_phase = np.full(cap, 255, np.uint8)
        samples = np.full((cap // 8 + 1024, 3), np.nan)   # (tokens, rss, anon) per request
        snaps = [snapshot("engine loaded", 0)]
        n_lat = 0
        live: dict[str, str] = {}          # name -> version in the watched folder
        actions = []
        tokens = requests = 0
        t0 = time.perf_counter()
        deadline = t0 + args.minutes * 60
        last_version = eng.expert_set_generation

        def one_request(phase: str) -> None:
            nonlocal tokens, requests, last_version, n_lat
            prompt = rnd.choice(PROMPTS)
            n = rnd.randint(16, 160)
            g = eng.generate(prompt, max_new_tokens=n, temperature=0.8, top_p=0.95,
                             seed=rnd.randrange(1 << 30))
            for ev in g:
                if ev.step == 0:
                    code = PHASES.index("first")
                elif phase == "warmup":
                    code = PHASES.index("warmup")
                elif ev.expert_set_generation != last_version:
                    code = PHASES.index("change")
                elif eng.model.expert_set.hot_experts():
                    code = PHASES.index("hot")
                else:
                    code = PHASES.index("base")
                if n_lat < cap:
                    lat_s[n_lat], lat_phase[n_lat] = ev.latency_s, code
                    n_lat += 1
                last_version = ev.expert_set_generation
                tokens += 1
            if requests < len(samples):
                r = rss()
                samples[requests] = (tokens, r["rss_mib"], r["anon_mib"])
            requests += 1

        def act() -> None:
            absent = [n for n in EXPERTS if n not in live]
            choices = (["add"] if absent else []) + (["replace", "remove"] if live else [])
            what = rnd.choice(choices)
            if what == "add":
                name, version = rnd.choice(absent), "1"
            elif what == "replace":
                name = rnd.choice(sorted(live))
                version = "2" if live[name] == "1" else "1"
            else:
                name = rnd.choice(sorted(live))
            dst = watched / f"{name}.so"
            if what == "remove":
                dst.unlink()
                del live[name]
            else:
                tmp_copy = watched / f".{name}.so.tmp"          # dot-files are ignored
                shutil.copyfile(pool[(name, version)], tmp_copy)
                os.chmod(tmp_copy, 0o644)
                os.replace(tmp_copy, dst)
                live[name] = version
            actions.append({"tokens": tokens, "action": what, "name": name,
                            "version": live.get(name)})

        for _ in range(args.warmup_requests):
            one_request("warmup")
        snaps.append(snapshot("after warm-up", tokens))
        maps_warm = maps_by_path()
        t_run = time.perf_counter()
        while True:
            if args.tokens is not None and tokens >= args.tokens:
                break
            if args.tokens is None and time.perf_counter() >= deadline:
                break
            if requests % args.action_every == 0:
                act()
            one_request("run")
        run_s = time.perf_counter() - t_run
        # Back to the warm-up's expert state (none live), then the final counts.
        for name in list(live):
            (watched / f"{name}.so").unlink()
            actions.append({"tokens": tokens, "action": "remove", "name": name, "version": None})
            del live[name]
        t_wait = time.perf_counter()
        while time.perf_counter() - t_wait < 30:
            eng.hotplug.wait_idle(5)
            eng.apply_expert_changes()
            if not eng.model.expert_set.hot_experts() and not eng.hotplug.active():
                break
            time.sleep(0.05)
        eng.generate("The end", max_new_tokens=4, temperature=0).run()   # drains, settles
        import gc
        gc.collect()                       # finalizers of old expert-set snapshots
        eng.apply_expert_changes()
        snaps.append(snapshot("end (no hot expert live)", tokens))
        maps_end = maps_by_path()
        hot_left = len(eng.model.expert_set.hot_experts())
        eng.close()
        del eng
        gc.collect()
        snaps.append(snapshot("after close", tokens))
        duration = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    run = samples[args.warmup_requests:min(requests, len(samples))]
    x, y, ya = run[:, 0], run[:, 1], run[:, 2]
    lat = {ph: lat_s[:n_lat][lat_phase[:n_lat] == i] for i, ph in enumerate(PHASES)}
    slope = float(np.polyfit(x, y, 1)[0] * 10000) if len(x) > 2 and np.ptp(x) else 0.0
    slope_anon = float(np.polyfit(x, ya, 1)[0] * 10000) if len(x) > 2 and np.ptp(x) else 0.0
    warm, end = snaps[1], snaps[2]
    decode = np.concatenate([lat["warmup"], lat["base"], lat["hot"], lat["change"]])
    result = {
        "tokens": tokens, "requests": requests, "duration_s": round(duration, 1),
        "run_s": round(run_s, 1),
        "decode_tok_s": round(len(decode) / float(decode.sum()), 1) if len(decode) else 0,
        "expert_builds_s": round(t_build, 1),
        "snapshots": [base] + snaps,
        "rss_growth_after_warmup_mib": round(end["rss_mib"] - warm["rss_mib"], 2),
        "anon_growth_after_warmup_mib": round(end["anon_mib"] - warm["anon_mib"], 2),
        "rss_slope_mib_per_10k_tokens": round(slope, 3),
        "anon_slope_mib_per_10k_tokens": round(slope_anon, 3),
        "rss_max_after_warmup_mib": round(float(y.max()) if len(y) else 0.0, 1),
        "latency_ms": {k: {"n": len(v), "p50": round(pct(v, 50), 3), "p99": round(pct(v, 99), 3),
                           "max": round(float(v.max()) * 1000, 3) if len(v) else None}
                       for k, v in lat.items()},
        "hotplug": {"actions": len(actions), "by_kind": {k: sum(a["action"] == k for a in actions)
                                                         for k in ("add", "replace", "remove")},
                    "events": events.n, "rejected": events.rejected[:5], "hot_left": hot_left},
        "leaks": {k: end[k] - warm[k] for k in ("fds", "maps", "threads")},
        "maps_changed_after_warmup": maps_diff(maps_warm, maps_end),
        "file_maps_left": sum(v for k, v in maps_diff(maps_warm, maps_end).items()
                              if not k.startswith("[") and v > 0),
        "anon_maps_delta": sum(v for k, v in maps_diff(maps_warm, maps_end).items()
                               if k.startswith("[")),
        "after_close_vs_process_start": {k: snaps[-1][k] - base[k] for k in ("fds", "maps", "threads")},
    }
    # File-backed mappings (model files, expert .so files) and fds must come back exactly;
    # anonymous ones move with the allocator's arenas (a few either way is not a leak).
    ok = (result["rss_growth_after_warmup_mib"] <= args.rss_slack_mib
          and result["leaks"]["fds"] <= 0 and result["leaks"]["threads"] <= 0
          and result["file_maps_left"] == 0 and result["anon_maps_delta"] <= args.anon_maps_slack
          and not events.rejected and hot_left == 0)
    result["pass"] = ok
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"soak: {'PASS' if ok else 'FAIL'}: {tokens} tokens in {requests} requests, "
          f"{duration:.0f} s; RSS {warm['rss_mib']:.1f} -> {end['rss_mib']:.1f} MiB after warm-up; "
          f"fds {warm['fds']} -> {end['fds']}, maps {warm['maps']} -> {end['maps']}, "
          f"threads {warm['threads']} -> {end['threads']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
