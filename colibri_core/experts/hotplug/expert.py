"""HotExpert: one adopted hot-plugged expert, as the engine sees it; ExpertChange.

Everything an expert needs is made on the manager's worker thread (`LoadedExpert`): the
staged file mapped read-only, the zero-copy views (router row, INT4 weights), the library
loaded with dlopen(RTLD_NOW) for an in-process expert or its helper started for an isolated
one, and the HotExpert itself (`materialize`). drain(), on the engine thread, only adopts it.

Shape legend: N = tokens, H = hidden size, I = intermediate size, Hp/Ip padded to G.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from cffi import FFI

from ...format.quant import Q4Tensor, padded_cols
from .errors import ExpertCrashed, ExpertForwardError, ExpertProbeError, ExpertReleased
from .isolated import IsolatedRunner
from .meta import ExpertFileInfo
from .stagedmap import StagedMapping
from .state import VersionRecord

INPROCESS, ISOLATED = "inprocess", "isolated"
ISOLATION_MODES = (INPROCESS, ISOLATED)

_ffi = FFI()
_LOST_LIBRARIES: list = []       # libraries whose staged copy was truncated: never closed
_ffi.cdef("int ffn_forward(const float *x, float *y, int n_tokens, int hidden);")


def _forget_library(lib, cache) -> None:
    """cffi's FFI.dlopen() keeps every library object it returned in FFI._libraries and
    FFI._function_caches, also after dlclose(): about 6 KiB per load, forever (found by
    benchmarks/robustness/soak.py). Drop a closed library from both lists. Best effort: should cffi
    change these internals, nothing is removed and nothing breaks."""
    with _ffi._lock:
        for attr, obj in (("_libraries", lib), ("_function_caches", cache)):
            lst = getattr(_ffi, attr, None)
            if isinstance(lst, list):
                lst[:] = [x for x in lst if x is not obj]


@dataclass(frozen=True)
class Q4Weights:
    """The expert's own INT4 weights (views into the staged file: no copies)."""

    w1: Q4Tensor   # gate [I, H]
    w3: Q4Tensor   # up   [I, H]
    w2: Q4Tensor   # down [H, I]

    @property
    def intermediate_size(self) -> int:
        return self.w1.rows

    @property
    def group_size(self) -> int:
        return self.w1.group


