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
    shardactor.py    expert shards as Ray actors

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
    g.add_argument("--registry-dir", dest="registry_dir",
                   help="the registry's state on the head (default: "
                        "<experts-dir>/.colibri-registry, else ./.colibri-registry)")


def main(args) -> int:
    from .deploy import main as deploy_main
    return deploy_main(args)
