"""A real local Ray cluster for the fleet tests (tests/test_fleet_ray.py): `ray start
--head` on 127.0.0.1 with free ports (Serve's HAProxy's too: RayCluster.env), 2 CPUs, no dashboard, no usage stats, a small
object store, in a temp dir of its own; stopped by killing the processes it started
(the head's processes and their descendants, by pid: another cluster on the machine is
left alone; CI's `.ci/run` adds `ray stop --force` at teardown)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OBJECT_STORE_BYTES = 150 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """The raylet's environment, which its workers inherit: this checkout first; workers
    at the niceness of everything else (Ray's default, 15, starves the replicas beside
    other work on a shared machine)."""
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_worker_niceness": "0"}


def haproxy_env(temp: str) -> dict:
    """Serve's HAProxy (colibri serve --ray's default data path) for one cluster: its
    stats and metrics on free ports (Ray's defaults, 8404 and 9101, are one per machine:
    two clusters, or a test beside a benchmark, would collide) and its files in the
    cluster's temp dir (its command line then names the dir, so stop() ends it too)."""
    d = os.path.join(temp, "haproxy")
    return {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(d, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(d, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": d,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(d, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(d, "metrics.sock")}


class RayCluster:
    def __init__(self, cpus: int = 2):
        self.temp = tempfile.mkdtemp(prefix="cray", dir="/tmp")   # short: socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # for `ray start` and for the process that deploys (deploy.py passes RAY_SERVE_*
        # on to Serve's controller and replicas)
        self.env = {**worker_env(), **haproxy_env(self.temp)}
        cmd = ["ray", "start", "--head", "--node-ip-address", "127.0.0.1",
               "--port", str(self.port), "--num-cpus", str(cpus),
               "--include-dashboard=false", "--disable-usage-stats",
               "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", self.temp,
               "--ray-client-server-port", str(free_port()),
               "--dashboard-agent-listen-port", str(free_port()),
               "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()),
               "--metrics-export-port", str(free_port())]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")

    def _pids(self) -> list[int]:
        """This cluster's processes: those naming its temp dir, and their descendants."""
        parents: dict[int, int] = {}
        roots = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ")
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            if self.temp.encode() in cmd:
                roots.append(int(d))
        out, todo = set(), list(roots)
        while todo:
            p = todo.pop()
            if p in out:
                continue
            out.add(p)
            todo += [c for c, pp in parents.items() if pp == p]
        out.discard(os.getpid())
        return sorted(out)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of this cluster's live processes, summed by
        what each is: a Ray worker by its actor ("ray::ServeReplica:colibri:colibri-
        ingress", "ray::ServeController"; the method it runs left out), another process
        by its program ("haproxy", "raylet")."""
        out: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for pid in self._pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            head = argv[0].decode(errors="replace")
            if head.startswith("ray::"):
                name = head.split(" ")[0].split(".")[0]
            elif os.path.basename(head).startswith("python"):
                args = [a.decode(errors="replace") for a in argv[1:] if a]
                rest = [a for a in args if not a.startswith("-")]
                name = os.path.basename(rest[0]) if rest else "python"
            else:
                name = os.path.basename(head)
            out[name] = out.get(name, 0.0) + (int(stat[11]) + int(stat[12])) / tick
        return out

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self._pids()
            for p in pids:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _alive(p)]
                time.sleep(0.1)
            if not pids:
                break
        shutil.rmtree(self.temp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
