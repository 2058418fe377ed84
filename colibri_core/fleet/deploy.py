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
"""
from __future__ import annotations

import dataclasses
import os
import signal
import site
import sys
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
RAY_HINT = "the fleet needs Ray Serve: pip install 'colibri[ray]' (ray[serve], the " \
           "version pyproject.toml pins)"


def runtime_env() -> dict:
    root = str(Path(__file__).resolve().parent.parent.parent)     # holds colibri_core/
    if root in site.getsitepackages() or root == site.getusersitepackages():
        return {}
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([root, *rest])}}


def parse_autoscale(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1 <= int(lo) <= int(hi):
        raise ConfigError(f"--autoscale {text!r}: expected MIN:MAX with 1 <= MIN <= MAX "
                          f"(e.g. 1:4)")
    return int(lo), int(hi)


def build_app(model_dir, engine_cfg, settings, *, replicas: int = 1,
              autoscale: Optional[tuple[int, int]] = None, cpus: Optional[int] = None):
    """The Serve application (Deployment.bind()): ingress -> engine replicas."""
    from ray import serve
    cpus = int(cpus or engine_cfg.threads)
    env = runtime_env()
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
                        str(model_dir), dataclasses.asdict(settings))


def deploy(model_dir, engine_cfg=None, settings=None, *, replicas: int = 1,
           autoscale: Optional[tuple[int, int]] = None, cpus: Optional[int] = None,
           address: Optional[str] = None, registry_dir: Optional[str] = None,
           host: Optional[str] = None, port: Optional[int] = None) -> str:
    """Join (or start) the cluster, start the registry, run the application; returns the
    URL once every engine replica is ready. `engine_cfg` (EngineConfig: its experts_dir
    is the head's watched folder) and `settings` (server/app.py's Settings) default to
    `colibri serve`'s defaults."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(RAY_HINT) from None
    from ..config import EngineConfig
    from ..server.app import Settings
    engine_cfg = engine_cfg or EngineConfig()
    settings = settings or Settings()
    if host is not None or port is not None:
        settings = dataclasses.replace(settings, host=host or settings.host,
                                       port=settings.port if port is None else port)
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas}: expected at least 1")
    experts_dir = engine_cfg.experts_dir
    state = registry_dir or os.path.join(experts_dir or ".", ".colibri-registry")
    env = runtime_env()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env or None,
                 log_to_driver=False)
    start_registry(Path(model_dir).resolve(), experts_dir and os.path.abspath(experts_dir),
                   os.path.abspath(state), runtime_env=env)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(Path(model_dir).resolve(), engine_cfg, settings, replicas=replicas,
                        autoscale=autoscale, cpus=cpus), name=APP, route_prefix="/")
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
    cpus = args.replica_cpus or engine_cfg.threads
    url = deploy(model_dir, engine_cfg, settings, replicas=args.replicas,
                 autoscale=autoscale, cpus=cpus, address=args.ray_address,
                 registry_dir=args.registry_dir)
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
