"""`colibri serve --ray --expert-shards 2` on Ray's multi-node test cluster (issue 40;
colibri_core/fleet/localcluster.py: a head and two worker nodes, 1 CPU, a 200 MB object
store and the loopback address each), started by the documented command: this test
process joins the same cluster. The built-in model's routed experts on two shard
actors, spread over the nodes; the server process runs the rest.

Against one engine in this process (the same watched experts): completions greedy and
seeded, streamed and not, token for token; per-shard /metrics with every shard computing
and the driver computing no routed expert; a hot-plugged expert (INT4 weights) reaches
its owner shard; a stopped shard counted slow; a killed shard fails the requests in
flight with a 503 and Retry-After (a stream that had sent tokens: its error event), Ray
restarts it with its experts (the hot-plugged one too), and the same server and the
other shard serve again.

Marked `ray` (.ci/run's second stage). Every wait is a deadline, never a latency.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from server_helpers import LiveServer, metric, wait_until

pytestmark = pytest.mark.ray
START_DEADLINE_S = 180.0
BACK_DEADLINE_S = 90.0
DEADLINE_MS = 300            # --shard-deadline-ms
PROMPTS = ["The assert statement", "A class definition"]
SAMPLING = ({"temperature": 0}, {"temperature": 0.9, "seed": 5})


def _need_ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI: ray is not installed (.ci/run installs '.[ray]' first)")
        pytest.skip("needs ray: pip install -e '.[ray]'")


class Server(LiveServer):
    """The documented command, joining the test's cluster."""

    def __init__(self, tmp, cluster):
        from colibri_core.fleet.localcluster import worker_env
        self.experts = tmp / "experts"
        self.experts.mkdir()
        super().__init__("--ray", "--expert-shards", "2", "--ray-address", cluster.address,
                         "--threads", "1", "--shard-deadline-ms", str(DEADLINE_MS),
                         experts_dir=self.experts, env=worker_env(), ready_s=START_DEADLINE_S)

    def complete(self, prompt, tokens=16, stream=False, **kw) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=180, json={
            "model": "builtin", "prompt": prompt, "max_tokens": tokens, "stream": stream, **kw})

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def shards(self) -> list[dict]:
        return httpx.get(self.url + "/status.json", timeout=30).json()["expert_shards"]["shards"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _need_ray()
    from colibri_core.fleet.localcluster import local_cluster
    tmp = tmp_path_factory.mktemp("shards")
    with local_cluster(nodes=2, cpus=1, object_store_mb=200) as cluster:
        s = Server(tmp, cluster)
        try:
            yield s
        finally:
            s.stop()


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One engine on its own watched folder: the hot-plug test drops the same file in."""
    from colibri_core.engine import Engine
    folder = tmp_path_factory.mktemp("ref-experts")
    with Engine.from_config("builtin", threads=1, experts_dir=str(folder)) as eng:
        eng.folder = folder
        yield eng


def _want(ref, prompt, tokens=16, **kw) -> str:
    """The engine's text with the server's sampling for these fields (its defaults:
    top_p 1, no sampling top-k; not the engine config's)."""
    from colibri_core.runtime.sampler import SamplingParams
    return ref.generate(prompt, max_new_tokens=tokens, sampling=SamplingParams(**kw)).run().text


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _streamed(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            d = json.loads(line[6:])
            assert "error" not in d, d
            out += [c["text"] for c in d["choices"]]
    return "".join(out)


def _same_tokens(served, ref):
    for prompt in PROMPTS:
        for kw in SAMPLING:
            want = _want(ref, prompt, **kw)
            assert _text(served.complete(prompt, **kw)) == want, (prompt, kw)
    assert _streamed(served.complete(PROMPTS[0], stream=True, temperature=0)) == \
        _want(ref, PROMPTS[0], temperature=0)


# ----------------------------------------------------------------------------- tests

def test_shard_serve_tokens_equal_one_engine_and_every_shard_computes(served, ref):
    before = served.metrics()
    _same_tokens(served, ref)
    page = served.metrics()
    shards = served.shards()
    assert len({s["node"] for s in shards}) == 2          # two nodes of the cluster
    assert [s["channel"] for s in shards] == ["unix", "unix"]   # the driver's host
    for s in (0, 1):
        sent = metric(page, "colibri_expert_shard_pairs_sent_total", f'node="{shards[s]["node"][:12]}",shard="{s}"')
        done = metric(page, "colibri_expert_shard_pairs_computed_total", f'node="{shards[s]["node"][:12]}",shard="{s}"')
        assert done > 0 and done == sent, (s, sent, done)   # every shard computed its share
    routed = sum(float(x) for x in re.findall(r"^colibri_routed_tokens_total\{.*\} (\S+)$", page, re.M))
    assert routed > 0
    assert metric(page, "colibri_expert_shard_driver_pairs_total") == 0 and \
        "colibri_expert_shard_driver_pairs_total 0.0" in before + page
    assert sum(s["computed"] for s in shards) == sum(s["sent"] for s in shards) >= routed


def _build_expert(tmp, name="shardy"):
    from colibri_core.experts.hotplug.authoring.builder import build_expert
    rng = np.random.default_rng(7)
    H, inter = 128, 128
    npz = tmp / f"{name}.npz"
    np.savez(npz, w1=rng.standard_normal((inter, H)) / np.sqrt(H),
             w3=rng.standard_normal((inter, H)) / np.sqrt(H),
             w2=rng.standard_normal((H, inter)) / np.sqrt(inter),
             router_row=np.zeros(H, np.float32), router_bias=np.float32(50.0))
    so = tmp / f"{name}.so"
    build_expert(npz, so, layer=[1, 2], name=name, version="1", portable=True)
    return so


def test_shard_serve_hot_plugged_expert_lands_on_its_owner(served, ref, tmp_path):
    so = _build_expert(tmp_path)
    os.replace(_copy(so, ref.folder / ".in"), ref.folder / "shardy.so")
    os.replace(_copy(so, served.experts / ".in"), served.experts / "shardy.so")
    wait_until(lambda: (ref.apply_expert_changes(), ref.expert_set_generation >= 1)[1],
               "the reference engine adopted shardy", timeout=60)
    wait_until(lambda: any(e.get("name") == "shardy" and e.get("status") == "active" for e in
                           httpx.get(served.url + "/v1/experts", timeout=30).json()["data"]),
               "the server adopted shardy", timeout=60)
    slot = next(e for e in httpx.get(served.url + "/v1/experts").json()["data"]
                if e.get("name") == "shardy")["slot"]
    owner = slot % 2
    sent0 = [s["sent"] for s in served.shards()]
    _same_tokens(served, ref)
    page = served.metrics()
    assert metric(page, "colibri_routed_tokens_total", 'expert="shardy"') > 0
    assert metric(page, "colibri_expert_shard_driver_pairs_total") == 0
    sent1 = [s["sent"] for s in served.shards()]
    # bias 50 on layers 1 and 2: every token routes to it there, on its owner
    assert sent1[owner] - sent0[owner] > sent1[1 - owner] - sent0[1 - owner]


def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def test_shard_serve_slow_shard_is_counted_per_shard(served, ref):
    victim = served.shards()[1]
    slow = lambda page, s: metric(page, "colibri_expert_shard_slow_total",  # noqa: E731
                                  f'node="{served.shards()[s]["node"][:12]}",shard="{s}"')
    before = served.metrics()
    got = {}
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: got.update(r=served.complete(PROMPTS[1], 4, temperature=0)))
        t.start()
        time.sleep(3 * DEADLINE_MS / 1000)
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    t.join(120)
    assert _text(got["r"]) == _want(ref, PROMPTS[1], 4, temperature=0)
    assert slow(served.metrics(), 1) >= slow(before, 1) + 1


def test_shard_serve_killed_shard_503_restart_and_serves_again(served, ref):
    shards = served.shards()
    victim, other = shards[0], shards[1]
    results: dict = {}

    def long_request(i):       # two whole answers and a stream
        results[i] = served.complete(PROMPTS[i % 2], 3000, stream=i == 2, temperature=0,
                                     ignore_eos=True)
    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: metric(served.metrics(), "colibri_requests_running") >= 3,
               "the three requests running", timeout=60)
    time.sleep(0.5)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    for r in (results[0], results[1]):
        assert r.status_code == 503, r.text[:300]
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["code"] == "expert_shard_unavailable" and "expert shard 0" in err["message"]
    # the stream had sent tokens: it ends with the error event, then [DONE]
    events = [line[6:] for line in results[2].text.splitlines() if line.startswith("data: ")]
    assert results[2].status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "expert_shard_unavailable" and "expert shard 0" in err["message"]
    assert any("choices" in json.loads(e) for e in events[:-2])
    # Ray restarts the actor; the next steps fail at once until it answers, then it
    # gets its hot-plugged expert again and the server serves as before
    wait_until(lambda: served.complete(PROMPTS[0], 2, temperature=0).status_code == 200,
               "the fleet serving again", timeout=BACK_DEADLINE_S, period=0.5)
    after = served.shards()
    assert after[0]["pid"] != victim["pid"] and after[0]["restarts"] == 1 and after[0]["up"]
    assert after[1]["pid"] == other["pid"] and after[1]["restarts"] == 0
    assert served.proc.poll() is None
    _same_tokens(served, ref)
    page = served.metrics()
    assert metric(page, "colibri_expert_shard_failures_total",
                  f'node="{after[0]["node"][:12]}",shard="0"') >= 1
    assert metric(page, "colibri_expert_shard_driver_pairs_total") == 0
