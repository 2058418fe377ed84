"""The plugin manager: hook specs, entry points, built-ins, a plugins folder.

    pm = build_plugin_manager(plugins_dir="my_plugins/")
    relay = HookRelay(pm)
    ...
    if relay.routing is not None:                 # one attribute test when unused
        choice = relay.routing(layer=l, expert_ids=ids, weights=w, scores=s, logits=z)

Loading order (pluggy calls implementations last-registered first, so a later
source overrides an earlier one for firstresult hooks):
  1. the hook specs (colibri_core.hookspecs)
  2. setuptools entry points of the group "colibri"
  3. built-in plugins (objects, or names of modules in colibri_core.builtin_plugins)
  4. loose ``*.py`` modules from a plugins folder (config or ``--plugins-dir``)

``COLIBRI_TRACE_HOOKS=1`` prints every hook call and its result to stderr.

Every implementation is called through the manager's PluginGuard (pluginguard.py,
``plugin_guard(pm)``, ``relay.guard``): a plugin's exception or bad answer is contained
there, and a plugin that keeps failing is unregistered.

The built-in plugin modules live in the top-level ``plugins/`` folder, installed as
the package ``colibri_core.builtin_plugins`` (setup.py maps the folder).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping

import pluggy

from colibri_core import hookspecs
from colibri_core.errors import ColibriError
from colibri_core.files import read_bytes
from colibri_core.hookspecs import PROJECT_NAME, hookimpl
from colibri_core.pluginguard import PluginGuard, env_flag

__all__ = [
    "ENTRYPOINT_GROUP",
    "DEFAULT_BUILTINS",
    "HOOK_NAMES",
    "PluginLoadError",
    "ColibriPluginManager",
    "HookRelay",
    "PluginGuard",
    "plugin_guard",
    "build_plugin_manager",
    "register_builtin_plugin",
    "load_plugins_dir",
    "load_entrypoint_plugins",
    "hookimpl",
]

ENTRYPOINT_GROUP = PROJECT_NAME
#: Built-ins registered by default: each name is a module of colibri_core.builtin_plugins whose
#: ``from_env(environ)`` returns a plugin object, or None when it is not switched on.
DEFAULT_BUILTINS: tuple[str, ...] = ("tracer",)
#: Every hook name, in the order the specs are written.
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name in vars(hookspecs) if name.startswith(PROJECT_NAME + "_")
)
_TRACE_ENV = "COLIBRI_TRACE_HOOKS"
_DIR_MODULE_PREFIX = "colibri_plugins_dir"
_BUILTIN_PACKAGE = "colibri_core.builtin_plugins"


class PluginLoadError(ColibriError):
    """A plugin could not be imported or registered; the message names its source."""


class ColibriPluginManager(pluggy.PluginManager):
    """A pluggy PluginManager that tells its HookRelays when plugins come and go."""

    def __init__(self, project_name: str = PROJECT_NAME) -> None:
        super().__init__(project_name)
        self._relays: weakref.WeakSet[HookRelay] = weakref.WeakSet()

    @property
    def guard(self) -> PluginGuard:
        """The failure policy and counts of this manager's plugins (pluginguard.py)."""
        return plugin_guard(self)

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        try:
            return super().register(plugin, name)
        finally:
            self._changed()

    def unregister(self, plugin: Any | None = None, name: str | None = None) -> Any | None:
        try:
            return super().unregister(plugin, name)
        finally:
            self._changed()

    def _changed(self) -> None:
        for relay in list(self._relays):
            relay.refresh()


class HookRelay:
    """Hot-loop view of a plugin manager: one attribute per hook, named without the
    ``colibri_`` prefix (``relay.routing``, ``relay.token``, ...).

    An attribute is None when no plugin implements the hook, else pluggy's bound
    HookCaller (call it with keyword arguments). The attributes are recomputed when
    plugins are registered or unregistered, so the engine pays one ``is None`` test
    per call site while nothing listens.

    ``relay.guard`` is the manager's PluginGuard: every implementation is called through
    it, and the engine checks decision hooks' answers with its ``check_<hook>`` methods.
    """

    __slots__ = tuple(n[len(PROJECT_NAME) + 1 :] for n in HOOK_NAMES) + ("pm", "guard", "__weakref__")

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.guard = plugin_guard(pm)
        if isinstance(pm, ColibriPluginManager):
            pm._relays.add(self)
        else:
            _watch_plain_manager(pm, self)
        self.refresh()

    def refresh(self) -> None:
        """Recompute every attribute from the plugin manager's current plugins (and call
        new implementations through the guard)."""
        hooks = self.pm.hook
        for name in HOOK_NAMES:
            caller = getattr(hooks, name, None)
            active = caller is not None and bool(caller.get_hookimpls())
            if active:
                self.guard.watch(caller)
            setattr(self, name[len(PROJECT_NAME) + 1 :], caller if active else None)

    def active(self) -> list[str]:
        """Names of the hooks that have at least one implementation."""
        return [n for n in self.__slots__[: len(HOOK_NAMES)] if getattr(self, n) is not None]

    def __repr__(self) -> str:
        return f"<HookRelay active={self.active()}>"


