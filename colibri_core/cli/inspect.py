"""`colibri inspect MODEL_DIR [--verify]`: describe a model directory; with --verify check
every file's sha256 and every section for NaN/Inf."""
from __future__ import annotations

from ..errors import ColibriError
from .modeldir import require_model_dir


def cmd_inspect(args) -> int:
    from ..kernels import mapguard  # noqa: F401 - every mapping under the SIGBUS guard (a file
    #                         truncated while --verify reads it is reported, not fatal)
    from ..model.weights import load_model, verify_checksums
    path = require_model_dir(args.model_dir)
    w = load_model(path)          # validates sizes, tables and shapes
    cfg = w.cfg
    total = sum(f.size for f in w.files)
    print(f"{path}: {cfg.architecture}, format {cfg.format.major}.{cfg.format.minor}")
    print(f"  layers {cfg.num_layers}: " + "".join("D" if t == "dense" else "M" for t in cfg.layer_types)
          + f"  (D dense, M MoE)")
    print(f"  hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_size}, "
          f"vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}")
    if cfg.moe_layers:
        print(f"  experts {cfg.num_experts} x {cfg.expert_intermediate}, top_k {cfg.top_k}, "
              f"scoring {cfg.scoring_func}, norm_topk_prob {cfg.norm_topk_prob}, shared "
              f"{cfg.shared_expert_intermediate_size or 'none'}")
    print(f"  files {len(w.files)}, {total / 2**20:.2f} MiB")
    main = w.files[0]
    for s in main.sections.values():
        if s.name in ("embed", "lm_head") or s.name.startswith("layer.0."):
            g = f" g{s.group_size}" if s.group_size else ""
            print(f"    {s.name:24s} {s.dtype}{g} {list(s.shape)}")
    w.close()
    if args.verify:
        from ..format.validate import scan_model_dir
        problems = verify_checksums(path)            # sha256 of every file
        values = scan_model_dir(path)                # NaN/Inf in any section
        for p in problems + values:
            print(f"  FAIL {p}")
        if problems or values:
            raise ColibriError(f"{path}: verification failed: {len(problems)} file(s) do not "
                               f"match their sha256, {len(values)} section(s) hold NaN/Inf "
                               f"or bad scales (details above)")
        print(f"  verify: all {len(cfg.files)} files match their sha256; no NaN/Inf in any "
              f"section")
    return 0


def add_parser(sub) -> None:
    """`inspect`."""
    i = sub.add_parser("inspect", help="describe (and optionally verify) a model directory")
    i.add_argument("model_dir", metavar="MODEL_DIR", help="a converted Colibri model directory")
    i.add_argument("--verify", action="store_true",
                   help="check every file's sha256 and every section for NaN/Inf")
    i.set_defaults(func=cmd_inspect)
