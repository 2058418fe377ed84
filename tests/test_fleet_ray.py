"""`colibri serve --ray` on a real local Ray cluster (tests/ray_helpers.py: `ray start
--head`, 2 CPUs): 2 engine replicas of 1 CPU each, the built-in model, started by the
documented command. The official `openai` client under bounded load; an expert dropped
into the head's folder reaches both replicas with no failed request and equal
expert_set_ids; a rollback travels to both; a rollout names the replicas that refused; a replica killed mid-request: the streams
it served end with a 503 event, the non-streaming requests are retried, and the replica
is back within 90 s with the current set; the registry restarts from its disk.

Marked `ray`: deselected by the README's `pytest -q`; `.ci/run` runs them in a stage of
their own (`pytest -m ray`). With CI set, a missing Ray is a failure. Every wait is a
deadline, never a latency.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from ray_helpers import REPO, RayCluster, free_port

pytestmark = pytest.mark.ray
CI = bool(os.environ.get("CI"))
START_DEADLINE_S = 240.0
ROLLOUT_DEADLINE_S = 60.0
BACK_DEADLINE_S = 90.0
PROMPTS = ["The assert statement", "The import system", "A class definition",
           "Exceptions are"]


def _need_ray():
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        if CI:
            pytest.fail("CI: ray[serve] is not installed (.ci/run installs '.[ray]' first)")
        pytest.skip("needs ray[serve]: pip install -e '.[ray]'")


class Fleet:
    def __init__(self, tmp):
        self.cluster = RayCluster(cpus=2)
        self.experts = tmp / "experts"
        self.experts.mkdir(mode=0o755)
        os.chmod(self.experts, 0o755)
        self.scratch = tmp / "scratch"
        self.scratch.mkdir()
        self.port = free_port()
        cmd = [sys.executable, "-m", "colibri_core", "serve", "--ray",
               "--ray-address", self.cluster.address, "--replicas", "2",
               "--replica-cpus", "1", "--port", str(self.port),
               "--experts-dir", str(self.experts), "--registry-dir", str(tmp / "registry")]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.cluster.env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.url = ""
        seen = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = re.search(r"serving (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    seen.set()
            seen.set()
        threading.Thread(target=read, daemon=True).start()
        if not seen.wait(START_DEADLINE_S) or not self.url:
            self.stop()
            raise RuntimeError("the fleet did not start:\n" + "\n".join(self.lines[-40:]))
        import ray
        ray.init(address=self.cluster.address, namespace="colibri", log_to_driver=False)

    def listing(self) -> dict:
        r = httpx.get(self.url + "/v1/experts", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_rollout(self, generation: int, what: str, deadline_s=ROLLOUT_DEADLINE_S,
                     new_replica_besides=None) -> dict:
        """The listing once `generation` is adopted by 2 live replicas (one of them not
        in `new_replica_besides`, when given)."""
        end = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < end:
            last = self.listing()
            ro = last["rollout"]
            live = [r for r in last["replicas"] if r["live"]]
            if ro["generation"] == generation and ro["complete"] and len(ro["adopted"]) == 2 \
                    and len(live) == 2 and (new_replica_besides is None or
                                            set(ro["adopted"]) - set(new_replica_besides)):
                return last
            time.sleep(0.1)
        raise AssertionError(f"not within {deadline_s:.0f} s: {what}; last listing: "
                             f"{json.dumps(last and last['rollout'])}")

    def drop(self, name: str, version: str, scale: float):
        from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
        tmp = compile_test_expert(self.scratch / f"{name}-{version}.so", hidden=128, layer=1,
                                  name=name, version=version, scale=scale)
        os.replace(tmp, self.experts / f"{name}.so")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self):
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            try:
                import ray
                ray.shutdown()
            except ImportError:
                pass
        finally:
            self.cluster.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    _need_ray()
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    f.stop()


@pytest.fixture(scope="module")
def client(fleet):
    import openai
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def ref():
    from colibri_core.engine import Engine
    with Engine.from_config("builtin", threads=1) as eng:
        yield eng


class Load:
    """`clients` threads sending completions (streaming and not, in turn) until stopped:
    bounded load; every failure and every expert set the answers named is kept."""

    def __init__(self, client, clients: int = 4, tokens: int = 12):
        self.client, self.tokens = client, tokens
        self.failures: list[str] = []
        self.sets: list[tuple[int, str]] = []
        self.done = 0
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            try:
                if n % 2:
                    chunks = list(self.client.completions.create(
                        model="builtin", prompt=prompt, max_tokens=self.tokens,
                        temperature=0, stream=True))
                    for c in chunks:
                        if "expert_set_id" in (c.model_extra or {}):
                            self.sets.append((c.model_extra["expert_set_generation"],
                                              c.model_extra["expert_set_id"]))
                else:
                    r = self.client.completions.create(model="builtin", prompt=prompt,
                                                       max_tokens=self.tokens, temperature=0)
                    self.sets += [(s["expert_set_generation"], s["expert_set_id"])
                                  for s in r.model_extra["expert_sets"]]
                self.done += 1
            except Exception as e:  # noqa: BLE001 - counted: the test asserts none
                self.failures.append(f"{type(e).__name__}: {e}")
            n += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(120)


# ----------------------------------------------------------------------------- tests

def test_completions_through_the_fleet_equal_the_engine(fleet, client, ref):
    for prompt in PROMPTS[:2]:
        want = ref.generate(prompt, max_new_tokens=16, temperature=0.0).run().text
        r = client.completions.create(model="builtin", prompt=prompt, max_tokens=16,
                                      temperature=0)
        assert r.choices[0].text == want
        chunks = list(client.completions.create(model="builtin", prompt=prompt,
                                                max_tokens=16, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    listing = fleet.listing()
    assert listing["rollout"]["complete"] and len(listing["rollout"]["adopted"]) == 2
    assert r.model_extra["expert_sets"][0]["expert_set_id"] == listing["expert_set_id"]
    page = fleet.metrics()
    assert 'colibri_fleet_replicas{state="adopted"} 2.0' in page
    assert "colibri_replica_failures_total" in page


def test_fleet_metrics_sum_the_replicas_prefix_caches(fleet, client):
    """The fleet's /metrics: each prefix-cache counter is the sum of the live replicas'
    own (their last reports to the registry). Six requests of one long prompt over two
    replicas: one replica sees it twice at least, a hit with reused tokens."""
    from colibri_core.fleet.registry import get_registry
    from server_helpers import metric, wait_until
    import ray
    keys = ("hits", "misses", "reused_tokens")

    def counts(page):
        return {k: metric(page, f"colibri_prefix_cache_{k}_total") for k in keys}

    def settled():               # the replicas report about once a second
        last = None
        for _ in range(30):
            now = counts(fleet.metrics())
            if now == last:
                return now
            last = now
            time.sleep(2.5)
        raise AssertionError(f"the prefix-cache counters kept changing: {last}")
    before = settled()                    # earlier tests' lookups reported
    prompt = " ".join(["The import system of a module"] * 24)
    for _ in range(6):
        client.completions.create(model="builtin", prompt=prompt, max_tokens=2,
                                  temperature=0)
    wait_until(lambda: (lambda c: c["hits"] + c["misses"] - before["hits"] -
                        before["misses"] >= 6)(counts(fleet.metrics())),
               "the six lookups reported by the replicas", timeout=60)
    for _ in range(50):                 # a page read between two equal registry reports
        a = ray.get(get_registry().snapshot.remote())
        page = fleet.metrics()
        b = ray.get(get_registry().snapshot.remote())
        if a["replicas"] == b["replicas"]:
            break
    reps = [r["counters"]["prefix_cache"] for r in a["replicas"].values()]
    assert len(reps) == 2 and all(reps)
    got = counts(page)
    assert got == {k: float(sum(r[k] for r in reps)) for k in keys}
    assert got["hits"] - before["hits"] >= 1 and \
        got["reused_tokens"] > before["reused_tokens"], (before, reps)
    assert got["hits"] + got["misses"] - before["hits"] - before["misses"] == 6


def test_a_drop_reaches_both_replicas_with_no_failed_request(fleet, client):
    before = fleet.listing()
    load = Load(client)
    try:
        fleet.drop("fraud", "1", 1.0)
        after = fleet.wait_rollout(before["expert_set_generation"] + 1,
                                   "the dropped expert adopted on both replicas")
        time.sleep(1.0)                           # requests on the new set, under load
    finally:
        load.stop()
    assert load.failures == [] and load.done > 0
    ids = {r["expert_set_id"] for r in after["replicas"] if r["live"]}
    assert ids == {after["expert_set_id"]} and after["expert_set_id"] != before["expert_set_id"]
    hot = [r for r in after["data"] if r["origin"] == "hot-plugged"]
    assert [(r["name"], r["slot"], r["status"]) for r in hot] == [("fraud", 8, "active")]
    gens = [g for g, _ in load.sets]
    assert (after["expert_set_generation"], after["expert_set_id"]) in load.sets
    assert set(load.sets) <= {(before["expert_set_generation"], before["expert_set_id"]),
                              (after["expert_set_generation"], after["expert_set_id"])}
    assert gens, "no answer named its expert set"


def test_a_rollback_travels_to_both_replicas(fleet, client):
    v1 = fleet.listing()
    fleet.drop("fraud", "2", 2.0)
    v2 = fleet.wait_rollout(v1["expert_set_generation"] + 1, "fraud 2 on both replicas")
    assert v2["expert_set_id"] != v1["expert_set_id"]
    r = httpx.post(fleet.url + "/v1/experts/fraud/rollback", timeout=30)
    assert r.status_code == 202, r.text
    back = fleet.wait_rollout(v2["expert_set_generation"] + 1, "the rollback on both replicas")
    assert back["expert_set_id"] == v1["expert_set_id"]
    assert {r["expert_set_id"] for r in back["replicas"] if r["live"]} == {v1["expert_set_id"]}
    (row,) = [r for r in back["data"] if r["name"] == "fraud"]
    assert row["version"] == "1" and row["slot"] == 8
    out = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0)
    assert out.model_extra["expert_sets"][-1] == {
        "expert_set_generation": back["expert_set_generation"],
        "expert_set_id": v1["expert_set_id"]}
    r = httpx.post(fleet.url + "/v1/experts/nobody/rollback", timeout=30)
    assert r.status_code == 404 and "not active" in r.json()["error"]["message"]


def test_a_rollout_names_the_replicas_that_refused(fleet, client):
    """An expert whose probe crashes: the registry takes it (its metadata is fine), both
    replicas' engines refuse it; the rollout names them with the refusal, and they go on
    serving the set they had."""
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    before = fleet.listing()
    tmp = compile_test_expert(fleet.scratch / "crashy.so", hidden=128, layer=1,
                              name="crashy", fault="segv")
    os.replace(tmp, fleet.experts / "crashy.so")
    end = time.monotonic() + ROLLOUT_DEADLINE_S
    while time.monotonic() < end:
        now = fleet.listing()
        ro = now["rollout"]
        if ro["generation"] == before["expert_set_generation"] + 1 and len(ro["failed"]) == 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the refusal was not reported by both replicas: {ro}")
    assert not ro["complete"] and ro["adopted"] == []
    for f in ro["failed"]:
        assert f["state"] == "refused" and f["refused"][0]["path"].endswith("crashy.so")
    assert {r["expert_set_id"] for r in now["replicas"] if r["live"]} == \
        {before["expert_set_id"]}
    assert any(r["where"] != "registry" and r["path"].endswith("crashy.so")
               for r in now["refusals"])
    r = client.completions.create(model="builtin", prompt=PROMPTS[1], max_tokens=4,
                                  temperature=0)
    assert r.model_extra["expert_sets"][-1]["expert_set_id"] == before["expert_set_id"]
    status = httpx.get(fleet.url + "/status.json", timeout=30).json()
    assert status["backend"] == "ray" and status["rollout"]["failed"]
    os.unlink(fleet.experts / "crashy.so")
    back = fleet.wait_rollout(before["expert_set_generation"] + 2, "crashy removed")
    assert back["expert_set_id"] == before["expert_set_id"]


def _stream(url: str, prompt: str, tokens: int) -> dict:
    """A streaming completion read with httpx: its tokens, and its error event if any."""
    out = {"tokens": 0, "error": None, "status": None}
    with httpx.stream("POST", url + "/v1/completions", timeout=180, json={
            "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            r.read()
            out["error"] = r.json()["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                out["error"] = d["error"]
            else:
                out["tokens"] += sum(1 for c in d["choices"] if c["finish_reason"] is None)
    return out


def test_a_killed_replica_is_back_within_90_s_with_the_current_set(fleet, client):
    before = fleet.listing()
    live = [r for r in before["replicas"] if r["live"]]
    assert len(live) == 2
    victim = live[0]
    results: dict = {}
    # Long enough that all 8 are still running when the victim is killed: at 300 / 600
    # tokens a quiet machine finished the victim's share first (the check below failed)
    STREAM, WHOLE = 1600, 1200

    def streaming(i):
        results[("s", i)] = _stream(fleet.url, PROMPTS[i % 4], STREAM)

    def whole(i):
        try:
            r = client.completions.create(model="builtin", prompt=PROMPTS[i % 4],
                                          max_tokens=WHOLE, temperature=0,
                                          extra_body={"ignore_eos": True})
            results[("n", i)] = {"tokens": r.usage.completion_tokens, "error": None}
        except Exception as e:  # noqa: BLE001 - asserted below
            results[("n", i)] = {"tokens": 0, "error": f"{type(e).__name__}: {e}"}
    threads = [threading.Thread(target=f, args=(i,)) for i in range(4) for f in (streaming, whole)]
    for t in threads:
        t.start()
    end = time.monotonic() + 60
    while time.monotonic() < end:                 # the 8 requests admitted on the replicas
        if httpx.get(fleet.url + "/status.json", timeout=30).json()["running"] >= 8:
            break
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(240)
    back = fleet.wait_rollout(before["expert_set_generation"], "a new replica with the "
                              "current set", BACK_DEADLINE_S,
                              new_replica_besides=[r["replica"] for r in live])
    assert {r["expert_set_id"] for r in back["replicas"] if r["live"]} == \
        {before["expert_set_id"]}
    whole_errors = [v["error"] for k, v in results.items() if k[0] == "n" and v["error"]]
    assert whole_errors == [], whole_errors          # retried once on the other replica
    for k, v in results.items():
        if k[0] == "s" and v["error"] is not None:
            assert v["error"]["code"] == 503, v
        elif k[0] == "s":
            assert v["tokens"] == STREAM, v
    page = fleet.metrics()
    from server_helpers import metric
    ended = metric(page, "colibri_replica_failures_total", 'outcome="stream_ended"') + \
        metric(page, "colibri_replica_failures_total", 'outcome="not_started"')
    retried = metric(page, "colibri_replica_failures_total", 'outcome="retried"')
    assert ended == sum(1 for k, v in results.items() if k[0] == "s" and v["error"])
    assert ended + retried >= 1, "the killed replica served none of the 8 requests"
    r = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=4,
                                  temperature=0)
    assert r.model_extra["expert_sets"][-1]["expert_set_id"] == before["expert_set_id"]


def test_the_registry_restarts_from_its_disk(fleet):
    import ray
    from colibri_core.fleet.registry import get_registry
    before = fleet.listing()
    ray.kill(get_registry(), no_restart=False)
    end = time.monotonic() + ROLLOUT_DEADLINE_S
    while time.monotonic() < end:
        try:
            now = fleet.listing()
            if now["rollout"]["complete"] and len(now["rollout"]["adopted"]) == 2:
                break
        except (AssertionError, httpx.HTTPError):
            pass
        time.sleep(0.2)
    else:
        raise AssertionError("the registry did not come back with both replicas")
    assert now["expert_set_generation"] == before["expert_set_generation"]
    assert now["expert_set_id"] == before["expert_set_id"]
    assert [(r["name"], r["slot"], r["version"], r["status"]) for r in now["data"]
            if r["origin"] == "hot-plugged"] == [("fraud", 8, "1", "active"),
                                                 ("crashy", 9, "1.0", "removed")]
