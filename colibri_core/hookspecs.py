"""Every Colibri hook, in one place, grouped by lifecycle phase.

Plugins implement these with ``@hookimpl`` (from this module) on a module, class
or instance, and are loaded by :func:`colibri_core.plugins.build_plugin_manager`.
The engine calls them through :class:`colibri_core.plugins.HookRelay`, which
skips a hook entirely (one ``is None`` test) when no plugin implements it.

Shape legend used below (the same as the engine's):
  N  tokens in the current forward (1 when decoding, the prompt length in prefill)
  E  routed experts of the layer
  k  experts chosen per token (with a per-token k, the row width is the largest k
     and the unused slots hold expert id -1 with weight 0)
  V  vocabulary size

``layer`` is always the global layer index (the same in files, traces and configs).
pluggy passes arguments by keyword: an implementation may declare any subset of a
hook's arguments, in any order.

"firstresult" hooks stop at the first implementation that returns something other
than None, and the engine uses that value; plugins that only observe return None.
Implementations run last-registered first (pluggy's LIFO order), so a plugin from a
plugins folder overrides a built-in, which overrides an entry-point plugin.

When a plugin fails (colibri_core/pluginguard.py; docs/PLUGINS.md, "When a plugin
fails"): an exception in a hook whose result the engine ignores is logged once and
counted, and the request goes on; an exception in a firstresult hook, or an answer that
breaks its "Returns:" contract, fails that request with ``errors.PluginError`` naming
the plugin. A plugin that failed ``EngineConfig.plugin_max_failures`` times is
unregistered.

Dict arguments: a docstring lists the keys the engine always passes in a section
``Keys of ``ARG``:``, one key per line as ``name (type): description`` (type one of
``str``, ``int``, ``bool``, ``float``, ``list[int]``), continuation lines indented
further. tests/test_hookspecs_dict_keys.py reads these sections and checks every key and
type against what a real generation (with hot-plugged experts) passes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover - types for the docstrings only
    import numpy as np

PROJECT_NAME = "colibri"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- engine lifecycle ---------------------------------------------------------------


@hookspec
def colibri_engine_start(engine) -> None:
    """The engine is built and about to serve its first request.

    Arguments:
        engine: the engine object (model loaded, experts registered).

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_engine_stop(engine) -> None:
    """The engine is shutting down; release files, threads and fds opened in start.

    Arguments:
        engine: the engine object, still usable.

    Returns: nothing; every implementation is called.
    """


# -- request lifecycle ----------------------------------------------------------------


@hookspec(firstresult=True)
def colibri_choose_k(prompt_tokens: int, request: dict, default_k: int) -> int | None:
    """Choose the number of experts per token (k) for a whole request.

    Called once per request after the prompt is tokenized, before the request starts.
    An explicit k in the request or a ``MODE:kN|`` prefix takes precedence over this
    hook; this hook takes precedence over the config's length policy.

    Arguments:
        prompt_tokens: number of prompt tokens (after any truncation).
        request: the request as a dict (read only).
        default_k: the k the engine would use without this hook.

    Keys of ``request``:
        id (str): the request's id (the one ``colibri_request_start`` gets for a
            generation; scoring calls get an id of their own).

    Returns: an int k (1 <= k <= E) or None to keep ``default_k``.
    First result wins.
    """


@hookspec
def colibri_request_start(request_id: str, prompt_tokens: int, k: int) -> None:
    """A request starts: its prompt is tokenized and its k is fixed.

    Arguments:
        request_id: unique id of the request.
        prompt_tokens: number of prompt tokens.
        k: experts per token for this request (the adaptive per-token k may lower or
           raise it token by token, see ``colibri_choose_k_token``).

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_request_end(request_id: str, n_tokens: int, stop_reason: str) -> None:
    """A request has finished.

    Arguments:
        request_id: the id given to ``colibri_request_start``.
        n_tokens: number of tokens generated.
        stop_reason: why generation stopped: "eos", "length" (max_new_tokens), "stop" (a
            stop string), "context" (the context is full), "error" (an exception ended
            it, e.g. a PluginError), or None (the caller stopped iterating early).

    Returns: nothing; every implementation is called.
    """


# -- forward loop, per layer -----------------------------------------------------------


@hookspec
def colibri_before_layer(layer: int, hidden: np.ndarray) -> None:
    """A layer is about to run.

    Arguments:
        layer: global layer index.
        hidden: the residual stream entering the layer, float32 [N, hidden_size].
            It is the engine's own buffer: read it, copy it if you keep it, and only
            write to it if you mean to change the model's computation.

    Returns: nothing; every implementation is called.
    """


@hookspec(firstresult=True)
def colibri_choose_k_token(layer: int, probs: np.ndarray, default_k: int) -> np.ndarray | None:
    """Choose k per token for one MoE layer (adaptive top-k).

    Arguments:
        layer: global layer index of the MoE layer.
        probs: float32 [N, E] router probabilities (softmax over all experts), or the
            sigmoid scores for models that route with sigmoid (DeepSeek-V3 style).
        default_k: the request's k.

    Returns: an int array [N] with each token's k (1 <= k <= E), or None to use
    ``default_k`` for every token. First result wins.
    """


@hookspec(firstresult=True)
def colibri_routing(
    layer: int,
    expert_ids: np.ndarray,
    weights: np.ndarray,
    scores: np.ndarray,
    logits: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The router has chosen experts for one MoE layer; observe or override the choice.

    Arguments:
        layer: global layer index.
        expert_ids: int [N, k] chosen experts, best first (-1 marks an unused slot).
        weights: float32 [N, k] the combine weights the engine will use.
        scores: float32 [N, k] the chosen experts' router scores as the model defines
            them: softmax probabilities over all experts, or sigmoid scores.
        logits: float32 [N, E] raw router logits.
        All arrays are the engine's buffers: read, do not keep or modify them.

    Returns: a tuple ``(expert_ids, weights)`` of new arrays to replace the choice:
    integer ids [N, k'] with 1 <= k' <= k (a narrower choice leaves the other slots
    unused), each -1 (unused) or an expert of the layer (not a vacant hot-plug slot), and
    finite float weights of the same shape; or None (observers must return None).
    First result wins.
    """