@dataclass(eq=False)
class HotExpert:
    """An adopted expert. `forward` is its ffn_forward; `q4` (when present) its weights.

    Identity is the object itself: a replaced expert is a new HotExpert with the same slot.
    """

    slot: int                        # stable index, >= the model's num_experts
    name: str
    version: str
    sha256: str
    source_path: str                 # the file in the watched folder
    staged_path: str                 # the private copy that is actually loaded
    layers: tuple[int, ...]          # global layer indices it is routable in
    router_row: np.ndarray           # float32 [H], read-only view
    router_bias: float
    q4: Q4Weights | None
    thread_safe: bool
    isolation: str                   # "inprocess" | "isolated"
    hidden_size: int
    target: str                      # compiler + flags recorded by the builder
    lib: object | None               # cffi lib (in-process), kept alive until release()
    status: str = "active"           # active | replaced | removed | crashed | released
    base_model: str = ""             # fingerprint of the model it was built for ("": none)
    binding: str = "unbound"         # bound | portable | unbound (meta.ExpertMeta.binding)
    _runner: IsolatedRunner | None = field(default=None, repr=False)
    _lock: threading.Lock | None = field(default=None, repr=False)
    _fn: object = field(default=None, repr=False)
    _mm: StagedMapping | None = field(default=None, repr=False)

    # -- the call
    def forward(self, x: np.ndarray, out: np.ndarray) -> None:
        """out[N, H] = ffn_forward(x[N, H]); float32, C-contiguous; out is overwritten.

        Raises ExpertForwardError (nonzero return, bad arrays), ExpertCrashed (isolated helper
        died: the expert is disabled), ExpertReleased (after manager.release()).
        """
        h = self.hidden_size
        if (x.dtype != np.float32 or out.dtype != np.float32 or x.ndim != 2
                or x.shape[1] != h or out.shape != x.shape or not x.flags.c_contiguous
                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ExpertForwardError(
                f"expert {self.name}: forward expects x and out float32 C-contiguous"
                f" [N, {h}] of the same shape (out writable), got x {x.dtype}{x.shape}"
                f" out {out.dtype}{out.shape}")
        n = x.shape[0]
        if n == 0:
            return
        if self.status == "released":
            raise ExpertReleased(f"expert {self.name} {self.version}: forward() after"
                                 " release()")
        if self._mm is not None and self._mm.damaged:
            self.status = "crashed"
            raise ExpertCrashed(f"expert {self.name} {self.version} (slot {self.slot}): "
                                f"{self.dead_reason}; the expert is disabled",
                                path=self.staged_path)
        if self._runner is not None:
            with self._lock:
                if self.status == "released":
                    raise ExpertReleased(f"expert {self.name} {self.version}: forward()"
                                         " after release()")
                try:
                    rc = self._runner.forward(x, out)
                except ExpertCrashed as e:
                    self.status = "crashed"
                    raise ExpertCrashed(
                        f"expert {self.name} {self.version} (slot {self.slot}): isolated"
                        f" helper died ({self._runner.dead_reason}); the expert is disabled",
                        path=self.staged_path) from e
        else:
            px = _ffi.from_buffer("float[]", x)
            py = _ffi.from_buffer("float[]", out, require_writable=True)
            if self._lock is None:
                rc = self._fn(px, py, n, h)
            else:
                with self._lock:
                    rc = self._fn(px, py, n, h)
        if rc != 0:
            raise ExpertForwardError(f"expert {self.name} {self.version}: ffn_forward"
                                     f" returned {rc} (n_tokens={n}), expected 0")

    @property
    def alive(self) -> bool:
        """False once an isolated helper died (checked without blocking)."""
        if self.status == "crashed":
            return False
        if (self._runner is not None and not self._runner.alive()) or \
                (self._mm is not None and self._mm.damaged):
            self.status = "crashed"
            return False
        return True

    @property
    def dead_reason(self) -> str:
        if self._mm is not None and self._mm.damaged:
            return f"its staged copy {self.staged_path} was truncated while mapped"
        return "isolated helper " + ((self._runner.dead_reason if self._runner else "") or "died")

    @property
    def helper_pid(self) -> int | None:
        return self._runner.pid if self._runner is not None else None

    def _release(self) -> None:
        """Unload (dlclose) or stop the helper; waits for a call in flight when serialized."""
        if self._lock is not None:
            with self._lock:
                self._release_locked()
        else:
            self._release_locked()

    def _release_locked(self) -> None:
        if self.status == "released":
            return
        self.status = "released"
        if self._runner is not None:
            self._runner.close()
        elif self._mm is not None and self._mm.damaged and self.lib is not None:
            # its code pages are lost too: dlclose (also cffi's, when the library object
            # is collected) would run its finalizers from them, a SIGBUS. Kept, never called.
            _LOST_LIBRARIES.append(self.lib)
        elif self.lib is not None:
            cache = self.lib.__dict__
            _ffi.dlclose(self.lib)
            _forget_library(self.lib, cache)
        self.lib = self._fn = None


@dataclass(frozen=True, eq=False)
class ExpertChange:
    """One change for the engine to apply between two tokens.

    add:     `expert` is new (a new slot or a returning name's slot), `previous` None.
    replace: `expert` takes over `previous`'s slot; release(previous) once unused.
    remove:  `expert` leaves its slot (file deleted, or its helper crashed); `previous` None;
             release(expert) once unused.
    """

    kind: Literal["add", "replace", "remove"]
    expert: HotExpert
    previous: HotExpert | None = None
    version: int = 0             # manager.version after this change
    reason: str = ""             # for remove: "deleted" | "crashed"; for replace: "rollback"...


class LoadedExpert:
    """A checked, staged and probed expert, mapped and loaded, ready to be adopted by drain().

    Made on the worker thread (or by rollback()): maps the staged file and builds its views;
    loads it with dlopen(RTLD_NOW | RTLD_LOCAL) (in-process; a failure is an
    ExpertProbeError with reason "dlopen") or starts its helper (isolated). materialize()
    then makes the HotExpert, once.
    """

    def __init__(self, info: ExpertFileInfo, sha256: str, staged: str, source: str,
                 isolation: str, *, call_timeout_s: float, capacity: int):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation {isolation!r}, expected one of {ISOLATION_MODES}")
        self.info, self.sha256, self.staged, self.source = info, sha256, staged, source
        self.isolation = isolation
        meta = info.meta
        # the router row (and the q4 weights) live in the staged .so, or for a bundle in
        # its staged router_row.npy (bundle.py; a bundle has no q4 weights)
        self._mm = StagedMapping(info.router_file or staged)      # under the SIGBUS guard
        self.router_row = self._mm.view("<f4", meta.hidden_size, info.router_row.offset)
        self.q4 = None
        if info.q4 is not None:
            h, i, g = meta.hidden_size, meta.intermediate_size, meta.group_size
            self.q4 = Q4Weights(*(self._q4(m, rows, cols, g) for m, rows, cols in
                                  (("w1", i, h), ("w3", i, h), ("w2", h, i))))
        self.runner = None
        self.lib = self._fn = None
        self.expert: HotExpert | None = None
        self.record = VersionRecord(sha256, staged, source, meta.version, isolation,
                                    tuple(meta.layers), meta.binding)   # for the state file
        if isolation == ISOLATED:
            self.runner = IsolatedRunner(staged, meta.hidden_size, capacity=capacity,
                                         call_timeout_s=call_timeout_s)
        else:
            try:
                self.lib = _ffi.dlopen(staged, _ffi.RTLD_NOW | _ffi.RTLD_LOCAL)
                self._fn = self.lib.ffn_forward
            except (OSError, AttributeError) as e:
                self.discard()
                raise ExpertProbeError(f"{staged}: dlopen failed: {e}", reason="dlopen",
                                       path=staged) from None

    def _q4(self, m: str, rows: int, cols: int, group: int) -> Q4Tensor:
        parts = self.info.q4
        ng = padded_cols(cols, group) // group

        def view(part: str, dtype: str, shape: tuple[int, int]) -> np.ndarray:
            p = parts[f"{m}.{part}"]
            return self._mm.view(dtype, p.nbytes // np.dtype(dtype).itemsize,
                                 p.offset).reshape(shape)
        return Q4Tensor(view("data", "u1", (rows, padded_cols(cols, group) // 2)),
                        view("scales", "<f4", (rows, ng)), view("zeros", "u1", (rows, ng)),
                        rows, cols, group)

    @property
    def name(self) -> str:
        return self.info.meta.name

    def materialize(self, slot: int) -> HotExpert:
        """The HotExpert in `slot` (made once; the library is already loaded)."""
        if self.expert is not None:
            if self.expert.slot != slot:
                raise ValueError(f"expert {self.name} was made for slot {self.expert.slot},"
                                 f" not {slot}")
            return self.expert
        meta = self.info.meta
        lock = None if (meta.thread_safe and self.runner is None) else threading.Lock()
        self.expert = HotExpert(
            slot=slot, name=meta.name, version=meta.version, sha256=self.sha256,
            source_path=self.source, staged_path=self.staged, layers=meta.layers,
            router_row=self.router_row, router_bias=meta.router_bias, q4=self.q4,
            thread_safe=meta.thread_safe, isolation=self.isolation,
            hidden_size=meta.hidden_size, target=meta.target, lib=self.lib,
            base_model=meta.base_model, binding=meta.binding, _runner=self.runner, _lock=lock, _fn=self._fn, _mm=self._mm)
        return self.expert

    def discard(self) -> None:
        """Never adopted: unload its library or stop its helper."""
        if self.expert is not None:
            self.expert._release()
        elif self.runner is not None:
            self.runner.close()
        elif self.lib is not None:
            cache = self.lib.__dict__
            _ffi.dlclose(self.lib)
            _forget_library(self.lib, cache)
        self.runner = self.lib = self._fn = self.expert = None
