"""The composition root: config -> weights -> model -> tokenizer, plugins, hot-plug.

Small on purpose; no math here. Typical use:

    eng = Engine.from_config("builtin")           # or Engine.from_model_dir(path)
    for ev in eng.generate("The assert statement", max_new_tokens=32):
        print(ev.text, end="")
    logits = eng.next_token_logits([1, 2, 3])
"""
from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from . import kernels
from .closedguard import refuse_after_close
from .config import EngineConfig, ModelConfig, find_config, load_run_config, parse
from .errors import ConfigError, EngineClosedError, RequestError
from .experts.expertchanges import ChangeApplier
from .runtime.generate import Generation, generation
from .experts.hotplug.events import ExpertEvents
from .model.kvcache import KVPool
from .forward.model import Model
from .runtime.kselect import choose_k, renamed_k, split_mode_prefix
from .runtime.sampler import SamplingParams
from .runtime.scheduler import Scheduler
from .runtime.tokenizer import Tokenizer, token_ids
from .model.weights import load_model

log = logging.getLogger("colibri")
_request_ids = itertools.count(1)


@refuse_after_close     # every public method and property: EngineClosedError once closed
class Engine:
    def __init__(self, model_dir: Union[str, Path], config: EngineConfig = EngineConfig(),
                 plugin_manager=None):
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config: expected an EngineConfig, got {type(config).__name__} "
                              f"(build one with EngineConfig(...) or Engine.from_model_dir)")
        self.config = config
        self.model_dir = Path(model_dir)
        self.hotplug = None
        self.hotplug_error = None             # why hot-plug stopped (a failed drain), if it did
        self.candidates = None                # experts/candidates.py, with a shadow/ folder
        self.hooks = None
        self.audit = None                     # audit.AuditLog once start_audit() is called
        # every request, from any thread, runs on the scheduler's one thread
        self.scheduler = Scheduler(self, str(self.model_dir),
                                   between_steps=self._apply_expert_changes,
                                   requests_ended=self._request_ended)
        self._released = False
        if config.experts_dir is not None and not Path(config.experts_dir).is_dir():
            raise ConfigError(f"experts_dir {config.experts_dir!r}: no such folder; create it "
                              f"(the hot-plug folder is watched, never created)")
        kernels.set_threads(config.threads)
        _single_threaded_blas()
        if config.process_limit_mb is not None and os.path.isfile(self.model_dir / "config.json"):
            # the whole process under a limit: measure the fixed overhead now, before any
            # of the model is loaded, and give the budget the rest (residency.py)
            from .experts.residency import derive_budget
            config, _ = derive_budget(self.model_dir, config)
            self.config = config
        plan = None
        if config.max_resident_mb is not None and os.path.isfile(self.model_dir / "config.json"):
            from .experts.residency import check_budget
            plan = check_budget(self.model_dir, config)   # too small: refused before loading
        # Copy-in under a budget: expert files are read into the cache's slots, not at load
        # (a budget holding the whole model reads them at load, as without one).
        lazy = (config.max_resident_mb is not None and config.load_mode == "copy"
                and not (plan is not None and plan.holds_whole_model))
        self.weights = load_model(self.model_dir, config.load_mode, lazy_experts=lazy)
        try:            # a failure from here on leaves nothing open: no mapping, no thread
            self._build(config, plugin_manager)
        except BaseException:
            self._abort()
            raise

    def _build(self, config: EngineConfig, plugin_manager) -> None:
        self.model_cfg: ModelConfig = self.weights.cfg
        self._check_policy(config)
        tok_path = self.model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer(tok_path, self.model_cfg.vocab_size) if tok_path.exists() else None
        from .plugins import HookRelay, build_plugin_manager, register_builtin_plugin
        if plugin_manager is None:
            plugin_manager = build_plugin_manager(plugins_dir=config.plugins_dir)
            if config.debug:
                register_builtin_plugin(plugin_manager, "tracer", "debug-tracer",
                                        kinds=tuple(config.debug))
        self.pm = plugin_manager
        # Hook attributes are None when no plugin implements them: free on the hot path.
        self.hooks = HookRelay(plugin_manager)
        # What a failing plugin costs (pluginguard.py): counted, logged, disabled after N.
        self.hooks.guard.configure(max_failures=config.plugin_max_failures,
                                   slow_ms=config.plugin_slow_ms, strict=config.plugin_strict)
        self.model = Model(self.weights, config, self.hooks)
        # Every request's KV caches come from this pool (kvcache.py), and go back to it.
        self.kv_pool = KVPool.for_engine(self.model_cfg, config)
        # Expert changes (queued, hot-plugged, prepared ahead) into new expert sets between
        # two steps (experts/expertchanges.py), their history with its INFO lines, and the
        # hot-plug changes adopted from a set prepared by the worker / built on this thread.
        self.expert_events = ExpertEvents()
        self.expert_changes = ChangeApplier(self, self.expert_events)
        self.expert_change_stats = self.expert_changes.stats
        if config.experts_dir is not None:
            self._start_hotplug(config)
        if self.hooks.engine_start is not None:
            self.hooks.engine_start(engine=self)

    def _abort(self) -> None:
        """Undo a half-built engine (construction failed): stop hot-plug, unmap weights."""
        if self.candidates is not None:
            self.candidates.close()
        if self.hotplug is not None:
            self.expert_changes.close(abort=True)
        self.scheduler.close(lambda: None)     # its thread (if started) ends first
        self._close_residency()
        if getattr(self, "model", None) is not None:
            self.model.close()
        self.weights.close()

    def _close_residency(self) -> None:
        model = getattr(self, "model", None)
        if model is not None:
            model.residency.close()              # loads in flight finish before the unmap

    def memory_report(self, page_cache: bool = True) -> dict:
        """Resident memory, the expert cache and disk reads (bytes; residency.py).
        Hot-plugged experts' INT4 weights are outside the budget: `hot_plugged_bytes`."""
        if self._closed:
            raise self._closed_error()
        return {**self.model.residency.report(page_cache),
                "hot_plugged_bytes": self.model.expert_set.hot_plugged_bytes()}

    def _check_policy(self, config: EngineConfig) -> None:
        """A length-policy k that the model cannot honour fails here, at load, not on
        every request that matches the rule."""
        n = self.model_cfg.num_experts
        if not self.model_cfg.moe_layers:
            return
        for i, rule in enumerate(config.length_policy):
            if rule.k > n:
                raise ConfigError(f"engine config: field 'length_policy.{i}.k': value {rule.k}: "
                                  f"this model has {n} experts per MoE layer (allowed 1..{n})")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, name_or_path: Union[str, Path] = "builtin",
                    model: Union[str, Path, None] = None, **overrides) -> "Engine":
        """Load a run config (a path or a shipped config name) and build the engine.
        `model`: run this model directory with the config's engine settings (a profile
        such as small-256mb on another model); `overrides` replace engine settings, e.g.
        threads=1."""
        cfg, model_dir = load_run_config(find_config(str(name_or_path)))
        if model is not None:
            model_dir = Path(model)
        engine_cfg = cfg.engine
        if overrides:
            engine_cfg = parse(EngineConfig, {**cfg.engine.model_dump(), **overrides},
                               "engine settings")
        return cls(model_dir, engine_cfg)

    @classmethod
    def from_model_dir(cls, path: Union[str, Path], **settings) -> "Engine":
        return cls(path, parse(EngineConfig, settings, "engine settings"))

    def register_plugin(self, plugin, name: Optional[str] = None) -> None:
        """Register a plugin object (its hooks take effect at the next call site)."""
        self.pm.register(plugin, name=name)

    def count_routed_tokens(self) -> None:
        """From now on, count the tokens routed to each router slot of each MoE layer
        (read with routed_tokens()): a bincount per layer in the step, far cheaper than a
        colibri_routing observer, which makes every step compute routing scores."""
        pipe = self.model.pipeline
        if pipe.routed is None:
            pipe.routed = {}

    def routed_tokens(self) -> dict[int, np.ndarray]:
        """{MoE layer: int64 counts per router slot} since count_routed_tokens() ({}
        while off). A copy, safe to read from any thread while steps run."""
        return {layer: c.copy() for layer, c in list((self.model.pipeline.routed or {}).items())}

    def plugin_failures(self) -> dict:
        """Plugins that failed or were slow, by name: ``{"failures": {hook: n}, "slow":
        {hook: n}, "slowest_ms": {hook: ms}, "disabled": bool, "last_error": str | None}``
        (docs/PLUGINS.md, "When a plugin fails"). Empty while every plugin behaves."""
        return self.hooks.guard.report() if self.hooks is not None else {}

    def close(self) -> None:
        """Cancel queued and running requests (they end with EngineClosedError), stop
        hot-plug, unmap the model files and close their descriptors (now, not at the next
        garbage collection); returns when all that is done. Idempotent; a closed engine
        refuses requests. From inside a step (a plugin hook) it all happens when that
        step ends."""
        self.scheduler.close(self._release_resources)

    def _release_resources(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self.hooks is not None and self.hooks.engine_stop is not None:
                self.hooks.engine_stop(engine=self)
        finally:
            self.stop_audit()                   # every line queued so far, written
            if self.candidates is not None:
                self.candidates.close()
            self.expert_changes.close()         # hot-plug: its worker joined, then released
            self._close_residency()
            self.model.close()                  # its expert sets and C structs hold views
                                                # into the mapped files
            self.weights.close()
            self._after_close = lambda: True    # from now on: closedguard.py

    @property
    def _closed(self) -> bool:
        return self.scheduler.closed

    def _closed_error(self) -> EngineClosedError:
        return self.scheduler.closed_error()

    def _request_ended(self) -> None:
        """On the scheduler's thread, when requests retire: unload unused hot experts now."""
        self.expert_changes.flush_releases()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ requests
    @property
    def num_experts(self) -> int:
        """Experts a request's k may range over (the model's own)."""
        return self.model_cfg.num_experts

    @property
    def expert_set_generation(self) -> int:
        """The current expert set's counter: only grows, +1 per applied change."""
        return self.model.expert_set.generation

    @property
    def model_fingerprint(self) -> str:
        """The model's fingerprint (fingerprint.py; worked out once, on first use): what
        a hot-plugged expert built for this model records as its base_model."""
        from .model.fingerprint import model_fingerprint
        return model_fingerprint(self.weights)

    @property
    def expert_set_id(self) -> str:
        """The current expert set's digest (expertset.expert_set_id): the same in two
        engines with the same experts, whatever the load order or slots."""
        return self.model.expert_set.id

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir}: the model has no tokenizer.json; pass token ids")
        ids = self.tokenizer.encode(text)
        if self.model_cfg.bos_token_id is not None:
            ids = [self.model_cfg.bos_token_id] + ids
        return ids

    def choose_k(self, prompt_tokens: int, explicit: Optional[int], prefix: Optional[int],
                 request: dict) -> tuple[int, str]:
        """Precedence: argument, MODE: prefix, plugin, length policy, model (kselect.py)."""
        return choose_k(self.model_cfg, self.config.length_policy, self.hooks, prompt_tokens,
                        explicit, prefix, request)

    def prepare_ids(self, prompt: Union[str, Sequence[int]], reserve: int = 1) -> tuple[list[int], Optional[int], Optional[int]]:
        """-> (token ids, k from a MODE: prefix, original length if truncated)."""
        if self._closed:
            raise self._closed_error()
        prefix_k = None
        ctx = self.model_cfg.max_position_embeddings
        if isinstance(prompt, str):
            prefix_k, text = split_mode_prefix(prompt)
            if not text:
                raise RequestError("empty prompt: give at least one character of text "
                                   "(after any MODE: prefix)")
            # Only the end of a long prompt can stay: tokenize no more text than the context
            # can hold (a few tokens spare, so the cut's edge falls outside what is kept).
            if self.tokenizer is not None:
                limit = (ctx + 16) * self.tokenizer.max_token_chars
                if len(text) > limit:
                    log.warning("prompt of %d characters is longer than a context of %d "
                                "tokens can hold; tokenizing its last %d characters",
                                len(text), ctx, limit)
                    text = text[-limit:]
            ids = self.encode(text)
        else:
            ids = token_ids(prompt)
        if not ids:
            raise RequestError("empty prompt: no tokens to run")
        V = self.model_cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"token id {bad[0]} out of range 0..{V - 1}")
        keep = max(1, ctx - reserve)
        truncated = None
        if len(ids) > keep:
            truncated = len(ids)
            log.warning("prompt of %d tokens exceeds the context of %d; keeping its last %d "
                        "tokens", len(ids), ctx, keep)
            ids = ids[-keep:]
        return ids, prefix_k, truncated

    def generate(self, prompt: Union[str, Sequence[int]], *, max_new_tokens: Optional[int] = None,
                 experts_per_token: Optional[int] = None,
                 sampling: Optional[SamplingParams] = None,
                 stop: Optional[list[str]] = None, pin_experts: bool = False,
                 sampler=None, request_id: Optional[str] = None,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 min_p: float = 0.0, top_k: Optional[int] = None) -> Generation:
        """`experts_per_token`: k for this request (precedence: kselect.py);
        `sampling`: how tokens are chosen (sampler.SamplingParams, the server's too);
        without it, the engine config's sampling settings, with `temperature`, `top_p`,
        `seed`, the penalties and `min_p` as shorthands over them (giving both `sampling`
        and a shorthand is an error); `sampler`: a callable(logits) -> token id replacing
        the Sampler (replay's greedy one); `request_id`: the id the hooks see (default
        `req-N`). `top_k=`: the old name of experts_per_token, deprecated."""
        return generation(self, prompt, request_id or f"req-{next(_request_ids)}",
                          max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                          experts_per_token=renamed_k(experts_per_token, top_k, "generate"),
                          pin_experts=pin_experts, sampler=sampler, shorthands=dict(
                              temperature=temperature, top_p=top_p, seed=seed,
                              presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty,
                              repetition_penalty=repetition_penalty, min_p=min_p))

    def next_token_logits(self, token_ids: Sequence[int],
                          experts_per_token: Optional[int] = None,
                          all_positions: bool = False, *,
                          top_k: Optional[int] = None) -> np.ndarray:
        """Logits [V] after `token_ids` (or [n, V] for every position)."""
        k = renamed_k(experts_per_token, top_k, "next_token_logits")
        return self.score_batch([token_ids], experts_per_token=k,
                                all_positions=all_positions)[0]

    def score_batch(self, sequences: Sequence[Sequence[int]],
                    experts_per_token: Optional[int] = None, all_positions: bool = False,
                    track: Optional[Callable[[object], None]] = None, *,
                    top_k: Optional[int] = None) -> list[np.ndarray]:
        """Batched forward passes over many (short) sequences: prefill only, no decode.
        -> one float32 [V] array of next-token logits per sequence ([len, V] each with
        all_positions=True). One request to the scheduler: its sequences share steps
        with the other requests' (a step carries at most `max_batch_tokens` tokens, or
        `max_step_tokens` while a stream decodes); a call of more than `max_call_tokens`
        tokens is refused. Blocks until done (from any thread but a plugin hook's).
        `track(handle)` is called once the call is queued: `handle.close()` from any
        thread cancels it (its sequences leave at the next step) and this call raises
        RequestCancelled. Engine.score gives each result with its expert set."""
        k = renamed_k(experts_per_token, top_k, "score_batch")
        return [s.logits for s in self.score(sequences, k, all_positions, track)]

    def score(self, sequences: Sequence[Sequence[int]], experts_per_token: Optional[int] = None,
              all_positions: bool = False, track: Optional[Callable[[object], None]] = None,
              request_id: Optional[str] = None, groups: Optional[Sequence[int]] = None, *,
              top_k: Optional[int] = None, expert_set=None) -> list:
        """score_batch with provenance: one scoring.Scored per sequence (`logits`,
        `expert_set` {generation, id} of the one set that computed it, `k`, `tokens`);
        each sequence is pinned to the set current at its admission (or a canary's,
        experts/candidates.py), sequences with the same `groups` label to the set of the
        first of them admitted (scoring.py); `expert_set`: this ExpertSet for all (a
        candidate's shadow pass, a check under a named set)."""
        from .runtime.scoring import score
        k = renamed_k(experts_per_token, top_k, "score")
        return score(self, sequences, k, all_positions, track,
                     request_id or f"req-{next(_request_ids)}", groups, expert_set)

    def start_audit(self, path: Union[str, Path], max_mb: float = 1024) -> None:
        """Write one audit line per scored item and generated sequence to `path`
        (audit.py; rotated past `max_mb` per file) until stop_audit(). Off until called."""
        from .runtime.audit import AuditLog, RouteSink
        if self.audit is not None:
            raise RequestError(f"the audit log is on already ({self.audit.path})")
        cfg = self.config
        self.audit = AuditLog(path, max_mb, {"model_dir": str(self.model_dir), "routing":
                              cfg.routing, "activations": cfg.activations, "kv_dtype": cfg.kv_dtype})
        self.model.route_sink = RouteSink(self.model.pipeline)

    def stop_audit(self) -> None:
        """Close the log (what was queued is written; requests still running may be
        left out of it)."""
        audit, self.audit, self.model.route_sink = self.audit, None, None
        if audit is not None:
            audit.close()

    # ------------------------------------------------------------------ expert changes
    def _start_hotplug(self, config: EngineConfig) -> None:
        from .experts.hotplug.manager import HotplugManager
        self.hotplug = HotplugManager.for_engine(config, self.model_cfg, self.model_fingerprint,
                                                 self._on_event, self.expert_changes.prepare)
        self.hotplug.start()     # the folder's experts are checked before the first token:
        self.hotplug.wait_idle(config.hotplug.startup_timeout_s)
        live, shadow = self.hotplug, os.path.join(self.hotplug.experts_dir, "shadow")
        if os.path.isdir(shadow):    # candidates: checked and loaded, not joined
            from .experts.candidates import Candidates
            cm = HotplugManager.for_folder(
                shadow, os.path.join(live.state_dir, "shadow"), config, self.model_cfg,
                self.model_fingerprint, None, None,
                assign_slot=lambda name: live.book.slot_for(name)[0])
            self.candidates = Candidates(self, cm, live, self.expert_events)
            cm.start()
            cm.wait_idle(config.hotplug.startup_timeout_s)
        self.apply_expert_changes()

    def _on_event(self, kind: str, info: dict) -> None:
        self.expert_changes.on_event(kind, info)

    def queue_expert_change(self, change) -> None:
        """Queue a callable(ExpertSet) -> ExpertSet; applied between tokens."""
        self.expert_changes.queue(change)

    def trim_memory(self) -> bool:
        """While idle (a server between requests): shrink the step's scratch back to a
        small step's size, on the scheduler's thread between two steps. True when
        anything was released (then glibc's malloc_trim gives it to the system)."""
        if self._closed:
            return False
        return bool(self.scheduler.call(self.model.pipeline.scratch.shrink))

    def apply_expert_changes(self) -> None:
        """Adopt queued expert changes now: on the scheduler's thread, between two steps
        (this waits for the current one); EngineClosedError once closed. The scheduler
        also adopts them before every step."""
        if self._closed:
            return
        self.scheduler.call(self._apply_and_flush)

    def _apply_and_flush(self) -> None:
        self._apply_expert_changes()
        self.expert_changes.flush_releases()     # not on a token's path: unload now

    def _apply_expert_changes(self) -> None:    # the scheduler's thread, between two steps
        self.expert_changes.apply()
        if self.candidates is not None:
            self.candidates.apply()

    def set_for(self, request_id: str):
        """The set a request's pinned sequence runs with (the scheduler's thread, at its
        admission): the live one, or a canary candidate's (experts/candidates.py)."""
        c = self.candidates
        return self.model.expert_set if c is None else c.set_for(request_id)

def _single_threaded_blas() -> None:
    """The engine's numpy calls are small (router logits, norms); a multi-threaded BLAS
    would spin-wait on the cores our kernels' thread pool needs (measured: 2-thread decode went
    from 10.5 ms to 53 ms per token with numpy's OpenBLAS threads active). Process-wide."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(1, user_api="blas")

