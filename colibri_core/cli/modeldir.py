"""Which model a command runs: what a folder holds (a Colibri model, a Hugging Face
checkpoint, ...), a one-line error naming what to do when it is not a model directory, and
the engine from --config / --model and the engine options."""
from __future__ import annotations

from pathlib import Path

from ..errors import ColibriError


def dir_kind(path: Path) -> str:
    """What a folder holds: "colibri" (a Colibri model: config.json with `format`/`files`),
    "hf" (a Hugging Face checkpoint: config.json with `model_type`, or *.safetensors),
    "missing", "file", or "other". A config.json that is there but not a regular file
    (a FIFO, a device, a folder) raises ConfigError naming it: it is never waited on."""
    from ..errors import ConfigError
    from ..files import check_regular, read_text
    from ..nesting import json_loads
    try:
        if not path.exists():
            return "missing"
        if not path.is_dir():
            return "file"
        cfg = path / "config.json"
        cfg_there = cfg.exists()
    except OSError as e:            # a folder we may not search (mode 000): say so
        raise ConfigError(f"{path}: cannot read the folder: {e.strerror}") from None
    data = None
    if cfg_there:
        check_regular(cfg, cfg.stat(), ConfigError)
        try:
            data = json_loads(read_text(cfg, ConfigError))
        except (ColibriError, ValueError):
            return "colibri"          # a damaged model: let the loader name the problem
    if isinstance(data, dict) and ("format" in data or "files" in data):
        return "colibri"
    if isinstance(data, dict) and ("model_type" in data or "architectures" in data):
        return "hf"
    if data is None and any(path.glob("*.safetensors")):
        return "hf"
    return "colibri" if data is not None else "other"


def require_model_dir(path, what: str = "model directory") -> Path:
    """A Colibri model directory, or a one-line ColibriError saying what `path` is instead
    and what to do (convert a checkpoint, or the model folder found inside it)."""
    path = Path(path)
    kind = dir_kind(path)
    if kind == "colibri":
        return path
    if kind == "missing":
        raise ColibriError(f"{path}: {what} not found")
    if kind == "file":
        raise ColibriError(f"{path}: is a file; expected a Colibri {what} (a folder with "
                           f"config.json and the model's .bin files)")
    if kind == "hf":
        raise ColibriError(f"{path} is a Hugging Face checkpoint, not a Colibri model "
                           f"directory; convert it with `colibri convert {path} OUT_DIR`")
    inside = sorted(str(c.parent) for c in path.glob("*/config.json")
                    if dir_kind(c.parent) == "colibri")[:3]
    hint = (f"did you mean {' or '.join(inside)}?" if inside else
            "convert a Hugging Face checkpoint with `colibri convert HF_DIR OUT_DIR`")
    raise ColibriError(f"{path} is not a Colibri model directory (no config.json); {hint}")


def engine_from_args(args):
    from ..config import EngineConfig, find_config, load_run_config, parse
    from ..engine import Engine
    overrides = {}
    if args.threads is not None:
        overrides["threads"] = args.threads
    if getattr(args, "load_mode", None):
        overrides["load_mode"] = args.load_mode
    if getattr(args, "routing", None):
        overrides["routing"] = args.routing
    if getattr(args, "activations", None):
        overrides["activations"] = args.activations
    if getattr(args, "plugins_dir", None):
        overrides["plugins_dir"] = args.plugins_dir
    if getattr(args, "experts_dir", None):
        overrides["experts_dir"] = args.experts_dir
    if getattr(args, "debug", None):
        overrides["debug"] = args.debug
    # one limit from the command line replaces the config file's of either kind
    if getattr(args, "max_resident_mb", None) is not None:
        overrides["max_resident_mb"] = args.max_resident_mb
        overrides["process_limit_mb"] = None
    if getattr(args, "process_limit_mb", None) is not None:
        overrides["process_limit_mb"] = args.process_limit_mb
        overrides["max_resident_mb"] = None
    if getattr(args, "kv_dtype", None):
        overrides["kv_dtype"] = args.kv_dtype
    from ..server.serve import speculation_overrides
    speculation_overrides(args, overrides)
    if args.model:
        base = EngineConfig()
        model_dir = require_model_dir(args.model)
    else:
        path = find_config(args.config or "builtin")
        if path.is_dir() and dir_kind(path) != "colibri":
            raise ColibriError(f"--config {args.config}: is a folder; expected a run config "
                               f"file (YAML/JSON with `model:` and `engine:`) or a shipped "
                               f"config's name")
        if path.is_dir() or path.name == "config.json" and dir_kind(path.parent) == "colibri":
            model = path if path.is_dir() else path.parent
            raise ColibriError(f"--config {args.config}: this is a model "
                               f"{'directory' if path.is_dir() else 'config.json'}, not a run "
                               f"config (YAML/JSON with `model:` and `engine:`); run it with "
                               f"--model {model}")
        cfg, model_dir = load_run_config(path)
        base = cfg.engine
    res = {}
    if getattr(args, "expert_cache", None):
        res["policy"] = args.expert_cache
    if getattr(args, "speculative", False):
        res["speculative"] = True
    if res:
        overrides["residency"] = {**base.residency.model_dump(), **res}
    engine_cfg = parse(EngineConfig, {**base.model_dump(), **overrides}, "command line")
    return Engine(model_dir, engine_cfg)
