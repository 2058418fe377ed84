"""Cost of hook call sites in the forward loop: pluggy called blindly vs HookRelay.

    python -m benchmarks.speed.bench_hooks [--layers 16,32,48] [--k 2,8]

Measures, in ns per call site:
  pluggy, no plugin     pm.hook.colibri_routing(...) with nothing registered
  pluggy, 1 empty impl  the same with one plugin whose impl does nothing (called
                        through the PluginGuard's closure, as in the engine)
  relay, no plugin      `if relay.routing is not None: ...` (what the engine does)
  relay, 1 empty impl   the test plus the call
  relay, 1 impl, timed  the same with plugin_slow_ms set (two perf_counter calls)
  override + check      a plugin returning (ids, weights), checked by
                        PluginGuard.check_routing as both forward paths do
then multiplies by the call sites per generated token of an L-layer MoE model:
per layer before_layer, choose_k_token, routing, expert_prefetch, k x expert_timing,
after_layer; per token sample and token.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from colibri_core.hookspecs import hookimpl
from colibri_core.plugins import HookRelay, build_plugin_manager

IDS = np.zeros((1, 2), np.int64)
W = np.zeros((1, 2), np.float32)
Z = np.zeros((1, 8), np.float32)


class Empty:
    @hookimpl
    def colibri_routing(self, layer):
        return None


class Override:
    @hookimpl
    def colibri_routing(self, expert_ids, weights):
        return expert_ids, weights


def ns_per_call(stmt, env, repeat=7, number=200_000) -> float:
    times = timeit.repeat(stmt, globals=env, repeat=repeat, number=number)
    return statistics.median(times) / number * 1e9


def measure() -> dict[str, float]:
    bare = build_plugin_manager(load_entrypoints=False, builtins=(), environ={})
    busy = build_plugin_manager(load_entrypoints=False, builtins=(Empty(),), environ={})
    timed = build_plugin_manager(load_entrypoints=False, builtins=(Empty(),), environ={})
    over = build_plugin_manager(load_entrypoints=False, builtins=(Override(),), environ={})
    env = dict(
        bare_hook=bare.hook.colibri_routing, busy_hook=busy.hook.colibri_routing,
        bare_relay=HookRelay(bare), busy_relay=HookRelay(busy), timed_relay=HookRelay(timed),
        over_relay=HookRelay(over), EXPERTS=(object(),) * Z.shape[1], IDS=IDS, W=W, Z=Z,
    )
    timed.guard.configure(slow_ms=1000.0)
    call = "(layer=0, expert_ids=IDS, weights=W, scores=W, logits=Z)"
    check = "over_relay.guard.check_routing(got, 0, 1, 2, EXPERTS, 8)"
    return {
        "loop overhead (pass)": ns_per_call("pass", env),
        "pluggy, no plugin": ns_per_call("bare_hook" + call, env),
        "pluggy, 1 empty impl": ns_per_call("busy_hook" + call, env),
        "relay, no plugin": ns_per_call(f"if bare_relay.routing is not None: bare_relay.routing{call}", env),
        "relay, 1 empty impl": ns_per_call(f"if busy_relay.routing is not None: busy_relay.routing{call}", env),
        "relay, 1 impl, timed": ns_per_call(f"if timed_relay.routing is not None: timed_relay.routing{call}", env),
        "override + check": ns_per_call(f"got = over_relay.routing{call}\nif got is not None: {check}",
                                        env, number=50_000),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="16,24,32,48")
    parser.add_argument("--k", default="2,8")
    args = parser.parse_args(argv)
    ns = measure()
    print(f"{'call site':<24}{'ns/call':>10}")
    for name, value in ns.items():
        print(f"{name:<24}{value:>10.1f}")
    print()
    print(f"{'L':>4}{'k':>4}{'sites/token':>13}{'pluggy none us':>16}{'relay none us':>15}{'relay 1impl us':>16}")
    for layers in map(int, args.layers.split(",")):
        for k in map(int, args.k.split(",")):
            sites = layers * (5 + k) + 2
            print(f"{layers:>4}{k:>4}{sites:>13}{sites * ns['pluggy, no plugin'] / 1e3:>16.1f}"
                  f"{sites * ns['relay, no plugin'] / 1e3:>15.2f}{sites * ns['relay, 1 empty impl'] / 1e3:>16.1f}")


if __name__ == "__main__":
    main()
