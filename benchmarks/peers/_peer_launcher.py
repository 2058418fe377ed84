"""A small process that starts the engine runners for bench_vs_llamacpp.py and reports
each one's ru_maxrss from wait4.

Why: Linux carries a process's peak RSS across fork + exec (the forked copy of the parent's
address space counts as the child's, and exec keeps the maximum in signal->maxrss). Forked
from the orchestrator, which holds gigabytes of logits, every runner would report at least
the orchestrator's size. This launcher is started while the orchestrator is still small,
so what it forks starts from ~30 MiB.

Protocol: one JSON request per stdin line {"cmd": [...], "env": {...}, "cwd": str,
"timeout": s}; one JSON reply per stdout line {"rc", "maxrss_kib", "stdout", "stderr",
"timed_out"}. An empty line or EOF ends it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run(req: dict) -> dict:
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        p = subprocess.Popen(req["cmd"], stdout=fo, stderr=fe, env=req.get("env"), cwd=req.get("cwd"))
        deadline = time.time() + float(req.get("timeout", 3600))
        timed_out = False
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        p.returncode = os.waitstatus_to_exitcode(status)   # already reaped
        fo.seek(0)
        fe.seek(0)
        return {"rc": p.returncode, "maxrss_kib": ru.ru_maxrss, "timed_out": timed_out,
                "stdout": fo.read().decode(errors="replace"),
                "stderr": fe.read().decode(errors="replace")}


def main():
    for line in sys.stdin:
        if not line.strip():
            break
        sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
