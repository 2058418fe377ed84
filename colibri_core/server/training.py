"""Training in the loop: `POST /v1/experts/train` trains a new expert on labelled examples
and adds it as a candidate (experts/candidates.py: the watched folder's shadow/).

Off by default, like an upload (the trained file is native code the server loads): the
server starts with --allow-expert-training only with an API key and a hash allowlist;
the sha256 of each expert it builds itself is added to the hot-plug allowlists in force.

One job at a time (a second request while one is queued or running: 409 naming it). The
job runs `python -m colibri_core.server.trainchild SPEC` at `nice 10` (trainchild.py: the
fraud example's recipe on the reference forward's features, then the builder for this
model), on its own thread; the built .so is written into shadow/ whole (write_atomic), where
the candidate machinery checks, probes and loads it. Each step (train_queued,
train_running, train_built, train_failed) is an event of the expert history.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from starlette.responses import JSONResponse

from ..files import read_json_lines, write_atomic
from .errors import ApiError, bad_request
from .limits import EXPERT_NAME_RE, LIMITS, read_json

log = logging.getLogger("colibri.server")
MAX_EXAMPLES = 500_000
MAX_PROMPT = 4096
MIN_EXAMPLES = 16
KEEP_JOBS = 20
FIELDS = ("name", "version", "examples", "path", "layer", "steps", "seed", "routed_weight")
EXAMPLE = '{"prompt": [token ids], "target": token id, "route": true|false}'


class Trainer:
    """The server's training jobs (thread-safe; one runs at a time)."""

    def __init__(self, engine, data_dir: str | None = None):
        self.engine = engine
        self.data_dir = os.path.realpath(data_dir) if data_dir else None
        self._lock = threading.Lock()
        self.jobs: OrderedDict[str, dict] = OrderedDict()
        self.current: str | None = None
        self.proc: subprocess.Popen | None = None

    # -- submitting ---------------------------------------------------------------------
    def reserve(self, name: str, version: str) -> dict:
        """A new queued job, or 409 while another is queued or running."""
        with self._lock:
            if self.current is not None:
                raise ApiError(409, f"training job {self.current} is "
                                    f"{self.jobs[self.current]['status']}: one job at a time; "
                                    f"GET /v1/experts/train/{self.current}",
                               code="training_busy")
            job = {"id": f"train-{uuid.uuid4().hex[:12]}", "name": name, "version": version,
                   "status": "queued", "reason": None, "created": round(time.time(), 3),
                   "finished": None, "result": None, "candidate": None, "log": []}
            self.current = job["id"]
            self.jobs[job["id"]] = job
            while len(self.jobs) > KEEP_JOBS:
                self.jobs.popitem(last=False)
        self._event("train_queued", job, None)
        return job

    def start(self, job: dict, examples: list, params: dict) -> None:
        threading.Thread(target=self._run, args=(job, examples, params), daemon=True,
                         name=f"colibri-{job['id']}").start()

    def get(self, job_id: str) -> dict:
        with self._lock:
            job = self.jobs.get(job_id)
            if job is None:
                known = ", ".join(self.jobs) or "none"
                raise ApiError(404, f"no training job {job_id!r:.40} (known: {known})",
                               code="no_job")
            return json.loads(json.dumps(job))

    def listing(self) -> list[dict]:
        with self._lock:
            return [json.loads(json.dumps(j)) for j in self.jobs.values()][::-1]

    # -- the job's thread ---------------------------------------------------------------
    def _run(self, job: dict, examples: list, params: dict) -> None:
        work = tempfile.mkdtemp(prefix="colibri-train-")
        try:
            ex_path = Path(work) / "examples.jsonl"
            with open(ex_path, "w") as f:
                for e in examples:
                    f.write(json.dumps(e, separators=(",", ":")) + "\n")
            del examples
            out_so = Path(work) / f"{job['name']}.so"
            spec = {**params, "model_dir": str(self.engine.model_dir), "examples": str(ex_path),
                    "name": job["name"], "version": job["version"], "out_so": str(out_so),
                    "result": str(Path(work) / "result.json")}
            (Path(work) / "spec.json").write_text(json.dumps(spec))
            cmd = ["nice", "-n", "10", sys.executable, "-m", "colibri_core.server.trainchild",
                   str(Path(work) / "spec.json")]
            with self._lock:
                job["status"] = "running"
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
            self._event("train_running", job, " ".join(cmd[:3]) + " trainchild")
            err = self._follow(job)
            rc = self.proc.wait()
            if rc != 0:
                return self._finish(job, "failed", err or f"the training process exited {rc}")
            result = json.loads((Path(work) / "result.json").read_text())
            self._allow(result["sha256"])
            folder = self.engine.candidates.folder
            final = os.path.join(folder, f"{job['name']}.so")
            write_atomic(final, out_so.read_bytes(), suffix=".train")
            with self._lock:
                job["result"], job["candidate"] = result, final
            self._finish(job, "built", None)
        except Exception as e:  # noqa: BLE001 - a job's failure is its status, not a crash
            log.exception("training job %s failed", job["id"])
            self._finish(job, "failed", " ".join(f"{type(e).__name__}: {e}".split())[:300])
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _follow(self, job: dict) -> str:
        """Keep the child's last lines in the job; return its last stderr line."""
        err: list[str] = []
        t = threading.Thread(target=lambda: err.extend(self.proc.stderr.read().splitlines()),
                             daemon=True)
        t.start()
        for line in self.proc.stdout:
            with self._lock:
                job["log"] = (job["log"] + [line.rstrip()])[-8:]
        t.join()
        return next((x.strip() for x in reversed(err) if x.strip()), "")

    def _allow(self, sha: str) -> None:
        """The server built this file: the allowlists in force admit it."""
        for m in (self.engine.hotplug, getattr(self.engine.candidates, "manager", None)):
            if m is not None and m.allowlist is not None:
                m.allowlist = m.allowlist | {sha}

    def _finish(self, job: dict, status: str, reason: str | None) -> None:
        with self._lock:
            job["status"], job["reason"] = status, reason
            job["finished"] = round(time.time(), 3)
            if self.current == job["id"]:
                self.current = None
            self.proc = None
        self._event(f"train_{status}", job, reason or job.get("candidate"))

    def _event(self, kind: str, job: dict, message) -> None:
        es = self.engine.model.expert_set
        self.engine.expert_events.record(kind, {
            "name": job["name"], "version": job["version"], "reason": job["id"],
            "path": job.get("candidate"), "message": message}, es.generation, es.id)

    def close(self) -> None:
        with self._lock:
            p = self.proc
        if p is not None and p.poll() is None:
            p.kill()


