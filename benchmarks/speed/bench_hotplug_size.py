"""A hot-plugged expert at a real model's size (issue 30): `colibri serve --model DIR`
running, expert .so files of the model's shape (hidden H, intermediate I: random INT4
weights, built by the hot-plug builder, `portable`) renamed into its watched folder, one at
a time, first while a request decodes, then with the server idle; time to join = the
adoption's time in `GET /v1/experts/events` less the moment of the rename.

    python -m benchmarks.speed.bench_hotplug_size MODEL_DIR [--layers 10,30] [--work DIR]

Prints the server's start (process start to its `serving` line), each file's build time,
size and time to join, and the load average; writes the figures as JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np


def build(work: Path, hidden: int, inter: int, layer: int, seed: int) -> tuple[Path, float]:
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    rng = np.random.default_rng(seed)
    npz, so = work / f"big{layer}.npz", work / f"big{layer}.so"
    np.savez(npz, w1=rng.standard_normal((inter, hidden)) / np.sqrt(hidden),
             w3=rng.standard_normal((inter, hidden)) / np.sqrt(hidden),
             w2=rng.standard_normal((hidden, inter)) / np.sqrt(inter),
             router_row=(rng.standard_normal(hidden) * 0.05).astype(np.float32),
             router_bias=np.float32(0.0))
    t = time.perf_counter()
    build_expert(npz, so, layer=layer, name=f"big{layer}", version="1", portable=True)
    return so, time.perf_counter() - t


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def decode_loop(url: str, stop: threading.Event, tokens: list) -> None:
    """Requests of 64 tokens back to back (EOS ignored) until stop; tokens: one count per
    finished request."""
    body = json.dumps({"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 64,
                       "temperature": 0, "ignore_eos": True}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            tokens.append(json.loads(r.read())["usage"]["completion_tokens"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--layers", default="10,30", help="MoE layers of the experts, one file each")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = json.loads((a.model / "config.json").read_text())
    hidden = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    work = a.work or Path(tempfile.mkdtemp(prefix="colibri-hotplug-size-"))
    folder, scratch = work / "experts", work / "scratch"
    folder.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(exist_ok=True)
    layers = [int(x) for x in a.layers.split(",")]
    res = {"model": str(a.model), "hidden": hidden, "inter": inter, "experts": []}
    builds = []
    for i, layer in enumerate(layers):
        so, s = build(scratch, hidden, inter, layer, 1 + i)
        builds.append((layer, so, s))
    t0 = time.perf_counter()
    srv = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--model", str(a.model),
                            "--port", "0", "--experts-dir", str(folder)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    log: list = []
    try:
        for line in srv.stdout:
            log.append(line)
            if "serving" in line and "http://" in line:
                url = line[line.index("http://"):].split()[0].rstrip("/")
                break
        if url is None:
            raise SystemExit("the server did not start:\n" + "".join(log[-20:]))
        res["serve_start_s"] = time.perf_counter() - t0
        threading.Thread(target=lambda: [log.append(x) for x in srv.stdout], daemon=True).start()
        stop, done = threading.Event(), []
        for i, (layer, so, build_s) in enumerate(builds):
            decoding = i == 0
            dec = None
            if decoding:
                dec = threading.Thread(target=decode_loop, args=(url, stop, done), daemon=True)
                dec.start()
                time.sleep(3.0)                      # the request is decoding
            seq = max([e["seq"] for e in get(url + "/v1/experts/events")["data"]], default=0)
            tmp = scratch / f"drop-{layer}.so"
            shutil.copyfile(so, tmp)
            t_wall = time.time()
            os.rename(tmp, folder / so.name)
            got = None
            while got is None and time.time() - t_wall < 120:
                time.sleep(0.02)
                for e in get(url + f"/v1/experts/events?since={seq}")["data"]:
                    if e["event"] == "refuse":
                        raise SystemExit(f"refused: {e}")
                    if e["event"] == "adopt" and e["name"] == so.stem:
                        got = e
            if got is None:
                raise SystemExit(f"{so.name} did not join within 120 s")
            if dec is not None:
                stop.set()
                dec.join()
            row = {"layer": layer, "bytes": so.stat().st_size, "build_s": round(build_s, 2),
                   "while_decoding": decoding, "join_s": round(got["time"] - t_wall, 3),
                   "load_avg": os.getloadavg()[0]}
            res["experts"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    print(f"serve start {res['serve_start_s']:.1f} s; load average {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
