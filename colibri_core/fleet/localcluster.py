"""A multi-node Ray cluster on one machine (Ray's own test cluster, ray.cluster_utils):
the expert shards' tests and benchmarks (issue 40), and a way to try
`colibri serve --ray --expert-shards N` without a second machine.

A head and `nodes` worker nodes, each with `cpus` CPUs, an object store of
`object_store_mb` and the loopback address; worker i has the custom resource
"shard<i>" (to pin shard i there). Ray's workers import this checkout first
(PYTHONPATH). A process that joins it (ray.init(address=...)) needs
LOOPBACK_ENV in its environment, else Ray swaps 127.0.0.1 for the machine's own
address, which the nodes do not listen on.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent.parent)     # holds colibri_core/
# ray_constants.ENABLE_RAY_CLUSTER off: ray.init keeps the loopback address
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def worker_env() -> dict:
    """This process's environment for the nodes and for a process that joins them."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and p != ROOT]
    return {**os.environ, **LOOPBACK_ENV, "PYTHONPATH": os.pathsep.join(path),
            "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0")}


@contextlib.contextmanager
def local_cluster(nodes: int = 2, cpus: int = 1, object_store_mb: int = 200,
                  connect: bool = True):
    """Yields the cluster (its .address); connected (ray.init) unless `connect` is
    False; shut down at exit (the driver first), this process's environment as it was."""
    keys = ("PYTHONPATH", "RAY_worker_niceness", *LOOPBACK_ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: v for k, v in worker_env().items() if k in keys})
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster
    was, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    node = dict(num_cpus=cpus, object_store_memory=object_store_mb * 2**20,
                node_ip_address="127.0.0.1", include_dashboard=False)
    c = Cluster(initialize_head=True, head_node_args=node)
    try:
        for i in range(nodes):
            c.add_node(**node, resources={f"shard{i}": 1})
        if connect:
            ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        try:
            ray.shutdown()
        finally:
            c.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = was
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