# ---------------------------------------------------------------------------- checks
def check_examples(rows, vocab: int, where: str) -> list[dict]:
    """The examples, each checked; the first bad one is a 400 naming it."""
    if not isinstance(rows, list) or not MIN_EXAMPLES <= len(rows) <= MAX_EXAMPLES:
        n = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise bad_request(f"{where}: expected a list of {MIN_EXAMPLES}..{MAX_EXAMPLES} "
                          f"examples {EXAMPLE}, got {n}", param=where)
    out = []
    for i, e in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(e, dict) or set(e) - {"prompt", "target", "route"}:
            raise bad_request(f"{at}: expected {EXAMPLE}", param=at)
        p, t, r = e.get("prompt"), e.get("target"), e.get("route", False)
        if not isinstance(p, list) or not 1 <= len(p) <= MAX_PROMPT or not all(
                type(x) is int and 0 <= x < vocab for x in p):
            raise bad_request(f"{at}.prompt: expected a list of 1..{MAX_PROMPT} token ids "
                              f"0..{vocab - 1}", param=f"{at}.prompt")
        if type(t) is not int or not 0 <= t < vocab:
            raise bad_request(f"{at}.target={t!r:.40}: expected a token id 0..{vocab - 1}",
                              param=f"{at}.target")
        if not isinstance(r, bool):
            raise bad_request(f"{at}.route={r!r:.40}: expected true or false",
                              param=f"{at}.route")
        out.append({"prompt": p, "target": t, "route": r})
    n_route = sum(e["route"] for e in out)
    if n_route == 0 or n_route == len(out):
        raise bad_request(f"{where}: {n_route} of {len(out)} examples have route true; the "
                          f"router row needs both kinds", param=where)
    return out