@hookspec
def colibri_expert_prefetch(layer: int, experts: list[tuple[int, int, int]]) -> None:
    """The experts chosen for a layer have been prefetched (one batch per layer).

    Arguments:
        layer: global layer index.
        experts: one ``(expert index, mapped address, size in bytes)`` tuple per
            prefetched expert; the address is where the expert's section is mapped.

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_expert_timing(layer: int, expert: int, cycles: int, seconds: float) -> None:
    """One expert's FFN has run; only called when the engine measures expert time.

    Arguments:
        layer: global layer index.
        expert: expert index within the layer.
        cycles: elapsed cycle-counter ticks (rdtsc or equivalent) for the FFN call.
        seconds: the same interval in wall-clock seconds.

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_after_layer(layer: int, hidden: np.ndarray) -> None:
    """A layer has run.

    Arguments:
        layer: global layer index.
        hidden: the residual stream leaving the layer, float32 [N, hidden_size]
            (the engine's buffer, same rules as ``colibri_before_layer``).

    Returns: nothing; every implementation is called.
    """


# -- sampling and output -----------------------------------------------------------------


@hookspec(firstresult=True)
def colibri_sample(logits: np.ndarray, request: dict) -> int | None:
    """Pick the next token instead of the engine's sampler.

    Arguments:
        logits: float32 [V] logits of the last position (read only).
        request: the request as a dict (read only).

    Keys of ``request``:
        id (str): the request's id (as in ``colibri_request_start``).
        k (int): the request's experts per token.

    Returns: an int token id (0 <= id < V), or None to let the next implementation or
    the built-in sampler decide. First result wins.
    """


@hookspec
def colibri_token(
    request_id: str, step: int, token_id: int, text: str, expert_set_generation: int,
    expert_set_id: str
) -> None:
    """A token has been produced and is about to be streamed.

    Arguments:
        request_id: the request it belongs to.
        step: 0-based index of the generated token within the request.
        token_id: the token id.
        text: the token's decoded text ("" when there is no tokenizer).
        expert_set_generation: generation of the expert set that produced the token: a
            counter that only grows, by one for every hot-plug change applied between
            tokens.
        expert_set_id: that expert set's id: a hex sha256 over its sorted (expert name,
            digest) pairs, the same in two engines with the same experts whatever the
            load order or slots (docs/HOTPLUG.md, "Expert-set generation and id").

    Returns: nothing; every implementation is called.
    """


# -- hot-plugged experts ------------------------------------------------------------------


@hookspec
def colibri_expert_loaded(info: dict) -> None:
    """A hot-plugged expert has been adopted; it is routable from the next token.

    Arguments:
        info: a dict describing it (the keys below, and possibly others).

    Keys of ``info``:
        path (str): the expert's file in the watched folder.
        name (str): the expert's name (from its metadata).
        version (str): the expert's version (from its metadata).
        kind (str): "add" (a new name) or "replace" (a new version of an active one,
            a rollback included).
        layers (list[int]): the global layers it serves.
        layer (int): the first of ``layers`` (most experts serve one layer).
        expert (int): its expert index (router slot) in each of ``layers``.
        slot (int): the same as ``expert`` (the hot-plug manager's name for it).
        sha256 (str): the file's sha256.
        expert_set_generation (int): the generation of the expert set that includes it.
        expert_set_id (str): the id of that expert set.

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_expert_rejected(path: str, reason: str) -> None:
    """A candidate expert file was refused (metadata, permissions, hash or probe failed).

    Arguments:
        path: the file that was refused.
        reason: one line saying why, naming the check that failed.

    Returns: nothing; every implementation is called.
    """


@hookspec
def colibri_expert_unloaded(info: dict) -> None:
    """A hot-plugged expert has been removed (file deleted, replaced, or disabled).

    Arguments:
        info: a dict describing it (the keys below, and possibly others).

    Keys of ``info``:
        path (str): the expert's file in the watched folder.
        name (str): the expert's name.
        version (str): the removed version.
        reason (str): why, e.g. "deleted", "renamed" (another file now provides it),
            "crashed" (its isolated helper died).
        layers (list[int]): the global layers it served.
        layer (int): the first of ``layers``.
        expert (int): its expert index (router slot) in each of ``layers``.
        slot (int): the same as ``expert``.
        sha256 (str): the removed file's sha256.
        expert_set_generation (int): the generation of the expert set without it.
        expert_set_id (str): the id of that expert set.

    Returns: nothing; every implementation is called.
    """
