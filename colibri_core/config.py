"""Configuration: the model definition and the engine's runtime settings.

Three pydantic models, all frozen and refusing unknown keys:

- `ModelConfig`   what the model *is* (sizes, layer kinds, routing rules); lives in the
                  model directory's config.json.
- `EngineConfig`  how to *run* it (threads, load mode, sampling defaults, dynamic-k policy).
- `RunConfig`     a file in configs/: which model, plus engine settings.

A bad file fails with `ConfigError`, one line per problem: the file, the field, the value
and what is allowed. ModelConfig and its parts live in modelconfig.py (re-exported here).
"""
from __future__ import annotations

import reprlib
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, ValidationError, model_validator

from .errors import ConfigError
from .files import read_text
from .modelconfig import (_STRICT, FileInfo, FormatVersion, ModelConfig,  # noqa: F401 (re-exported)
                          RopeScaling)
from .nesting import json_loads, yaml_load


class SamplingConfig(BaseModel):
    model_config = _STRICT
    temperature: float = Field(default=0.8, ge=0.0)   # 0 -> greedy
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0)
    max_new_tokens: int = Field(default=64, ge=0)
    stop: list[str] = []


class LengthRule(BaseModel):
    """Prompts with min_tokens <= length <= max_tokens use k (bounds optional)."""
    model_config = _STRICT
    min_tokens: Optional[int] = Field(default=None, ge=0)
    max_tokens: Optional[int] = Field(default=None, ge=0)
    k: int = Field(ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> "LengthRule":
        if (self.min_tokens is not None and self.max_tokens is not None
                and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens="
                             f"{self.max_tokens}: the rule can never match")
        return self

    def matches(self, n: int) -> bool:
        return ((self.min_tokens is None or n >= self.min_tokens)
                and (self.max_tokens is None or n <= self.max_tokens))


class HotplugConfig(BaseModel):
    """Hot-plugged experts (used when EngineConfig.experts_dir is set)."""
    model_config = _STRICT
    isolation: Literal["inprocess", "isolated"] = "inprocess"   # per-file override by name
    allowlist: Optional[list[str]] = None          # sha256 hex digests; None: no allowlist
    probe_timeout_s: float = Field(default=5.0, gt=0)
    probe_slots: int = Field(default=2, ge=1, le=64)    # probes at once (warm helper's children)
    settle_s: float = Field(default=0.2, ge=0)     # files not renamed in / closed after writing
    state_dir: Optional[str] = None                # default: <experts_dir>/.colibri-state
    startup_timeout_s: float = Field(default=30.0, ge=0)  # wait for the folder's first scan
    # JSON {expert name: slot} read when a name first gets a slot (a fleet's registry
    # writes it, so that every replica numbers the experts alike); None: next free slot
    slots_file: Optional[str] = None


class ResidencyConfig(BaseModel):
    """The expert cache behind EngineConfig.max_resident_mb (colibri_core/experts/expertcache.py);
    ignored without a budget."""
    model_config = _STRICT
    policy: Literal["lru", "lfu"] = "lfu"          # lfu: frequency with exponential aging
    half_life_tokens: float = Field(default=32.0, gt=0)   # lfu aging: a use counts half after this many forwards
    speculative: bool = False                      # guess the next MoE layer's experts early
    speculative_layers: int = Field(default=1, ge=1, le=8)   # with speculative: guess this many MoE layers ahead
    # a guess 2+ MoE layers ahead evicts only an expert whose use rate x this is at most
    # the far guesses' measured precision (experts/speculation.py); 0: any expert
    far_guess_margin: float = Field(default=2.0, ge=0)
    io_threads: int = Field(default=4, ge=1, le=64)   # expert loads in flight at once
    kv_tokens: Optional[int] = Field(default=None, gt=0)  # older name of EngineConfig.kv_pool_tokens (used when that is unset)
    debug_poison: bool = False                     # copy mode: fill evicted frames with NaN


class EngineConfig(BaseModel):
    """Runtime settings; every field has a default."""

    model_config = _STRICT

    threads: int = Field(default=2, ge=1, le=512)
    load_mode: Literal["mmap", "copy"] = "mmap"
    routing: Literal["fixed", "float"] = "fixed"       # fixed-point softmax weights, or float
    activations: Literal["int8", "float"] = "int8"     # int8 per-group activations, or float
    sampling: SamplingConfig = SamplingConfig()
    length_policy: list[LengthRule] = []               # dynamic k by prompt length
    prefetch: Literal["none", "willneed", "populate"] = "willneed"
    # without a memory budget: the whole model's files at load -- "willneed" starts reading
    # them in the background (as llama.cpp's mmap loader does), "populate" returns once
    # they are read and mapped; "none" leaves it to the per-expert prefetch
    preload: Literal["none", "willneed", "populate"] = "willneed"
    experts_dir: Optional[str] = None                  # hot-plug folder (None: disabled)
    hotplug: HotplugConfig = HotplugConfig()
    plugins_dir: Optional[str] = None
    # when a plugin fails (pluginguard.py, docs/PLUGINS.md "When a plugin fails"):
    plugin_max_failures: int = Field(default=3, ge=1)  # failures, every hook, before it is unregistered
    plugin_slow_ms: Optional[float] = Field(default=None, gt=0)   # log slower hook calls (None: untimed)
    plugin_strict: bool = False        # re-raise plugins' exceptions (also COLIBRI_PLUGIN_STRICT=1)
    debug: list[Literal["routing", "memory", "timing"]] = []
    max_resident_mb: Optional[float] = Field(default=None, gt=0)   # MiB; see residency.py
    # MiB for the whole process (RSS + the model's page cache): the engine measures its
    # fixed overhead at start (residency.process_overhead_bytes) and runs with
    # max_resident_mb = process_limit_mb - overhead; set one of the two, not both
    process_limit_mb: Optional[int] = Field(default=None, gt=0)
    # the KV cache (kvcache.py): every sequence's cache comes from one pool of this many
    # positions (None: from the memory the model's files leave, within [min(4,096,
    # context), max(65,536, context)], residency.kv_pool_tokens; under a budget one
    # sequence at the full context), counted in
    # max_resident_mb; rows stored as float32, IEEE half, or int8 with a scale per row
    # (MLA's latent cache stays float32)
    kv_pool_tokens: Optional[int] = Field(default=None, gt=0)
    kv_dtype: Literal["f32", "f16", "q8"] = "f32"
    # automatic prefix caching (runtime/prefixcache.py): KV rows of ended requests kept, in
    # blocks, up to this many MiB (least recently used evicted first) and copied into a
    # later request whose prompt starts with them; 0: off. Off in the Python API (a
    # library holding memory after a call ends, and benchmarks that repeat a prompt would
    # time the cache); `colibri serve` turns it on (--prefix-cache-mb, default 256)
    prefix_cache_mb: float = Field(default=0, ge=0)
    residency: ResidencyConfig = ResidencyConfig()
    # a forward step carries at most `max_batch_tokens` tokens (a larger call runs in
    # several steps; batch invariance: the same logits); a score_batch of more than
    # `max_call_tokens` tokens is refused
    max_batch_tokens: int = Field(default=65536, ge=1)
    max_call_tokens: int = Field(default=1 << 20, ge=1)
    # the scheduler (scheduler.py): a step carries at most `max_step_tokens` tokens while
    # any stream is decoding (running decodes first, one token each, then prompt chunks),
    # and up to `max_batch_tokens` while none is. 256: the best aggregate rate measured
    # with a 1,920-token prompt arriving during 15 streams (benchmarks/speed/bench_scheduler.py,
    # docs/BENCHMARKS.md "Scheduler"); only 32 kept the streams' p99 within 2x there, but
    # the cap counts decodes too, so 32 would cap a step at 32 streams and starve prompts. Requests waiting for admission: at most
    # `max_queued_requests`; one more waits for a place, or is refused with
    # EngineBusyError (`when_full`). Admission: a sequence starts when the KV pool
    # (`kv_pool_tokens`) has its positions free.
    max_step_tokens: int = Field(default=256, ge=1)
    # while any stream decodes, a step carries at most this many tokens of each prompt
    # beside the decodes (None: what max_step_tokens leaves), so that a long prompt
    # arriving does not slow the running streams' tokens, while prompts arriving together
    # still advance together. 8: a 1,920-token prompt arriving during 15 streams
    # raised their per-token p99 1.60x (16: 2.10x; no cap: 15x), prefilled in 13 s instead
    # of 7.6 (benchmarks/speed/bench_scheduler.py --steps 256 --prefill 8, 2026-12-01 23:29 UTC)
    max_prefill_tokens: Optional[int] = Field(default=8, ge=1)
    max_queued_requests: int = Field(default=256, ge=1)
    when_full: Literal["wait", "refuse"] = "wait"
    # self-speculative decoding (speculative.py; not the expert cache's
    # residency.speculative prefetch): "prompt_lookup" drafts up to `draft_tokens`
    # tokens per decode step from the sequence's own text (the continuation of its last
    # draft_ngram_max .. draft_ngram_min tokens' latest earlier occurrence), verified in
    # the same forward; the output is plain decoding's token for token (greedy and
    # seeded sampling alike). Off by default: docs/BENCHMARKS.md "Self-speculative
    # decoding" has the cost model and the measurements that decided it.
    speculative_decoding: Literal["off", "prompt_lookup"] = "off"
    draft_tokens: int = Field(default=4, ge=1, le=64)
    draft_ngram_max: int = Field(default=3, ge=1, le=16)
    draft_ngram_min: int = Field(default=2, ge=1, le=16)   # 1: acceptance 0.45 vs 0.77 (built-in, g=1)

    @model_validator(mode="after")
    def _one_limit(self) -> "EngineConfig":
        if self.draft_ngram_min > self.draft_ngram_max:
            raise ValueError(f"draft_ngram_min={self.draft_ngram_min} exceeds draft_ngram_max="
                             f"{self.draft_ngram_max}: no n-gram length is left to match")
        if self.process_limit_mb is not None and self.max_resident_mb is not None:
            raise ValueError(f"process_limit_mb={self.process_limit_mb} and max_resident_mb="
                             f"{self.max_resident_mb:g} are both set; set one: process_limit_mb "
                             f"derives max_resident_mb from the overhead measured at start")
        return self


class RunConfig(BaseModel):
    """A file in configs/: `model:` (a directory, relative to the file, or `builtin`)
    and `engine:` settings."""

    model_config = _STRICT
    model: str
    engine: EngineConfig = EngineConfig()
    description: str = ""


# ----------------------------------------------------------------------------- loading

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 2, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 60


def _short_repr(value: Any) -> str:
    """repr() that looks at a bounded part of the value: a YAML file can alias one list
    into itself level after level ("billion laughs"), and a full repr() of such a value
    would never finish."""
    try:
        return _REPR.repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def format_validation_error(source: str, err: ValidationError) -> str:
    """One line per problem: `source: field 'a.b': value X: what is allowed`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = _short_repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            # no value: a file that is not a config at all (config.json a symlink to some
            # other JSON file) would have its content quoted here
            lines.append(f"{source}: field '{loc}': unknown field (not allowed; check the "
                         f"spelling)")
            continue
        if e["type"] == "missing":
            lines.append(f"{source}: field '{loc}': missing (required)")
            continue
        lines.append(f"{source}: field '{loc}': value {shown}: {msg}")
    return "\n".join(lines)


def _yaml_loader():
    """PyYAML's safe loader, on libyaml's C parser when PyYAML was built with it (several
    times faster on a large file; docs/ROBUSTNESS.md). Either way aliases stay shared
    objects, and an alias bomb is defused by the bounded repr above."""
    import yaml
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict, with one-line errors. Only a regular file is
    read (a FIFO or device is refused at once, files.py)."""
    path = Path(path)
    text = read_text(path, ConfigError)
    try:
        if path.suffix == ".json":
            data = json_loads(text)
        else:
            data = yaml_load(text, _yaml_loader())
    except Exception as e:  # json/yaml syntax errors (and TooDeep) carry their reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse(model_cls, data: dict, source: str):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(source, e)) from None


def load_model_config(path: Path) -> ModelConfig:
    cfg = parse(ModelConfig, read_mapping(path), str(path))
    cfg.check_experts()
    return cfg


def load_run_config(path: Path) -> tuple[RunConfig, Path]:
    """Returns the config and the resolved model directory."""
    path = Path(path)
    cfg = parse(RunConfig, read_mapping(path), str(path))
    return cfg, resolve_model_path(cfg.model, path.parent)


def resolve_model_path(model: str, base: Path) -> Path:
    if model == "builtin" or model.startswith("builtin:"):
        name = model.partition(":")[2] or "builtin"
        return builtin_model_dir(name)
    p = Path(model).expanduser()
    return p if p.is_absolute() else (base / p)


def builtin_model_dir(name: str = "builtin") -> Path:
    return Path(str(resources.files("colibri_core") / "models" / name))


def configs_dir() -> Path:
    """The shipped configs/ folder (installed as the package colibri_core.configs)."""
    return Path(str(resources.files("colibri_core.configs")))


def find_config(name_or_path: str) -> Path:
    """A path, or the name of a shipped config (`builtin` -> configs/builtin.yaml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for ext in ("", ".yaml", ".yml", ".json"):
        cand = configs_dir() / f"{name_or_path}{ext}"
        if cand.is_file():
            return cand
    shipped = sorted(q.stem for q in configs_dir().glob("*.y*ml"))
    raise ConfigError(f"config {name_or_path!r}: no such file, and not a shipped config "
                      f"(shipped: {', '.join(shipped) or 'none'})")