def read_examples_file(trainer: Trainer, path) -> list:
    """A JSON-lines file under the server's --train-data-dir."""
    if trainer.data_dir is None:
        raise ApiError(403, "path: this server reads no training files: start it with "
                            "--train-data-dir DIR", type="permission_error", param="path",
                       code="no_train_dir")
    if not isinstance(path, str) or not path:
        raise bad_request("path: expected a file name under the server's --train-data-dir",
                          param="path")
    real = os.path.realpath(os.path.join(trainer.data_dir, path))
    if os.path.commonpath([real, trainer.data_dir]) != trainer.data_dir or \
            not os.path.isfile(real):
        raise bad_request(f"path={path!r:.80}: expected a regular file under the server's "
                          f"--train-data-dir", param="path")
    return read_json_lines(real, lambda n: bad_request(
        f"path {path!r:.80} line {n}: not JSON; expected one example {EXAMPLE} per line",
        param="path"))


def _int(body, key, lo, hi, default):
    v = body.get(key, default)
    if v is not None and (type(v) is not int or not lo <= v <= hi):
        raise bad_request(f"{key}={v!r:.40}: expected a whole number {lo}..{hi}", param=key)
    return v


# ---------------------------------------------------------------------------- routes
def _trainer(S) -> Trainer:
    if not S.settings.allow_expert_training:
        raise ApiError(403, "expert training is off: start the server with "
                            "--allow-expert-training (a trained expert is native code)",
                       type="permission_error", code="training_disabled")
    eng = getattr(S.backend, "engine", None)
    if getattr(eng, "candidates", None) is None:
        raise ApiError(409, "this server has no candidates: create a shadow/ folder in the "
                            "watched experts folder and restart it", code="no_candidates")
    t = getattr(S, "trainer", None)
    if t is None:
        t = S.trainer = Trainer(eng, S.settings.train_data_dir)
    return t


async def train(S, request, rec):
    trainer = _trainer(S)
    body = await read_json(request, LIMITS["upload"])
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown field; expected {', '.join(FIELDS)}",
                          param=unknown[0])
    name, version = body.get("name"), body.get("version", "1")
    if not isinstance(name, str) or not EXPERT_NAME_RE.fullmatch(name):
        raise bad_request(f"name={name!r:.70}: expected letters, digits, '_', '.', '-' "
                          f"(1-64, not starting with '.')", param="name")
    if not isinstance(version, str) or not EXPERT_NAME_RE.fullmatch(version):
        raise bad_request(f"version={version!r:.40}: expected a short text like \"2\"",
                          param="version")
    if ("examples" in body) == ("path" in body):
        raise bad_request("examples: give either examples (a list) or path (a file under "
                          "the server's --train-data-dir)", param="examples")
    cfg = trainer.engine.model_cfg
    params = {"layer": _int(body, "layer", 0, cfg.num_layers - 1, None),
              "steps": _int(body, "steps", 1, 100_000, 1500),
              "seed": _int(body, "seed", 0, 2**31 - 1, 0)}
    rw = body.get("routed_weight", 0.7)
    if type(rw) not in (int, float) or not 0 < rw <= 10:
        raise bad_request(f"routed_weight={rw!r:.40}: expected a number in (0, 10]",
                          param="routed_weight")
    params["routed_weight"] = float(rw)
    if "path" in body:
        rows = await asyncio.to_thread(read_examples_file, trainer, body["path"])
        where = "path"
    else:
        rows, where = body["examples"], "examples"
    examples = await asyncio.to_thread(check_examples, rows, cfg.vocab_size, where)
    job = trainer.reserve(name, version)
    trainer.start(job, examples, params)
    return JSONResponse(trainer.get(job["id"]), status_code=202)


async def job_status(S, request, rec):
    return JSONResponse(_trainer(S).get(request.path_params["job"]))


async def jobs(S, request, rec):
    return JSONResponse({"object": "list", "data": _trainer(S).listing()})


def close(S) -> None:
    """At shutdown: a running child is killed (its half-built expert never lands)."""
    t = getattr(S, "trainer", None)
    if t is not None:
        t.close()


def routes():
    """(path, route, name, methods) for app.py to mount (before /v1/experts/{name})."""
    return [("/v1/experts/train", train, "train", ("POST",)),
            ("/v1/experts/train", jobs, "train_jobs", ("GET",)),
            ("/v1/experts/train/{job}", job_status, "train_job", ("GET",))]
