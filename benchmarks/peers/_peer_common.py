"""Shared by the per-engine runner scripts of bench_vs_llamacpp.py (each runs in its own
process and prints one JSON object on its last stdout line).

A runner gets a JSON job on argv[1]:
    {"mode": "time", "model": PATH, "threads": 2, "prompt": [ids], "warmup": [ids],
     "tokens": 128, "profile": null | PATH}
    {"mode": "logits", "model": PATH, "threads": 2, "prompts": [[ids], ...], "out": PATH.npy}

"time" is measured the same way for every engine: token ids in, token id out (greedy
argmax over the engine's next-token logits), wall-clock perf_counter around the engine's
Python API. first_token_ms is the time from the call with the 64 prompt ids to the first
generated id; per_token_ms[i] the time from generated id i to generated id i+1.
"""
from __future__ import annotations

import json
import resource
import sys
import time


def job() -> dict:
    return json.loads(sys.argv[1])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vm_hwm_mib() -> float:
    """This process's own peak RSS since exec (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def emit(obj: dict) -> None:
    obj.setdefault("peak_rss_mib_self", peak_rss_mib())
    obj.setdefault("vm_hwm_mib", vm_hwm_mib())
    sys.stdout.write("\n" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def time_stream(step_iter) -> dict:
    """`step_iter` yields one generated token id at a time; the clock starts right before
    the first next() (which includes the prompt's prefill). Also this process's CPU time
    and context switches over the decode steps (all its threads): how much of the wall
    time it actually got the CPUs, and how often it was preempted."""
    ids, stamps = [], []
    ru0 = None
    t0 = time.perf_counter()
    for tok in step_iter:
        stamps.append(time.perf_counter())
        ids.append(int(tok))
        if ru0 is None:
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    first = (stamps[0] - t0) * 1000
    per = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    wall = stamps[-1] - stamps[0]
    n = max(1, len(per))
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"first_token_ms": first, "per_token_ms": per, "token_ids": ids,
            "decode_cpu_s": cpu, "decode_wall_s": wall,
            "decode_cpu_per_wall": cpu / wall if wall > 0 else None,
            "decode_invol_csw_per_token": (ru1.ru_nivcsw - ru0.ru_nivcsw) / n,
            "decode_vol_csw_per_token": (ru1.ru_nvcsw - ru0.ru_nvcsw) / n}


def decode_profiled(it, prof):
    """Pass tokens through; start `prof` after the first (decode steps only)."""
    for tok in it:
        yield tok
        prof.start()


class Profiler:
    """cProfile of the decode steps only (started after the first generated token) when
    the job asks for it; stats written to a .pstats file for the orchestrator to print."""

    def __init__(self, path):
        self.path = path
        self.pr = None

    def start(self):
        if self.path and self.pr is None:
            import cProfile
            self.pr = cProfile.Profile()
            self.pr.enable()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pr is not None:
            self.pr.disable()
            self.pr.dump_stats(self.path)


def time_peer(stream, j: dict) -> dict:
    """Warm up with 4 tokens of j["warmup"], then time j["tokens"] tokens after j["prompt"]
    (under the profiler when j["profile"] asks for one). `stream(prompt, n)` yields token
    ids; the same procedure for every engine, so the numbers compare."""
    for _ in stream(j["warmup"], 4):
        pass
    prof = Profiler(j.get("profile"))
    with prof:
        return time_stream(decode_profiled(stream(j["prompt"], j["tokens"]), prof))

