"""`colibri serve --ray --expert-shards N` (or `--expert-plan FILE`): one model split
across a Ray cluster's nodes (issue 40, docs/SCALE.md "A model larger than one machine").

This process is the driver: `colibri serve`'s server and engine (attention, routers,
shared experts, dense layers, the scheduler, hot-plug), with the engine's routed experts
on N shard actors (shardactor.py), spread over the cluster's nodes, each holding its
plan's share. Batching, the scheduler, the expert folder and the API run unchanged on
top of the executor seam (Pipeline.experts). From Python:

    from colibri_core.fleet.shardserve import start_shards
    shards = start_shards(engine, owners, cpus=1)      # the engine's experts on actors
    ...
    shards.close()

/metrics adds, per shard, the (token, expert) pairs sent and computed, the results
later than the deadline, failures, restarts and whether it is up, and the routed pairs
the driver computed itself (routed minus sent: 0 while every expert is on a shard).
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import ConfigError
from ..server.backend import LocalBackend
from .shardactor import DEADLINE_S, TIMEOUT_S, RayShard, wait_all

COUNT_TIMEOUT_S = 0.5         # /metrics waits this long for a shard's own count


class Shards:
    """The shard actors of one engine and its executor (installed in its pipeline)."""

    def __init__(self, engine, owners: dict, shards: list):
        from .expertshard import ShardedExperts
        self.engine, self.owners, self.shards = engine, owners, shards
        self.executor = ShardedExperts(engine.model.pipeline, owners, shards).install()
        self._computed = [0] * len(shards)

    def stats(self) -> dict:
        """Per shard: its channel ("unix", "tcp"; "" while down), sent, computed (its
        own count; the last known while it does not answer), slow, failures, restarts,
        up; and the pairs the driver computed."""
        import ray
        refs = [s.actor.count.remote() if s.poll() else None for s in self.shards]
        live = [r for r in refs if r is not None]
        if live:
            ray.wait(live, num_returns=len(live), timeout=COUNT_TIMEOUT_S)
        for i, r in enumerate(refs):
            if r is not None:
                try:
                    self._computed[i] = ray.get(r, timeout=0)
                except Exception:  # noqa: BLE001 - not back in time or down: the last one
                    pass
        ex = self.executor
        driver = self._driver_pairs()
        return {"shards": [{"shard": i, "node": s.node, "pid": s.pid, "channel": s.channel,
                            "sent": ex.sent[i],
                            "computed": self._computed[i], "slow": s.slow,
                            "failures": s.failures, "restarts": s.restarts, "up": s.up}
                           for i, s in enumerate(self.shards)],
                "driver_pairs": driver}

    def _driver_pairs(self):
        """The engine's routed pairs minus those sent to shards (None without routing
        statistics). The step counts a layer's routed pairs just before it sends them:
        read again for a few ms while the two differ, so a scrape in between does not
        report pairs the driver never computed."""
        routed = self.engine.model.pipeline.routed
        if routed is None:
            return None
        for _ in range(10):
            total = int(sum(int(v.sum()) for v in list(routed.values())))
            diff = total - sum(self.executor.sent)
            if diff == 0:
                break
            time.sleep(0.001)
        return diff

    def close(self) -> None:
        self.executor.uninstall()
        for s in self.shards:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - Ray already gone
                pass


def start_shards(engine, owners: dict, *, cpus: int = 1, deadline_s: float = DEADLINE_S,
                 timeout_s: float = TIMEOUT_S, resources: Optional[list] = None) -> Shards:
    """The engine's routed experts on len(plan) shard actors (Ray must be initialized):
    spread over the nodes (or each on the node with `resources[i]`), restarted by Ray
    when they die; returns once every shard loaded its experts."""
    n = 1 + max(s for own in owners.values() for o in own for s in o)
    hp = engine.config.hotplug.model_dump() if engine.hotplug is not None else None
    where = [{"resources": r} for r in resources] if resources else \
        [{"scheduling_strategy": "SPREAD"}] * n
    shards = [RayShard(engine.model_dir, i, owners, cpus=cpus, hotplug=hp,
                       deadline_s=deadline_s, timeout_s=timeout_s, max_restarts=-1,
                       max_task_retries=0, **where[i]) for i in range(n)]
    try:
        wait_all(shards)
    except BaseException:
        for s in shards:
            s.close()
        raise
    return Shards(engine, owners, shards)


class ShardBackend(LocalBackend):
    """`colibri serve`'s backend with the shards' series in /metrics."""

    def __init__(self, engine, book=None, routing_stats: bool = True, shards: Shards = None):
        super().__init__(engine, book, routing_stats=routing_stats)
        self.shards = shards

    async def snapshot(self) -> dict:
        return await asyncio.to_thread(self.snapshot_now)    # asks the actors

    def snapshot_now(self) -> dict:
        snap = super().snapshot_now()
        stats = self.shards.stats()
        snap["expert_shards"] = stats
        snap["families"] = list(snap.get("families") or ()) + families(stats)
        return snap


def families(stats: dict) -> list:
    out = []
    for key, name, doc in (
            ("sent", "colibri_expert_shard_pairs_sent", "(token, expert) pairs the driver "
             "sent to each expert shard"),
            ("computed", "colibri_expert_shard_pairs_computed", "(token, expert) pairs each "
             "expert shard computed (its own count, since it last started)"),
            ("slow", "colibri_expert_shard_slow", "A MoE layer's results later than the "
             "deadline (--shard-deadline-ms), per shard"),
            ("failures", "colibri_expert_shard_failures", "Steps an expert shard failed "
             "(died, or no answer within --shard-timeout): their requests got a 503"),
            ("restarts", "colibri_expert_shard_restarts", "Times an expert shard came back "
             "after a failure")):
        c = CounterMetricFamily(name, doc, labels=["shard", "node"])
        for s in stats["shards"]:
            c.add_metric([str(s["shard"]), s["node"][:12]], s[key])
        out.append(c)
    up = GaugeMetricFamily("colibri_expert_shard_up", "1 while an expert shard answers, "
                           "0 from its failure until it answers again", labels=["shard", "node"])
    for s in stats["shards"]:
        up.add_metric([str(s["shard"]), s["node"][:12]], int(s["up"]))
    out.append(up)
    if stats["driver_pairs"] is not None:
        d = CounterMetricFamily("colibri_expert_shard_driver_pairs", "Routed (token, "
                                "expert) pairs the driver computed itself (routed minus "
                                "sent to shards): 0 while every routed expert is on a shard")
        d.add_metric([], stats["driver_pairs"])
        out.append(d)
    return out


def main(args) -> int:
    """`colibri serve --ray --expert-shards N | --expert-plan FILE`."""
    from ..engine import Engine
    from ..server.serve import resolve, run_server
    from .expertplan import PlanError, check_plan, load_plan, place
    if args.replicas != 1 or args.autoscale:
        raise ConfigError("--expert-shards / --expert-plan: one driver serves; --replicas "
                          "and --autoscale are for whole-model replicas")
    model_dir, engine_cfg, settings = resolve(args)
    try:
        if args.expert_plan:
            try:
                _, owners = load_plan(args.expert_plan, model_dir)
            except PlanError as e:
                raise ConfigError(f"--expert-plan {e}") from None
        else:
            if args.expert_shards < 1:
                raise ConfigError(f"--expert-shards {args.expert_shards}: expected at least 1")
            owners = check_plan(place(model_dir, args.expert_shards), model_dir)
    except PlanError as e:
        raise ConfigError(str(e)) from None
    if not args.shard_deadline_ms > 0 or not args.shard_timeout > 0:
        raise ConfigError("--shard-deadline-ms / --shard-timeout: expected a time > 0")
    try:
        import ray
    except ImportError:
        raise ConfigError("expert shards need Ray: pip install 'colibri[ray]'") from None
    from .deploy import runtime_env
    env = runtime_env()
    if not ray.is_initialized():
        ray.init(address=args.ray_address, runtime_env=env or None, log_to_driver=False)
    held = {}

    def engine():
        eng = Engine(model_dir, engine_cfg)
        try:
            held["shards"] = s = start_shards(eng, owners, cpus=args.shard_cpus or 1,
                                              deadline_s=args.shard_deadline_ms / 1000,
                                              timeout_s=args.shard_timeout)
        except BaseException:
            eng.close()
            raise
        nodes = len({x.node for x in s.shards})
        print(f"colibri: expert shards: {len(s.shards)} shard actors on {nodes} nodes "
              f"({len(owners)} MoE layers); this process runs the rest", file=sys.stderr)
        return eng

    def backend(eng, book, routing_stats):
        return ShardBackend(eng, book, routing_stats, shards=held["shards"])
    try:
        return run_server(engine, settings, backend=backend)
    finally:
        if "shards" in held:
            held["shards"].close()
