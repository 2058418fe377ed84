"""Per-request k: parsing the `MODE:kN|` prompt prefix and choosing k by precedence.

`experts_per_token` is the one name of k wherever a user sets or reads it (the Python
API, `colibri run --experts-per-token`, the HTTP body, /v1/models); the model's
config.json keeps its `top_k`. Precedence (first that applies wins):
  1. the explicit argument (`experts_per_token=` / `--experts-per-token`);
  2. a `MODE:kN|` prefix at the very start of the prompt (stripped before tokenizing);
  3. a plugin implementing `colibri_choose_k`;
  4. the engine config's length policy (first matching rule, on the prompt's token count);
  5. the model's `top_k`.
"""
from __future__ import annotations

import numbers
import re
import warnings

from ..errors import RequestError

MODE_PREFIX = "MODE:"
_MODE_RE = re.compile(r"MODE:k([0-9]{1,4})\|")      # ASCII digits only (not \d: '٣')


def split_mode_prefix(prompt: str) -> tuple[int | None, str]:
    """`MODE:k2|text` -> (2, "text"); a prompt without the prefix -> (None, prompt)."""
    if not prompt.startswith(MODE_PREFIX):
        return None, prompt
    m = _MODE_RE.match(prompt)
    if m is None:
        shown = prompt[:20] + ("..." if len(prompt) > 20 else "")
        raise RequestError(f"malformed MODE: prefix in prompt {shown!r}: expected "
                           f"'MODE:kN|' with N a positive integer, e.g. 'MODE:k2|'")
    k = int(m.group(1))
    if k < 1:
        raise RequestError(f"MODE:k{k}| asks for k={k}; k must be at least 1")
    return k, prompt[m.end():]


def renamed_k(experts_per_token, top_k, where: str):
    """The old Python keyword `top_k=` (experts per token) for one release: accepted with
    a DeprecationWarning; both given and different is an error."""
    if top_k is None:
        return experts_per_token
    warnings.warn(f"{where}(top_k=...) is deprecated: use experts_per_token= (top_k is "
                  f"the sampling top-k in SamplingParams)", DeprecationWarning, stacklevel=4)
    if experts_per_token is not None and experts_per_token != top_k:
        raise RequestError(f"{where}: experts_per_token={experts_per_token!r:.40} and the "
                           f"deprecated top_k={top_k!r:.40} disagree; give experts_per_token "
                           f"only")
    return top_k


def check_k(k: int, num_experts: int, source: str) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise RequestError(f"experts_per_token={k!r:.40} from {source} is not an integer: "
                           f"give a whole number of experts (allowed 1..{num_experts})")
    if not 1 <= k <= num_experts:
        raise RequestError(f"experts_per_token={k!r} from {source} is out of range: this "
                           f"model has "
                           f"{num_experts} experts per MoE layer (allowed 1..{num_experts})")
    return int(k)


def choose_k(model_cfg, length_policy, hooks, prompt_tokens: int, explicit, prefix,
             request: dict) -> tuple[int, str]:
    """-> (k, where it came from) by the precedence above (Engine.choose_k); `hooks`: the
    engine's HookRelay (None: no plugins)."""
    if not model_cfg.moe_layers:
        return model_cfg.top_k, "model (no MoE layers)"
    n = model_cfg.num_experts
    if explicit is not None:
        return check_k(explicit, n, "the experts_per_token argument"), "argument"
    if prefix is not None:
        return check_k(prefix, n, "the MODE: prefix"), "prefix"
    if hooks is not None and hooks.choose_k is not None:
        got = hooks.choose_k(prompt_tokens=prompt_tokens, request=request,
                             default_k=model_cfg.top_k)
        if got is not None:
            return hooks.guard.check_choose_k(got, n), "plugin"
    for rule in length_policy:
        if rule.matches(prompt_tokens):
            return check_k(rule.k, n, "the engine config's length_policy"), "policy"
    return model_cfg.top_k, "model"
