"""When a plugin gets it wrong: every hook implementation runs through a guard, and what
decision hooks return is checked here, in one place, before the engine uses it.

Two kinds of hooks (docs/PLUGINS.md, "When a plugin fails"):

  observer hooks   the engine ignores what they return (every hook that is not
                   firstresult: token, request_start/end, before/after_layer, expert_*,
                   engine_start/stop, ...). An exception is caught, logged once per
                   (plugin, hook) and counted; the call counts as "returned None" and the
                   request goes on.
  decision hooks   the engine uses what they return (the firstresult hooks: choose_k,
                   choose_k_token, routing, sample). An exception, or a value that the
                   ``check_<hook>`` method below refuses, fails the request with a
                   PluginError naming the plugin, the hook and the value; the engine
                   goes on and serves the next request.

A plugin that failed ``max_failures`` times (both kinds together, every hook) is
unregistered from its plugin manager: none of its hooks is called again. Hook calls
slower than ``slow_ms`` are logged once per (plugin, hook) and counted (not timed at all
while ``slow_ms`` is None). In strict mode (``EngineConfig.plugin_strict`` or
``COLIBRI_PLUGIN_STRICT=1``) a plugin's exception is re-raised as it is and no plugin is
disabled: for plugin authors' tests. ``report()`` (``Engine.plugin_failures()``) gives
the counts.

How: ``PluginGuard.watch(caller)`` replaces each implementation's function in pluggy's
HookImpl by a closure that calls it inside try/except (HookRelay.refresh does this for
every hook that has implementations), so pluggy's own calling order, firstresult and
hook wrappers are unchanged. Hook wrappers (``wrapper=True`` / ``hookwrapper=True``)
are left as they are: their errors propagate.
"""
from __future__ import annotations

import logging
import os
import reprlib
from time import perf_counter
from typing import Any, Mapping

import numpy as np

from .errors import PluginError

log = logging.getLogger("colibri")

STRICT_ENV = "COLIBRI_PLUGIN_STRICT"
DEFAULT_MAX_FAILURES = 3

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 40, 40, 40


def env_flag(environ: Mapping[str, str], name: str) -> bool:
    """A yes/no environment variable: unset, "", "0", "false", "no" mean no."""
    return environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def shown(value: Any) -> str:
    """A bounded repr for messages: small arrays in full, others as dtype and shape."""
    if isinstance(value, np.ndarray):
        if value.size <= 8:
            return f"array({value.tolist()!r}, {value.dtype})"
        return f"<{value.dtype} array {list(value.shape)}>"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ is the plugin's
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _array(value: Any):
    """np.asarray(value), or None when numpy cannot make an array of it (ragged lists)."""
    try:
        return np.asarray(value)
    except Exception:  # noqa: BLE001
        return None


class _Site:
    """One hook implementation of one plugin, as the guard calls it."""

    __slots__ = ("plugin", "name", "label", "hook", "decision", "code")

    def __init__(self, plugin, name: str, label: str, hook: str, decision: bool, code):
        self.plugin, self.name, self.label = plugin, name, label
        self.hook, self.decision, self.code = hook, decision, code


