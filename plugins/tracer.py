"""Debug trace lines (DESIGN.md contract 7), written with a raw ``os.write``.

    [ROUTING] layer=0, top_k=[3,5], scores=[0.721,0.689]
    [MEMORY] expert_0_3 @ 0x7f8a3c000000 (size=1245184)
    [TIME] expert_0_3 FFN: 124832 cycles (≈39.2us @ 3.18GHz)

Three kinds, each switched on separately; a kind that is off registers no hook
implementation, so the engine's HookRelay sees no listener and pays nothing:

    routing  one line per token per MoE layer, from colibri_routing
    memory   one line per prefetched expert, from colibri_expert_prefetch
    timing   one line per expert FFN call, from colibri_expert_timing

    pm.register(Tracer(kinds={"routing", "timing"}, fd=2))
    pm.register(Tracer.from_spec("routing,memory", path="trace.log"))   # --debug
    COLIBRI_DEBUG=routing,timing COLIBRI_DEBUG_FD=3 colibri ...          # from_env

Lines of one hook call are joined and written with one ``os.write`` (no Python
buffering), so lines from different threads never interleave inside a line.
"""
from __future__ import annotations

import os
import time
import types
import warnings
from typing import Callable, Iterable, Mapping

import numpy as np

from colibri_core.errors import ConfigError
from colibri_core.hookspecs import hookimpl
from colibri_core.format.modelfile import expert_name

KINDS = ("routing", "memory", "timing")
_ENV_KINDS = "COLIBRI_DEBUG"
_ENV_FD = "COLIBRI_DEBUG_FD"
_ENV_FILE = "COLIBRI_DEBUG_FILE"


def perf_counter_cycles() -> int:
    """Fallback cycle counter: nanoseconds of ``time.perf_counter_ns`` (a 1 GHz 'clock')."""
    return time.perf_counter_ns()


def default_cycle_counter() -> Callable[[], int]:
    """The counter the engine times experts with: the C ``kernels.rdtsc`` when the
    compiled kernels import, else :func:`perf_counter_cycles`."""
    try:
        from colibri_core.kernels import rdtsc
    except Exception:  # kernels not built: the engine cannot time experts either
        return perf_counter_cycles
    return rdtsc


def measure_frequency(cycle_counter: Callable[[], int], seconds: float = 0.02) -> float:
    """Ticks per second of ``cycle_counter``, measured against time.perf_counter over
    about ``seconds`` (busy wait, so the core does not sleep while it is measured)."""
    t0, c0 = time.perf_counter(), cycle_counter()
    while (t1 := time.perf_counter()) - t0 < seconds:
        pass
    c1 = cycle_counter()
    return (c1 - c0) / (t1 - t0)