def plugin_guard(pm: pluggy.PluginManager) -> PluginGuard:
    """The PluginGuard of ``pm`` (one per manager, made on first use; a plain pluggy
    manager gets one too)."""
    guard = getattr(pm, "_colibri_guard", None)
    if guard is None:
        guard = pm._colibri_guard = PluginGuard(pm)  # type: ignore[attr-defined]
    return guard


def _watch_plain_manager(pm: pluggy.PluginManager, relay: HookRelay) -> None:
    """Refresh ``relay`` after register/unregister on a PluginManager we did not build."""
    relays = getattr(pm, "_colibri_relays", None)
    if relays is None:
        relays = pm._colibri_relays = weakref.WeakSet()  # type: ignore[attr-defined]
        for method in ("register", "unregister"):
            original = getattr(pm, method)

            def wrapped(*args, _original=original, **kwargs):
                try:
                    return _original(*args, **kwargs)
                finally:
                    for r in list(relays):
                        r.refresh()

            setattr(pm, method, wrapped)
    relays.add(relay)


# -- building -----------------------------------------------------------------------


def build_plugin_manager(
    plugins_dir: str | os.PathLike | None = None,
    load_entrypoints: bool = True,
    builtins: Iterable[Any] = DEFAULT_BUILTINS,
    *,
    trace_hooks: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> ColibriPluginManager:
    """Build the plugin manager: specs, entry points, built-ins, then a plugins folder.

    Arguments:
        plugins_dir: folder of loose ``*.py`` plugin modules (config / ``--plugins-dir``);
            None for none.
        load_entrypoints: load the setuptools entry points of the group "colibri".
        builtins: plugin objects to register, or names of modules in
            ``colibri_core.builtin_plugins`` whose ``from_env(environ)`` returns a plugin or None.
            The default registers the tracer when ``COLIBRI_DEBUG`` is set.
        trace_hooks: print every hook call to stderr; None reads ``COLIBRI_TRACE_HOOKS``.
        environ: environment used by built-ins, ``trace_hooks`` and the guard's
            ``COLIBRI_PLUGIN_STRICT`` (default os.environ).

    Raises PluginLoadError (one line naming the plugin's file or entry point) when a
    plugin fails to import or implements a hook that does not exist.
    """
    env = os.environ if environ is None else environ
    pm = ColibriPluginManager(PROJECT_NAME)
    pm.guard.configure(environ=env)                # COLIBRI_PLUGIN_STRICT
    pm.add_hookspecs(hookspecs)
    if load_entrypoints:
        load_entrypoint_plugins(pm)
    for builtin in builtins:
        _register_builtin(pm, builtin, env)
    if plugins_dir is not None:
        load_plugins_dir(pm, plugins_dir)
    if trace_hooks is None:
        trace_hooks = env_flag(env, _TRACE_ENV)
    if trace_hooks:
        _trace_hook_calls(pm)
    return pm


def load_entrypoint_plugins(pm: pluggy.PluginManager, group: str = ENTRYPOINT_GROUP) -> int:
    """Register every entry point of ``group`` not yet registered or blocked; return
    how many were added."""
    count = 0
    for ep in importlib.metadata.entry_points(group=group):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        source = f"entry point {ep.name!r} ({ep.value})"
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginLoadError(f"colibri: cannot import plugin {source}: {_one_line(exc)}") from exc
        _register(pm, plugin, ep.name, source)
        count += 1
    return count


# Loose modules are executed once per process, then reused by later managers.
_DIR_MODULES: dict[Path, ModuleType] = {}


def load_plugins_dir(pm: pluggy.PluginManager, plugins_dir: str | os.PathLike) -> list[ModuleType]:
    """Import each ``*.py`` file of ``plugins_dir`` (sorted, ``_*`` skipped) once, and
    register it under the name ``plugins_dir:<path>``. Returns the modules."""
    folder = Path(plugins_dir)
    if not folder.is_dir():
        raise PluginLoadError(f"colibri: plugins folder {str(folder)!r} does not exist or is not a folder")
    try:                        # glob() would list an unreadable folder as empty
        os.listdir(folder)
    except OSError as e:
        raise PluginLoadError(f"colibri: plugins folder {str(folder)!r}: cannot list it: "
                              f"{e.strerror}") from None
    modules = []
    for path in sorted(folder.resolve().glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = _DIR_MODULES.get(path)
        if module is None:
            module = _exec_module_file(path)
            _DIR_MODULES[path] = module
        name = f"plugins_dir:{path}"
        if pm.get_plugin(name) is None and not pm.is_blocked(name):
            _register(pm, module, name, f"file {path}")
        modules.append(module)
    return modules


def _exec_module_file(path: Path) -> ModuleType:
    """Run the module file `path`. Its source is read by files.read_bytes (a regular file
    only: a FIFO named `x.py` would block the import system's own open() forever) and
    compiled here; no bytecode cache is written into the plugins folder."""
    module_name = f"{_DIR_MODULE_PREFIX}_{path.stem}_{abs(hash(str(path))):x}"
    source = read_bytes(path, lambda msg: PluginLoadError(f"colibri: cannot import plugin file {msg}"))
    spec = importlib.machinery.ModuleSpec(module_name, None, origin=str(path))
    spec.has_location = True                    # sets the module's __file__
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    except BaseException as exc:
        del sys.modules[module_name]
        if not isinstance(exc, Exception):
            raise
        raise PluginLoadError(f"colibri: cannot import plugin file {path}: {_where(exc, path)}{_one_line(exc)}") from exc
    return module


def register_builtin_plugin(pm: pluggy.PluginManager, module: str, name: str, **options: Any) -> Any:
    """Register the plugin made by ``make_plugin(**options)`` of the built-in module
    ``colibri_core.builtin_plugins.<module>`` under ``name``, and return it. The engine
    names built-ins this way: no core module imports the plugin package
    (tests/test_layering.py)."""
    plugin = _import_builtin(module).make_plugin(**options)
    pm.register(plugin, name=name)
    return plugin


def _import_builtin(builtin: str) -> ModuleType:
    module_name = f"{_BUILTIN_PACKAGE}.{builtin}"
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise PluginLoadError(f"colibri: cannot import built-in plugin {module_name}: {_one_line(exc)}") from exc


def _register_builtin(pm: pluggy.PluginManager, builtin: Any, env: Mapping[str, str]) -> None:
    if not isinstance(builtin, str):
        _register(pm, builtin, None, f"built-in {builtin!r}")
        return
    module = _import_builtin(builtin)
    plugin = module.from_env(env) if hasattr(module, "from_env") else module
    if plugin is not None:
        _register(pm, plugin, f"builtin:{builtin}", f"built-in {module.__name__}")


def _register(pm: pluggy.PluginManager, plugin: Any, name: str | None, source: str) -> None:
    """Register ``plugin`` and check its hook names; undo and raise one clear line on error."""
    try:
        registered = pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        _unregister_quietly(pm, plugin)
        raise PluginLoadError(f"colibri: invalid plugin {source}: {_one_line(exc)}") from exc
    except ValueError as exc:  # the object or the name is already registered
        raise PluginLoadError(f"colibri: cannot register plugin {source}: it or the name {name!r} is already registered") from exc
    if registered is None:
        return
    unknown = [
        hook_name
        for hook_name, caller in vars(pm.hook).items()
        if not hook_name.startswith("_")
        and not caller.has_spec()
        and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
    ]
    if unknown:
        _unregister_quietly(pm, plugin)
        raise PluginLoadError(
            f"colibri: invalid plugin {source}: unknown hook {unknown[0]!r} "
            f"(known hooks: see colibri_core/hookspecs.py)"
        )


def _unregister_quietly(pm: pluggy.PluginManager, plugin: Any) -> None:
    name = pm.get_name(plugin)
    if name is not None:
        pm.unregister(plugin, name)


def _where(exc: BaseException, path: Path) -> str:
    """``line N: `` for an error raised while executing ``path``."""
    lineno = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    tb = exc.__traceback__
    while lineno is None and tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return f"line {lineno}: " if lineno else ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) if not isinstance(exc, SyntaxError) else exc.msg
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- COLIBRI_TRACE_HOOKS ---------------------------------------------------------------


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and getattr(value, "dtype", None) is not None:
        if getattr(value, "size", 0) <= 8:
            return f"array({value.tolist()!r}, {value.dtype})"
        return f"<{value.dtype} array {list(shape)}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _trace_hook_calls(pm: pluggy.PluginManager) -> Any:
    """Print each hook call (and its result, when there is one) like datasette does."""

    def emit(line: str) -> None:
        print(f"colibri hook: {line}", file=sys.stderr, flush=True)

    def before(hook_name, hook_impls, kwargs):
        args = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
        emit(f"{hook_name}({args}) -> [{', '.join(impl.plugin_name for impl in hook_impls)}]")

    def after(outcome, hook_name, hook_impls, kwargs):
        if outcome.exception is not None:
            emit(f"{hook_name} raised {_one_line(outcome.exception)}")
            return
        result = outcome.get_result()
        if result is not None and not (isinstance(result, list) and not result):
            emit(f"{hook_name} returned {_short(result)}")

    return pm.add_hookcall_monitoring(before, after)