class PluginGuard:
    """The failure policy of one plugin manager (``plugins.plugin_guard(pm)``)."""

    def __init__(self, pm) -> None:
        self.pm = pm
        self.answered: _Site | None = None      # who gave the last decision hook's answer
        self._failures: dict[tuple[str, str], int] = {}   # (label, hook) -> failures
        self._slow: dict[tuple[str, str], int] = {}       # (label, hook) -> slow calls
        self._slowest: dict[tuple[str, str], float] = {}  # (label, hook) -> seconds
        self._per_plugin: dict[str, int] = {}             # registered name -> failures
        self._last_error: dict[str, str] = {}             # label -> last failure, one line
        self._disabled: set[str] = set()                  # labels
        self.configure()

    def configure(self, max_failures: int = DEFAULT_MAX_FAILURES, slow_ms: float | None = None,
                  strict: bool = False, environ: Mapping[str, str] | None = None) -> None:
        """Set the policy (the engine passes its EngineConfig's plugin_* settings).
        ``COLIBRI_PLUGIN_STRICT=1`` in ``environ`` (default os.environ) also turns strict on."""
        env = os.environ if environ is None else environ
        self.max_failures = int(max_failures)
        self.slow_s = None if slow_ms is None else float(slow_ms) / 1e3
        self.strict = bool(strict) or env_flag(env, STRICT_ENV)

    # ------------------------------------------------------------------ wrapping
    def watch(self, caller) -> None:
        """Call every implementation of pluggy HookCaller ``caller`` through the guard
        (implementations already guarded are left alone)."""
        decision = bool(caller.spec is not None and caller.spec.opts.get("firstresult"))
        for impl in caller.get_hookimpls():
            if impl.wrapper or impl.hookwrapper or hasattr(impl.function, "_colibri_site"):
                continue
            impl.function = self._guarded(impl, caller.name, decision)

    def _guarded(self, impl, hook: str, decision: bool):
        fn = impl.function
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        site = _Site(impl.plugin, impl.plugin_name, _label(impl), hook, decision, code)
        guard = self

        def guarded(*args):
            slow = guard.slow_s
            if slow is None:
                try:
                    result = fn(*args)
                except Exception as exc:
                    return guard._raised(site, exc)
            else:
                t0 = perf_counter()
                try:
                    result = fn(*args)
                except Exception as exc:
                    return guard._raised(site, exc)
                took = perf_counter() - t0
                if took > slow:
                    guard._slow_call(site, took)
            if decision and result is not None:
                guard.answered = site
            return result

        guarded.__wrapped__ = fn
        guarded._colibri_site = site
        return guarded

    # ------------------------------------------------------------------ failures
    def _raised(self, site: _Site, exc: Exception):
        """An implementation raised: count it; observers return None, decision hooks fail
        the request (strict mode: the plugin's own exception)."""
        what = f"plugin {site.label!r} failed in {site.hook}: {_one_line(exc)}{_where(exc, site.code)}"
        disabled = self._count(site, what)
        if self.strict:
            raise exc
        if site.decision:
            raise PluginError(what + disabled, plugin=site.label, hook=site.hook) from exc
        return None

    def _refused(self, hook: str, returned: str, expected: str) -> PluginError:
        """The error for a decision hook's unusable answer (counted like an exception)."""
        site = self.answered if self.answered is not None and self.answered.hook == hook else None
        self.answered = None
        label = site.label if site is not None else "(a hook wrapper)"
        what = f"plugin {label!r}: {hook} returned {returned}; expected {expected}"
        disabled = self._count(site, what) if site is not None else ""
        return PluginError(what + disabled, plugin=label, hook=hook)

    def _count(self, site: _Site, what: str) -> str:
        """Count a failure, log the first of each (plugin, hook), disable the plugin at
        max_failures. Returns "" or the sentence saying it was disabled."""
        key = (site.label, site.hook)
        n = self._failures[key] = self._failures.get(key, 0) + 1
        self._last_error[site.label] = what
        total = self._per_plugin[site.name] = self._per_plugin.get(site.name, 0) + 1
        if n == 1:
            log.warning("%s (logged once per plugin and hook; counted in "
                        "Engine.plugin_failures())", what)
        if self.strict or total < self.max_failures or not self.pm.is_registered(site.plugin):
            return ""
        self.pm.unregister(site.plugin)
        self._disabled.add(site.label)
        del self._per_plugin[site.name]           # registered again, it starts afresh
        log.warning("plugin %r disabled after %d failures (plugin_max_failures=%d): none of "
                    "its hooks is called again", site.label, total, self.max_failures)
        return (f"; the plugin is now disabled ({total} failure{'s' if total > 1 else ''}, "
                f"plugin_max_failures={self.max_failures})")

    def _slow_call(self, site: _Site, took: float) -> None:
        key = (site.label, site.hook)
        n = self._slow[key] = self._slow.get(key, 0) + 1
        if took > self._slowest.get(key, 0.0):
            self._slowest[key] = took
        if n == 1:
            log.warning("plugin %r: %s took %.1f ms (plugin_slow_ms=%g; logged once per "
                        "plugin and hook, counted in Engine.plugin_failures())",
                        site.label, site.hook, took * 1e3, self.slow_s * 1e3)

    def report(self) -> dict:
        """Per plugin that failed or was slow: ``{"failures": {hook: n}, "slow": {hook: n},
        "slowest_ms": {hook: ms}, "disabled": bool, "last_error": str | None}``."""
        out: dict[str, dict] = {}

        def entry(label: str) -> dict:
            return out.setdefault(label, {"failures": {}, "slow": {}, "slowest_ms": {},
                                          "disabled": label in self._disabled,
                                          "last_error": self._last_error.get(label)})
        for (label, hook), n in self._failures.items():
            entry(label)["failures"][hook] = n
        for (label, hook), n in self._slow.items():
            e = entry(label)
            e["slow"][hook] = n
            e["slowest_ms"][hook] = round(self._slowest[(label, hook)] * 1e3, 3)
        return out

    # ------------------------------------------------------------------ decision hooks' answers
    # Each check takes what the hook returned (not None) and what the call site knows, and
    # returns the value in the engine's own type, or raises PluginError. Arrays are checked
    # with a few whole-array numpy reductions: no per-element Python.

    def check_choose_k(self, value: Any, n_experts: int) -> int:
        """colibri_choose_k: an int k in 1..n_experts."""
        if _is_int(value) and 1 <= value <= n_experts:
            return int(value)
        raise self._refused("colibri_choose_k", shown(value),
                            f"an int k in 1..{n_experts}, or None")

    def check_choose_k_token(self, value: Any, n_tokens: int, n_experts: int) -> np.ndarray:
        """colibri_choose_k_token: int64 [n_tokens], each in 1..n_experts."""
        hook = "colibri_choose_k_token"
        a = _array(value)
        if a is None or a.dtype.kind not in "iu" or a.shape != (n_tokens,):
            raise self._refused(hook, shown(value), f"an integer array of shape [{n_tokens}] "
                                                    f"(one k per token), or None")
        if a.min() < 1 or a.max() > n_experts:
            bad = a[(a < 1) | (a > n_experts)][0]
            raise self._refused(hook, f"k={int(bad)} in {shown(value)}",
                                f"every k in 1..{n_experts}")
        return a.astype(np.int64, copy=False)

    def check_routing(self, value: Any, layer: int, n_tokens: int, k: int, experts,
                      n_model: int) -> tuple[np.ndarray, np.ndarray]:
        """colibri_routing: ``(expert_ids, weights)``, int [N, k'] and float [N, k'] with
        1 <= k' <= k; ids in -1..slots-1 (-1: an unused slot) naming an expert (not a
        vacant hot-plug slot); finite weights. ``experts``: the layer's experts by slot
        (None for a vacant slot); ``n_model``: the model's own experts (never vacant)."""
        hook = "colibri_routing"
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise self._refused(hook, shown(value), "a tuple (expert_ids, weights), or None")
        ids, w = _array(value[0]), _array(value[1])
        if (ids is None or ids.dtype.kind not in "iu" or ids.ndim != 2
                or ids.shape[0] != n_tokens or not 1 <= ids.shape[1] <= k):
            raise self._refused(hook, f"expert_ids {shown(value[0])} for layer {layer}",
                                f"an integer array of shape [{n_tokens}, k'] with 1 <= k' <= {k}")
        if w is None or w.dtype.kind not in "fiu" or w.shape != ids.shape:
            raise self._refused(hook, f"weights {shown(value[1])} for layer {layer}",
                                f"a float array of the expert ids' shape {list(ids.shape)}")
        slots = len(experts)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= slots:
            bad = int(ids[(ids < -1) | (ids >= slots)][0])
            raise self._refused(hook, f"expert id {bad} for layer {layer}",
                                f"ids in -1..{slots - 1} (-1: an unused slot)")
        if hi >= n_model:                          # hot-plug slots: is each one occupied?
            for e in sorted(set(ids[ids >= n_model].tolist())):
                if experts[e] is None:
                    raise self._refused(hook, f"expert id {e} for layer {layer}",
                                        f"an occupied slot (slot {e} is vacant: no "
                                        f"hot-plugged expert in it)")
        if w.dtype != np.float32:
            with np.errstate(all="ignore"):
                w = w.astype(np.float32)
        if not np.isfinite(w).all():
            raise self._refused(hook, f"weights {shown(value[1])} for layer {layer}",
                                "finite weights (no NaN or Inf, also after conversion "
                                "to float32)")
        return ids.astype(np.int64, copy=False), w

    def check_sample(self, value: Any, vocab_size: int) -> int:
        """colibri_sample: an int token id in 0..vocab_size-1."""
        if _is_int(value) and 0 <= value < vocab_size:
            return int(value)
        raise self._refused("colibri_sample", shown(value),
                            f"an int token id in 0..{vocab_size - 1}, or None")


def _label(impl) -> str:
    """How messages name a plugin: its registered name, or for an object registered
    without a name (pluggy then names it by id()), its module or class name."""
    name, plugin = impl.plugin_name, impl.plugin
    if name != str(id(plugin)):
        return name
    return getattr(plugin, "__name__", None) or type(plugin).__name__


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException, code) -> str:
    """`` (at file:line)``: the innermost line that ran in the plugin's own file, else the
    innermost frame."""
    home = getattr(code, "co_filename", None)
    tb, found, last = exc.__traceback__, None, None
    while tb is not None:
        last = tb
        if tb.tb_frame.f_code.co_filename == home:
            found = tb
        tb = tb.tb_next
    at = found or last
    if at is None:
        return ""
    return f" (at {at.tb_frame.f_code.co_filename}:{at.tb_lineno})"