class Tracer:
    """Writes the reference trace lines for the enabled ``kinds`` to ``fd`` or ``path``.

    Arguments:
        kinds: any of "routing", "memory", "timing".
        fd: file descriptor to write to (default 2, stderr); not closed by the tracer.
        path: file to append to instead of ``fd``; opened here, closed by ``close()``
            or at colibri_engine_stop.
        cycle_counter: callable returning the cycle counter the engine's ``cycles`` come
            from; default :func:`default_cycle_counter` (the C rdtsc, or
            ``time.perf_counter_ns`` without compiled kernels). Its frequency is
            measured once, here, when "timing" is enabled.
        freq_hz: skip the measurement and use this frequency.
    """

    def __init__(
        self,
        kinds: Iterable[str] = KINDS,
        fd: int | None = None,
        path: str | os.PathLike | None = None,
        cycle_counter: Callable[[], int] | None = None,
        freq_hz: float | None = None,
    ) -> None:
        self.kinds = frozenset(kinds)
        unknown = sorted(self.kinds - set(KINDS))
        if unknown:
            raise ConfigError(f"unknown trace kind {unknown[0]!r}: choose from {','.join(KINDS)}")
        if fd is not None and path is not None:
            raise ConfigError("Tracer: give fd or path, not both")
        self.path = None if path is None else os.fspath(path)
        self._owns_fd = path is not None
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if self._owns_fd else (2 if fd is None else fd)
        self.cycle_counter = cycle_counter
        self.freq_hz = freq_hz
        if "timing" in self.kinds and self.freq_hz is None:
            self.cycle_counter = self.cycle_counter or default_cycle_counter()
            self.freq_hz = measure_frequency(self.cycle_counter)
        # Bind only the enabled kinds' hook implementations (see _IMPLS below).
        for kind in sorted(self.kinds):
            setattr(self, _IMPLS[kind].__name__, types.MethodType(_IMPLS[kind], self))
        if self._owns_fd:
            self.colibri_engine_stop = types.MethodType(_engine_stop_impl, self)

    @classmethod
    def from_spec(
        cls,
        spec: str,
        path: str | os.PathLike | None = None,
        fd: int | None = None,
        **kwargs,
    ) -> Tracer:
        """Tracer for a ``--debug`` value such as "routing,memory" or "all"."""
        kinds = {k.strip().lower() for k in spec.split(",") if k.strip()}
        if "all" in kinds:
            kinds = (kinds - {"all"}) | set(KINDS)
        return cls(kinds=kinds, fd=fd, path=path, **kwargs)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs) -> Tracer | None:
        """Tracer from COLIBRI_DEBUG (kinds), COLIBRI_DEBUG_FD or COLIBRI_DEBUG_FILE;
        None when COLIBRI_DEBUG is unset or empty."""
        env = os.environ if environ is None else environ
        spec = env.get(_ENV_KINDS, "").strip()
        if not spec:
            return None
        fd_text, path = env.get(_ENV_FD, "").strip(), env.get(_ENV_FILE, "").strip() or None
        if fd_text and path:
            raise ConfigError(f"set {_ENV_FD} or {_ENV_FILE}, not both")
        try:
            fd = int(fd_text) if fd_text else None
        except ValueError:
            raise ConfigError(f"{_ENV_FD} must be a file descriptor number, got {fd_text!r}") from None
        return cls.from_spec(spec, path=path, fd=fd, **kwargs)

    # -- output ------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Write all of ``data`` with os.write; on an OS error, warn once and stop tracing."""
        if self.fd is None:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.fd = None
            warnings.warn(f"colibri tracer: writing trace lines failed ({exc}); tracing stopped", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Close the file opened for ``path`` (a caller's fd is left open)."""
        if self._owns_fd and self.fd is not None:
            os.close(self.fd)
        self.fd = None

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        target = self.path if self.path is not None else f"fd={self.fd}"
        return f"<Tracer kinds={','.join(sorted(self.kinds)) or '-'} {target}>"

    # -- line formats (plain methods: usable without pluggy) ----------------------------

    @staticmethod
    def routing_lines(layer: int, expert_ids: np.ndarray, scores: np.ndarray) -> str:
        ids = np.atleast_2d(expert_ids).tolist()
        vals = np.atleast_2d(np.asarray(scores, dtype=np.float64)).tolist()
        out = []
        for row_ids, row_scores in zip(ids, vals):
            pairs = [(e, s) for e, s in zip(row_ids, row_scores) if e >= 0]  # -1: unused slot
            top = ",".join(str(e) for e, _ in pairs)
            sc = ",".join(f"{s:.3f}" for _, s in pairs)
            out.append(f"[ROUTING] layer={layer}, top_k=[{top}], scores=[{sc}]\n")
        return "".join(out)

    @staticmethod
    def memory_lines(layer: int, experts: Iterable[tuple[int, int, int]]) -> str:
        return "".join(f"[MEMORY] {expert_name(layer, e)} @ {addr:#x} (size={size})\n"
                       for e, addr, size in experts)

    def time_line(self, layer: int, expert: int, cycles: int) -> str:
        freq = self.freq_hz
        return f"[TIME] {expert_name(layer, expert)} FFN: {cycles} cycles (≈{cycles / freq * 1e6:.1f}us @ {freq / 1e9:.2f}GHz)\n"


# Hook implementations, bound onto a Tracer instance only for its enabled kinds. They
# are module-level functions (not Tracer methods) so that registering a Tracer with no
# kinds registers nothing; the names are the hook names.


@hookimpl
def colibri_routing(self: Tracer, layer, expert_ids, scores):
    self.write(Tracer.routing_lines(layer, expert_ids, scores).encode())


@hookimpl
def colibri_expert_prefetch(self: Tracer, layer, experts):
    self.write(Tracer.memory_lines(layer, experts).encode())


@hookimpl
def colibri_expert_timing(self: Tracer, layer, expert, cycles):
    self.write(self.time_line(layer, expert, cycles).encode())


@hookimpl
def colibri_engine_stop(self: Tracer):
    self.close()


_IMPLS = {"routing": colibri_routing, "memory": colibri_expert_prefetch, "timing": colibri_expert_timing}
_engine_stop_impl = colibri_engine_stop
# Keep this module from being a plugin itself: registering it would bind ``self``.
del colibri_routing, colibri_expert_prefetch, colibri_expert_timing, colibri_engine_stop


def make_plugin(**options) -> Tracer:
    """Built-in entry used by plugins.register_builtin_plugin (the engine's `debug` setting)."""
    return Tracer(**options)


def from_env(environ: Mapping[str, str] | None = None) -> Tracer | None:
    """Built-in entry used by build_plugin_manager: a Tracer when COLIBRI_DEBUG is set."""
    return Tracer.from_env(environ)
