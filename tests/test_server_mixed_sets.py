"""Several expert sets in one step against a live `colibri serve` (issue 35 item 1): a
stream pinned to the snapshot it was admitted under, a stream the canary picks and a
live one decode at the same time; each names the set that computed it, each stream's
tokens are those of the same request run alone afterwards, and /metrics'
colibri_mixed_set_steps_total shows that their sequences shared forward passes.

The model is tiny_model_dir's shape with a longer context (token ids, no tokenizer); the
candidate and the expert whose adoption makes the snapshot are built q4 experts that
every token of layer 1 chooses, so each of the three sets gives the prompt other tokens."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil

import httpx
import pytest

from hotplug_helpers import tiny_model_expert
from server_helpers import LiveServer, metric, wait_until

CONTEXT = 4096
PROMPT = [5, 6, 7, 8]            # one prompt for all three: only the set tells them apart
LONG = 3500                      # the pinned stream: the change and the others land inside it
SHORT = 1000
FRACTION = 0.5


def canary(request_id: str, fraction: float = FRACTION) -> bool:
    """The documented rule: sha256 of the id, first 8 bytes, as [0, 1), < fraction."""
    d = hashlib.sha256(request_id.encode()).digest()
    return int.from_bytes(d[:8], "big") / 2.0 ** 64 < fraction


def ids(picked: bool, n: int) -> list[str]:
    return [r for r in (f"mix-{i}" for i in range(200)) if canary(r) == picked][:n]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from colibri_core.model.testing import write_random_model
    tmp = tmp_path_factory.mktemp("mixsrv")
    write_random_model(tmp / "m", seed=0, context=CONTEXT)
    cand = tiny_model_expert(tmp, "cand", seed=1, bias=50.0)
    extra = tiny_model_expert(tmp, "extra", seed=2, bias=50.0)
    experts = tmp / "experts"
    experts.mkdir(mode=0o700)
    (experts / "shadow").mkdir(mode=0o700)
    srv = LiveServer("--model", str(tmp / "m"), "--model-id", "tiny", experts_dir=experts)
    try:
        yield {"url": srv.url, "experts": experts, "cand": cand, "extra": extra}
    finally:
        srv.stop()


def drop(so, folder, name: str) -> None:
    tmp = folder / f".{name}.tmp"
    shutil.copyfile(so, tmp)
    os.replace(tmp, folder / name)


def listing(url: str) -> dict:
    return httpx.get(url + "/v1/experts", timeout=30).json()


def mixed_steps(url: str) -> float:
    return metric(httpx.get(url + "/metrics", timeout=30).text, "colibri_mixed_set_steps_total")


async def stream(c: httpx.AsyncClient, url: str, rid: str, n: int, started=None):
    """One greedy streaming completion of n tokens (EOS ignored) -> (token ids, the
    distinct expert_set objects its chunks named); `started` is set at its first token."""
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    toks, sets = [], []
    async with c.stream("POST", url + "/v1/completions", json=body,
                        headers={"X-Request-ID": rid}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            if "expert_set" in d and d["expert_set"] not in sets:
                sets.append(d["expert_set"])
            toks += d["choices"][0].get("token_ids", [])
            if toks and started is not None:
                started.set()
    return toks, sets


def alone(url: str, rid: str, n: int):
    async def one():
        async with httpx.AsyncClient(timeout=300) as c:
            return await stream(c, url, rid, n)
    return asyncio.run(one())


def test_pinned_canary_and_live_streams_share_steps_each_as_alone(world):
    url, experts = world["url"], world["experts"]
    drop(world["cand"], experts / "shadow", "cand.so")
    wait_until(lambda: any(x["name"] == "cand" for x in listing(url)["candidates"]),
               "the candidate in shadow")
    r = httpx.post(url + "/v1/experts/candidates/cand", json={"fraction": FRACTION}, timeout=30)
    assert r.status_code == 200, r.text
    (rid_pin, rid_live), (rid_can,) = ids(False, 2), ids(True, 1)
    base = listing(url)
    m0 = mixed_steps(url)

    async def together():
        async with httpx.AsyncClient(timeout=600) as cl:
            started = asyncio.Event()
            pin = asyncio.create_task(stream(cl, url, rid_pin, LONG, started))
            await asyncio.wait_for(started.wait(), 120)      # admitted under the base set
            drop(world["extra"], experts, "extra.so")        # the live set changes under it
            await asyncio.to_thread(wait_until, lambda: listing(url)["expert_set_generation"]
                                    > base["expert_set_generation"], "extra adopted", 120)
            assert not pin.done(), "the pinned stream ended before the change (too short)"
            rest = await asyncio.gather(stream(cl, url, rid_can, SHORT),
                                        stream(cl, url, rid_live, SHORT))
            return [await pin, *rest]
    (p_tok, p_sets), (c_tok, c_sets), (l_tok, l_sets) = asyncio.run(together())
    rose = mixed_steps(url) - m0
    live = listing(url)
    cand = next(x for x in live["candidates"] if x["name"] == "cand")
    assert cand["expert_set"]["id"] not in (live["expert_set_id"], base["expert_set_id"])
    # (a) each answer names the one set that computed it
    assert p_sets == [{"generation": base["expert_set_generation"],
                       "id": base["expert_set_id"]}]
    assert l_sets == [{"generation": live["expert_set_generation"],
                       "id": live["expert_set_id"]}]
    assert c_sets == [{"generation": live["expert_set_generation"],      # a completion names
                       "id": cand["expert_set"]["id"]}]                   # a candidate by id
    assert (len(p_tok), len(c_tok), len(l_tok)) == (LONG, SHORT, SHORT)
    # (c) their sequences shared forward passes: the pinned stream spans the others, so
    # nearly every step of theirs held two or three sets (half: room for the run-ahead
    # limit holding a stream back for a step on a loaded machine)
    assert rose >= SHORT // 2, f"{rose} steps ran more than one expert set"
    # (b) each stream's tokens are the same request's alone: the canary's and the live
    # one's now, the pinned one's once the live set is the base set again (by content)
    assert alone(url, rid_can, SHORT) == (c_tok, c_sets)
    assert alone(url, rid_live, SHORT) == (l_tok, l_sets)
    (experts / "extra.so").unlink()
    wait_until(lambda: listing(url)["expert_set_id"] == base["expert_set_id"], "extra removed")
    m1 = mixed_steps(url)
    p_alone, p_alone_sets = alone(url, rid_pin, LONG)
    assert p_alone == p_tok and p_alone_sets[0]["id"] == base["expert_set_id"]
    assert mixed_steps(url) == m1                  # alone: one set per step
    # the three sets give the one prompt different tokens: the comparisons can tell them
    assert p_tok[:SHORT] != l_tok and c_tok != l_tok and c_tok != p_tok[:SHORT]
