"""`colibri convert HF_DIR OUT_DIR` (a Hugging Face checkpoint -> a Colibri model, with the
tensor classes' bits) and `colibri verify HF_DIR MODEL_DIR` (the two compared)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import ColibriError
from .args import int_at_least, number_in
from .modeldir import dir_kind, require_model_dir


def tensor_bits_arg(text: str) -> dict:
    """--tensor-bits CLASS=BITS[,CLASS=BITS...] -> {class: bits} (the converter checks
    the classes and values)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        cls, eq, b = item.partition("=")
        if not eq or not b.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected CLASS=BITS, e.g. lm_head=6")
        out[cls.strip()] = int(b)
    return out


def cmd_convert(args) -> int:
    from ..convert import TOKENIZER_FILES, convert
    t0 = time.perf_counter()
    gguf_report: list = []
    gguf_in = str(args.hf_dir).endswith(".gguf")         # a GGUF file (docs/CONVERT.md, GGUF)
    kind = "hf" if gguf_in else dir_kind(Path(args.hf_dir))
    if args.tokenizer is not None and not gguf_in:
        raise ColibriError("--tokenizer DIR applies to a .gguf input; a checkpoint folder's "
                           "own tokenizer files are copied")
    if kind == "colibri":
        raise ColibriError(f"{args.hf_dir} is already a Colibri model directory; `colibri "
                           f"convert` reads a Hugging Face checkpoint (config.json with "
                           f"model_type, *.safetensors)")
    if kind in ("missing", "file", "other"):
        raise ColibriError(f"{args.hf_dir}: " + {"missing": "not found", "file": "is a file"}
                           .get(kind, "no config.json") + "; expected a Hugging Face "
                           "checkpoint folder (config.json, *.safetensors) as HF_DIR")
    cfg = convert(args.hf_dir, args.out_dir, bits=args.bits, group_size=args.group_size,
                  lm_head_bits=args.lm_head_bits, embed_bits=args.embed_bits,
                  kv_bits=args.kv_bits, tensor_bits=args.tensor_bits, q4_clip=args.q4_clip,
                  calibration=args.calibration, progress=args.progress or sys.stderr.isatty(),
                  overwrite=args.force, **({"tokenizer_dir": args.tokenizer, "report": gguf_report}
                                           if gguf_in else {}))
    q = cfg.quantization
    print(f"colibri: converted {args.hf_dir} -> {args.out_dir} ({cfg.architecture}, "
          f"{q.get('method', '?')} {q.get('bits', '?')}-bit, {len(cfg.files)} files) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    from ..convert import tensor_classes
    rows = tensor_classes(args.out_dir)
    print("colibri: tensor classes (stored bits per weight: data, scales, zero points)",
          file=sys.stderr)
    for r in rows:
        print(f"  {r['class']:<11} {r['count']:>5} x {r['formats']:<10} {r['bits']:6.2f} bits, "
              f"{r['bytes'] / 2**20:8.2f} MiB", file=sys.stderr)
    tot_b, tot_w = sum(r["bytes"] for r in rows), sum(r["weights"] for r in rows)
    print(f"  {'all':<11} {sum(r['count'] for r in rows):>5} matrices     "
          f"{8 * tot_b / max(tot_w, 1):6.2f} bits, {tot_b / 2**20:8.2f} MiB", file=sys.stderr)
    for line in gguf_report:
        print(line if line.startswith(("colibri", "  ")) else f"colibri: {line}", file=sys.stderr)
    if gguf_in:
        return 0
    copied = [n for n in TOKENIZER_FILES if n in cfg.files]
    absent = [n for n in TOKENIZER_FILES if n not in cfg.files]
    if copied:
        print(f"colibri: copied {', '.join(copied)}", file=sys.stderr)
    if absent:
        print(f"colibri: not in {args.hf_dir}: {', '.join(absent)}"
              + ("; without tokenizer.json the model runs from token ids only "
                 "(colibri run --prompt-ids 1,2,3)" if "tokenizer.json" in absent else ""),
              file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    from ..convert.verify import verify
    hf, model = Path(args.hf_dir), Path(args.model_dir)
    kinds = dir_kind(hf), dir_kind(model)
    if kinds == ("colibri", "hf"):
        raise ColibriError(f"the two folders look swapped: {hf} is a Colibri model and {model} "
                           f"a Hugging Face checkpoint; expected `colibri verify HF_DIR "
                           f"MODEL_DIR`, i.e. `colibri verify {model} {hf}`")
    if kinds[0] == "colibri":
        raise ColibriError(f"{hf} is a Colibri model directory; expected the Hugging Face "
                           f"checkpoint it was converted from as the first argument "
                           f"(`colibri verify HF_DIR MODEL_DIR`)")
    if kinds[0] in ("missing", "file", "other"):
        raise ColibriError(f"{hf}: " + {"missing": "not found",
                                        "file": "is a file"}.get(kinds[0], "no config.json")
                           + "; expected a Hugging Face checkpoint folder as HF_DIR")
    require_model_dir(model, "MODEL_DIR (a converted Colibri model)")
    res = verify(args.hf_dir, args.model_dir, args.prompts, n_new=args.n,
                 routing=args.routing, activations=args.activations)
    if args.max_error is not None and any(r.max_rel_err is not None and r.max_rel_err > args.max_error
                                          for r in res):
        raise ColibriError(f"max relative logit error above --max-error {args.max_error}")
    return 0


def add_parsers(sub) -> None:
    """`convert` and `verify`."""
    c = sub.add_parser("convert", help="convert a Hugging Face checkpoint")
    c.add_argument("hf_dir", metavar="HF_DIR",
                   help="Hugging Face checkpoint folder (config.json, *.safetensors), or a "
                        ".gguf file (a split GGUF from its first file)")
    c.add_argument("out_dir", metavar="OUT_DIR",
                   help="the Colibri model directory to write (with its tokenizer files)")
    c.add_argument("--bits", type=int, default=None, choices=[4, 8, 16, 32],
                   help="4 (default): q4 (lm_head q6, embedding and K/V q8), 8: q8, 16: the "
                        "checkpoint's own bf16/f16, 32: f32; for a .gguf input the default is "
                        "per tensor class from the file's types")
    c.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="for a .gguf input: copy the tokenizer files from DIR instead of "
                        "building tokenizer.json from the GGUF's metadata")
    c.add_argument("--group-size", type=int, default=None, dest="group_size",
                   help="quantization group size, a multiple of 64 (default 128)")
    c.add_argument("--kv-bits", type=int, choices=[4, 5, 6, 8, 16, 32], dest="kv_bits",
                   help="attention K/V projections (default 8 under --bits 4; 5: q5, 6: q6)")
    c.add_argument("--lm-head-bits", type=int, choices=[4, 5, 6, 8, 16, 32], dest="lm_head_bits",
                   help="override the lm_head's precision (default: 6, i.e. q6, under --bits 4)")
    c.add_argument("--embed-bits", type=int, choices=[4, 6, 8, 16, 32], dest="embed_bits",
                   help="override the embedding's precision (default: 8 under --bits 4; "
                        "the lm_head's when tied; 6: q6)")
    c.add_argument("--tensor-bits", type=tensor_bits_arg, dest="tensor_bits",
                   metavar="CLASS=BITS[,...]",
                   help="per tensor class: embed (4, 6, 8, 16, 32), lm_head, attn_qo, attn_kv, "
                        "dense_ffn, shared_ffn, experts (4, 5, 6, 8, 16, 32); e.g. "
                        "attn_qo=6,lm_head=6 (docs/CONVERT.md, Precision)")
    c.add_argument("--q4-clip", choices=["mse", "minmax"], dest="q4_clip",
                   help="q4 scale/zero point per group: mse (min/max or a shrunk range, "
                        "whichever has the smaller squared error) or minmax (plain RTN); "
                        "default mse, minmax with --calibration")
    c.add_argument("--calibration", metavar="FILE",
                   help="text file: AWQ activation-aware scales from the model's activations")
    c.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    c.add_argument("--force", action="store_true", help="replace an existing output directory")
    c.set_defaults(func=cmd_convert)

    v = sub.add_parser("verify", help="compare a converted model with its Hugging Face source")
    v.add_argument("hf_dir", metavar="HF_DIR", help="the Hugging Face checkpoint converted from")
    v.add_argument("model_dir", metavar="MODEL_DIR", help="the converted Colibri model directory")
    v.add_argument("--prompts", metavar="FILE", help="one prompt per line (text, or token ids)")
    v.add_argument("-n", type=int_at_least(0), default=16,
                   help="greedy tokens compared per prompt (default 16)")
    v.add_argument("--routing", choices=["fixed", "float"], default="fixed",
                   help="Colibri's expert weights: fixed-point (default) or float softmax")
    v.add_argument("--activations", choices=["int8", "float"], default="int8",
                   help="Colibri's activations: int8 per group (default) or float")
    v.add_argument("--max-error", type=number_in(0.0), dest="max_error", metavar="X",
                   help="exit non-zero when a prompt's max relative logit error exceeds this")
    v.set_defaults(func=cmd_verify)
