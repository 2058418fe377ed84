"""`colibri serve --ray`: engine replicas as a Ray Serve deployment, one expert registry.

    fleetset.py    the fleet's expert set on the head's disk: slots, versions, generation
    registry.py    the registry actor: the head's watched folder, uploads, rollbacks ->
                   changes; replicas' long polls and reports; rollouts
    replica.py     an engine replica: LocalBackend + the sync thread writing the
                   registry's experts into its own watched folder
    ingress.py     RayBackend (server/backend.py's methods over Serve's handle) and the
                   ingress deployment: server/app.py's ASGI app, unchanged
    placement.py   CPUs per replica from the cluster found, the start-up line when not
                   all replicas fit, the ingress's /ready gate counting replicas
    deploy.py      build and run the application: the Python entry point and the CLI
    expertplan.py  expert parallelism (issue 40): which shard holds each routed expert
    expertshard.py   the step over expert shards, bit for bit one engine's
    shardactor.py    expert shards as Ray actors (faults: 503, Ray's restart, slow counts)
    shardchannel.py  a shard's socket: the per-layer data path (Unix socket or TCP)
    shardserve.py    `colibri serve --ray --expert-shards N`: this process the driver

Ray (`pip install 'colibri[ray]'`) is imported only by the functions that use it: without
it, nothing of Colibri changes. Design and arithmetic: docs/SCALE.md.
"""


def add_arguments(p) -> None:
    """`colibri serve`'s fleet options (server.add_arguments has the others)."""
    g = p.add_argument_group("fleet (Ray Serve; docs/SCALE.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: an ingress and engine replicas (needs "
                        "the ray extra: pip install 'colibri[ray]')")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1)")
    size.add_argument("--autoscale", metavar="MIN:MAX",
                      help="engine replicas between MIN and MAX, scaled on ongoing requests")
    g.add_argument("--replica-cpus", dest="replica_cpus", type=int, default=None,
                   help="CPUs each replica reserves, and its compute threads (default: "
                        "--threads, else the config's)")
    g.add_argument("--ray-address", dest="ray_address",
                   help="the cluster to join (default: the running local one, else a new "
                        "local one)")
    g.add_argument("--ray-proxy", dest="ray_proxy", choices=("haproxy", "serve"),
                   default="haproxy",
                   help="haproxy (default): Serve's throughput-optimized mode, HAProxy in "
                        "front of an ingress that serves HTTP itself, gRPC to the "
                        "replicas; serve: Serve's Python HTTP proxy and actor calls "
                        "(docs/SCALE.md, \"The data path\")")
    sh = g.add_mutually_exclusive_group()
    sh.add_argument("--expert-shards", dest="expert_shards", type=int, metavar="N",
                    help="split the model's routed experts over N shard actors on the "
                         "cluster's nodes (a plan by bytes); this process serves and runs "
                         "the rest (docs/SCALE.md, \"A model larger than one machine\")")
    sh.add_argument("--expert-plan", dest="expert_plan", metavar="FILE",
                    help="like --expert-shards, with the plan `colibri experts place` wrote")
    g.add_argument("--shard-cpus", dest="shard_cpus", type=int, default=None,
                   help="CPUs each expert shard reserves, and its compute threads (default 1)")
    g.add_argument("--shard-deadline-ms", dest="shard_deadline_ms", type=float, default=1000.0,
                   help="a MoE layer's results later than this count as slow, per shard, "
                        "in /metrics (default 1000)")
    g.add_argument("--shard-timeout", dest="shard_timeout", type=float, default=60.0,
                   help="seconds after which a shard that has not answered fails the step "
                        "(503, as a shard that died; default 60)")
    g.add_argument("--registry-dir", dest="registry_dir",
                   help="the registry's state on the head (default: "
                        "<experts-dir>/.colibri-registry, else ./.colibri-registry)")


def main(args) -> int:
    if args.expert_shards is not None or args.expert_plan:
        from .shardserve import main as shard_main
        return shard_main(args)
    from .deploy import main as deploy_main
    return deploy_main(args)
