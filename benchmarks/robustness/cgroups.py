"""A child cgroup for one benchmark process: a memory limit (swap 0), optionally a read
rate limit on one block device, and what the kernel says after the run.

    cg = Cgroup.create("colibri-256", memory=256 << 20, read_bps=100e6, device=(254, 0))
    subprocess.run(cmd, preexec_fn=cg.enter)      # the child joins before it execs
    print(cg.result())                            # peak, limit hits, OOM kills, memory.stat
    cg.close()                                    # the cgroup is removed (retried while busy)

cgroup v2 (the unified hierarchy with the memory controller): memory.max, memory.swap.max
= 0, memory.peak, memory.events (max, oom_kill), io.max "MAJ:MIN rbps=N". cgroup v1
(`/sys/fs/cgroup/memory`, `/sys/fs/cgroup/blkio`): memory.limit_in_bytes and
memory.memsw.limit_in_bytes equal to it (swap 0; absent without swap accounting),
memory.max_usage_in_bytes, memory.failcnt, memory.oom_control's oom_kill, and
blkio.throttle.read_bps_device. The child cgroup is made under this process's own cgroup
of each hierarchy, so a limit set above it still applies. `why` says what could not be set.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")


def own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" for v2's unified entry)."""
    out = {}
    try:
        for line in open("/proc/self/cgroup"):
            _, ctrls, path = line.strip().split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    except OSError:
        pass
    return out


def device_of(path) -> tuple[int, int]:
    """(major, minor) of the block device holding `path` (its file system's st_dev)."""
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def _write(p: Path, text: str) -> Optional[str]:
    try:
        p.write_text(text)
        return None
    except OSError as e:
        return f"{p.name}: {e.strerror}"


def _read_int(p: Path) -> Optional[int]:
    try:
        return int(p.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _kv(p: Path) -> dict[str, int]:
    out = {}
    try:
        for line in p.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


class Cgroup:
    def __init__(self):
        self.kind: Optional[str] = None     # "v1" | "v2"
        self.dirs: list[Path] = []          # the folders made (v1: memory, then blkio)
        self.memory_dir: Optional[Path] = None
        self.io_dir: Optional[Path] = None
        self.memory = 0
        self.read_bps: Optional[int] = None
        self.device: Optional[tuple[int, int]] = None
        self.why: list[str] = []

    @classmethod
    def create(cls, name: str, memory: int, read_bps: Optional[float] = None,
               device: Optional[tuple[int, int]] = None) -> "Cgroup":
        cg = cls()
        cg.memory = int(memory)
        cg.device = device
        own = own_cgroups()
        v2 = ROOT / own.get("", "/").lstrip("/")
        if (ROOT / "cgroup.controllers").exists() and "memory" in _controllers(v2):
            cg._make_v2(v2 / name, read_bps)
        elif (ROOT / "memory").is_dir():
            cg._make_v1(name, own, read_bps)
        else:
            cg.why.append("no memory cgroup (neither v2 with the memory controller nor v1)")
        return cg

    # --- v2
    def _make_v2(self, path: Path, read_bps) -> None:
        if not self._mkdir(path):
            return
        self.kind, self.memory_dir, self.io_dir = "v2", path, path
        err = _write(path / "memory.max", str(self.memory))
        if err:
            self.why.append(err)
            self.memory_dir = None
        if (path / "memory.swap.max").exists():
            err = _write(path / "memory.swap.max", "0")
            if err:
                self.why.append(err)
        if read_bps:
            self._set_io(path / "io.max", f"{self.device[0]}:{self.device[1]} rbps={int(read_bps)}",
                         read_bps)

    # --- v1
    def _make_v1(self, name: str, own: dict, read_bps) -> None:
        mem = ROOT / "memory" / own.get("memory", "/").lstrip("/") / name
        if not self._mkdir(mem):
            return
        self.kind, self.memory_dir = "v1", mem
        err = _write(mem / "memory.limit_in_bytes", str(self.memory))
        if err:
            self.why.append(err)
        if (mem / "memory.memsw.limit_in_bytes").exists():
            err = _write(mem / "memory.memsw.limit_in_bytes", str(self.memory))
            if err:
                self.why.append(err)
        else:
            self.why.append("memory.memsw.limit_in_bytes absent (no swap accounting)")
        if read_bps:
            blk = ROOT / "blkio" / own.get("blkio", "/").lstrip("/") / name
            if not (ROOT / "blkio").is_dir():
                self.why.append("no blkio hierarchy: read rate not limited")
            elif self._mkdir(blk):
                self.io_dir = blk
                self._set_io(blk / "blkio.throttle.read_bps_device",
                             f"{self.device[0]}:{self.device[1]} {int(read_bps)}", read_bps)

    def _set_io(self, knob: Path, text: str, read_bps) -> None:
        if self.device is None:
            self.why.append("read rate: no device given")
            return
        err = _write(knob, text)
        if err:
            self.why.append(f"read rate not limited ({err})")
        else:
            self.read_bps = int(read_bps)

    def _mkdir(self, path: Path) -> bool:
        try:
            if path.exists():                      # left over from a killed run: reuse
                self.dirs.append(path)
                return True
            path.mkdir()
            self.dirs.append(path)
            return True
        except OSError as e:
            self.why.append(f"mkdir {path}: {e.strerror}")
            return False

    # --- use
    def enter(self) -> None:
        """Move the calling process into the cgroup (a subprocess's preexec_fn)."""
        pid = str(os.getpid())
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write(pid)

    def oom_kills(self) -> Optional[int]:
        d = self.memory_dir
        if d is None:
            return None
        if self.kind == "v1":
            return _kv(d / "memory.oom_control").get("oom_kill")
        return _kv(d / "memory.events").get("oom_kill")

    def result(self) -> dict:
        """The cgroup's figures now (bytes): limit, peak, limit hits, OOM kills, memory.stat
        (page cache, RSS, mapped files), the read limit."""
        d = self.memory_dir
        if d is None:
            return {"cgroup": None, "cgroup_why": "; ".join(self.why)}
        r = {"cgroup": self.kind, "cgroup_path": str(d), "memory_limit": self.memory,
             "read_bps_limit": self.read_bps, "cgroup_why": "; ".join(self.why),
             "oom_kill": self.oom_kills()}
        if self.kind == "v1":
            r["memory_peak"] = _read_int(d / "memory.max_usage_in_bytes")
            r["memsw_peak"] = _read_int(d / "memory.memsw.max_usage_in_bytes")
            r["limit_hits"] = _read_int(d / "memory.failcnt")
        else:
            r["memory_peak"] = _read_int(d / "memory.peak")
            r["limit_hits"] = _kv(d / "memory.events").get("max")
        st = _kv(d / "memory.stat")
        r["memory_stat"] = {k: st[k] for k in ("cache", "rss", "mapped_file", "file", "anon",
                                               "file_mapped", "pgmajfault", "total_pgmajfault")
                            if k in st}
        return r

    def close(self) -> None:
        """Remove the cgroup folders (their processes have exited; retried while the
        kernel still counts them)."""
        for d in reversed(self.dirs):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.dirs = []


def _controllers(path: Path) -> list[str]:
    try:
        return (path / "cgroup.controllers").read_text().split()
    except OSError:
        return []
