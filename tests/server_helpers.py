"""A live `colibri serve` in a subprocess, on 127.0.0.1 and a free port, for the tests."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
READY_DEADLINE_S = 30.0


class LiveServer:
    def __init__(self, *args: str, experts_dir: Path, env: dict | None = None,
                 ready_s: float = READY_DEADLINE_S):
        cmd = [sys.executable, "-m", "colibri_core", "serve", "--port", "0",
               "--experts-dir", str(experts_dir), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._url.wait(ready_s) or not self.url:
            self.stop()
            raise RuntimeError("the server did not print its URL within "
                               f"{ready_s:.0f} s:\n" + "\n".join(self.lines))
        deadline = time.monotonic() + READY_DEADLINE_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the server was not ready within the deadline:\n" + self.log())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"serving (http://\S+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self._url.set()
        self._url.set()

    def log(self) -> str:
        return "\n".join(self.lines)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus text page (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")) or \
                (labels == "" and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(pred, what: str, timeout: float = 30.0, period: float = 0.05):
    """pred()'s first truthy value within `timeout` seconds (a deadline, not a latency)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(period)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


async def stream_completion(url: str, prompt, n: int):
    """One greedy streaming completion of n tokens (ignore_eos):
    ([text of each token], [expert-set generation at each token])."""
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True}) as r:
            assert r.status_code == 200, await r.aread()
            text, gens, gen = [], [], None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                assert "error" not in d, d
                gen = d.get("expert_set_generation", gen)
                for ch in d["choices"]:
                    if ch["text"]:
                        text.append(ch["text"])
                        gens.append(gen)
            return text, gens


@contextlib.contextmanager
def training_server(tmp: Path, config, key: str):
    """A live server that may train experts (--allow-expert-training, a one-hash allow-list,
    --train-data-dir tmp/data, experts in tmp/experts with shadow/) on `config`, API key
    `key`: yields {"url", "experts", "data", "tmp"}."""
    experts = tmp / "experts"
    experts.mkdir(mode=0o700)
    (experts / "shadow").mkdir(mode=0o700)
    data = tmp / "data"
    data.mkdir()
    allow = tmp / "allow.txt"
    allow.write_text("0" * 64 + "\n")
    srv = LiveServer("--config", str(config), "--allow-expert-training", "--expert-allowlist",
                     str(allow), "--train-data-dir", str(data), experts_dir=experts,
                     env={"COLIBRI_API_KEY": key})
    try:
        yield {"url": srv.url, "experts": experts, "data": data, "tmp": tmp}
    finally:
        srv.stop()
