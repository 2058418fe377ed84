"""Constrained decoding libraries on this CPU: per-token mask cost with a real-size vocabulary.

    python -m benchmarks.speed.bench_constraints            # llguidance, xgrammar, outlines-core
    python -m benchmarks.speed.bench_constraints --libs llguidance --tokens 400

A Qwen2-style byte-level BPE tokenizer of about 150k tokens (Qwen2's pre-tokenizer regex)
is trained offline on this Python installation's own source files (nothing downloaded;
cached in benchmarks/out/tok150k/). Each library compiles the same JSON schema (and "any
JSON object"), then walks the same token path -- a valid document tokenized by that
tokenizer -- computing the next-token mask before each token and consuming it: the work a
sampler does per token. Reported per library and grammar: compile time, and the mask's
per-token p50 / p90 / max in microseconds (one thread; each library's own mask call into a
preallocated int32 bitmask), plus numpy's cost of applying a bitmask to float32 logits.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from benchmarks.common import OUT, git_commit, machine

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "score", "active"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36,
       "email": "ada.lovelace@analytical-engine.org", "role": "admin",
       "tags": ["mathematics", "poetical science", "notes on the engine", "Bernoulli numbers"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
       "score": 98.25, "active": True}


def build_tokenizer(target: int = 151643, name: str = "tok150k") -> Path:
    """Train (or reuse) a byte-level BPE tokenizer of `target` tokens (Qwen2's
    pre-tokenizer, trained on this Python's source files); -> its tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    out = OUT / name / "tokenizer.json"
    if out.exists():
        return out
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(root + "/**/*.py", recursive=True))
    files += sorted(glob.glob(sysconfig.get_paths()["purelib"] + "/**/*.py", recursive=True))
    chosen, size = [], 0
    for f in files:
        chosen.append(f)
        size += os.path.getsize(f)
        if size > 80e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def texts():
        for f in chosen:
            with open(f, encoding="utf-8", errors="replace") as fh:
                yield fh.read()
    t0 = time.time()
    tok.train_from_iterator(texts(), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"trained a {tok.get_vocab_size()}-token BPE tokenizer on {size / 1e6:.0f} MB of "
          f"Python source in {time.time() - t0:.0f} s -> {out}", file=sys.stderr)
    return out


def _stats(us: list[float]) -> dict:
    a = np.asarray(us)
    return {"p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
            "max_us": float(a.max()), "mean_us": float(a.mean()), "n": len(a)}


def run_llguidance(tok_json: str, eos: int, n_vocab: int, grammar: dict | None, path):
    import llguidance
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=n_vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    g = llguidance.LLMatcher.grammar_from_json_schema(grammar or {"type": "object"})
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, g, log_level=0)
    t_compile = time.perf_counter() - t0
    mask = np.full((n_vocab + 31) // 32, -1, np.int32)
    ptr, nbytes = mask.ctypes.data, mask.nbytes
    us = []
    for t in path:
        a = time.perf_counter()
        m.unsafe_compute_mask_ptr(ptr, nbytes)
        us.append((time.perf_counter() - a) * 1e6)
        assert (mask[t >> 5] >> (t & 31)) & 1, "the path's token was masked"
        assert m.consume_token(t), m.get_error()
    return t_tok, t_compile, us


def run_xgrammar(tok_json: str, eos: int, n_vocab: int, grammar: dict | None, path):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json),
                                 eos_token=SPECIALS[0])
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab, stop_token_ids=[eos])
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = (comp.compile_json_schema(json.dumps(grammar)) if grammar
          else comp.compile_builtin_json_grammar())
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, n_vocab)
    us = []
    for t in path:
        a = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        us.append((time.perf_counter() - a) * 1e6)
        assert m.accept_token(t)
    return t_tok, t_compile, us


def run_outlines(tok_json: str, eos: int, n_vocab: int, grammar: dict | None, path):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = json.loads(tok_json)["model"]["vocab"]
    byte_dec = _bytes_of_bytelevel()
    tokens: dict = {}
    for s, i in vocab.items():
        if i == eos:
            continue
        tokens.setdefault(bytes(byte_dec[c] for c in s), []).append(i)
    v = oc.Vocabulary(eos, tokens)
    t_tok = time.perf_counter() - t0
    schema = json.dumps(grammar or {"type": "object"})
    t0 = time.perf_counter()
    idx = oc.Index(build_regex_from_schema(schema), v)
    t_compile = time.perf_counter() - t0
    g = oc.Guide(idx)
    mask = np.zeros((n_vocab + 31) // 32, np.int32)
    us = []
    for t in path:
        a = time.perf_counter()
        g.write_mask_into(mask.ctypes.data, mask.size, 4)
        us.append((time.perf_counter() - a) * 1e6)
        if t == eos:                        # its index has no transition on EOS
            assert g.is_finished()
            break
        g.advance(t)
    return t_tok, t_compile, us


def _bytes_of_bytelevel() -> dict:
    """GPT-2's byte <-> printable-character table, reversed (character -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


RUNNERS = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines}


def apply_cost(n_vocab: int, reps: int = 200) -> dict:
    """numpy: a bitmask onto float32 logits (unpackbits, then -inf where 0)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(n_vocab).astype(np.float32)
    mask = rng.integers(-2**31, 2**31 - 1, (n_vocab + 31) // 32, dtype=np.int64).astype(np.int32)
    us = []
    for _ in range(reps):
        a = time.perf_counter()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab]
        x = np.where(bits.view(bool), logits, -np.inf)
        us.append((time.perf_counter() - a) * 1e6)
    assert x.shape == logits.shape
    return _stats(us)


def sampler_cost(tok_path: Path, n_vocab: int, path: list, reps: int = 3) -> dict:
    """Colibri's Sampler per token along the path, free against with the schema (greedy):
    `fast` when the arg-max is a token the grammar allows (one check), `masked` when it
    is not (the mask computed and applied); alternating, medians in microseconds."""
    from colibri_core.runtime.constraints import Grammar
    from colibri_core.runtime.sampler import SamplingParams
    from colibri_core.runtime.tokenizer import Tokenizer
    tok = Tokenizer(tok_path, n_vocab)
    eos = [path[-1]]
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n_vocab).astype(np.float32)
    bad = int(tok.encode("\n")[0])       # a raw newline: never allowed in compact JSON
    out: dict = {"free": [], "fast": [], "masked": []}
    gram = Grammar.json_schema(SCHEMA)
    for _ in range(reps):
        free = SamplingParams(temperature=0.0).sampler(eos, tok, n_vocab)
        fast = SamplingParams(temperature=0.0, grammar=gram).sampler(eos, tok, n_vocab)
        masked = SamplingParams(temperature=0.0, grammar=gram).sampler(eos, tok, n_vocab)
        for t in path:
            x = base.copy()
            x[t] = 50.0
            y = x.copy()
            y[bad] = 60.0                              # the arg-max, forbidden
            for name, s, logits in (("free", free, x), ("fast", fast, x),
                                    ("masked", masked, y)):
                a = time.perf_counter()
                got = s(logits)
                out[name].append((time.perf_counter() - a) * 1e6)
                assert got == (bad if name == "free" and logits is y else t)
    return {k: float(np.median(v)) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--repeat", type=int, default=3, help="walks of the path per grammar")
    ap.add_argument("--vocab", type=int, default=151643,
                    help="the trained tokenizer's size (32000: the benchmark model's)")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer
    tok_path = build_tokenizer(args.vocab, "tok150k" if args.vocab == 151643
                               else f"tok{args.vocab // 1000}k")
    tok_json = tok_path.read_text()
    tok = Tokenizer.from_str(tok_json)
    n_vocab, eos = tok.get_vocab_size(), tok.token_to_id(SPECIALS[0])
    text = json.dumps(DOC)                 # ", " and ": ": what every library accepts
    path = tok.encode(text, add_special_tokens=False).ids + [eos]
    results = {"command": "python -m benchmarks.speed.bench_constraints "
               + " ".join(argv or sys.argv[1:]),
               "machine": machine(), "commit": git_commit(), "vocab": n_vocab,
               "path_tokens": len(path), "apply_numpy": apply_cost(n_vocab), "libs": {}}
    print(f"vocabulary {n_vocab} tokens; path {len(path)} tokens; machine {results['machine']}")
    print(f"applying a bitmask in numpy: p50 {results['apply_numpy']['p50_us']:.0f} us")
    sc = results["sampler_us"] = sampler_cost(tok_path, n_vocab, path)
    print(f"Colibri's greedy Sampler per token: free {sc['free']:.0f} us, with the schema "
          f"{sc['fast']:.0f} us (arg-max allowed: one check), {sc['masked']:.0f} us (arg-max "
          f"forbidden: mask and apply)")
    for lib in args.libs.split(","):
        for gname, grammar in (("schema", SCHEMA), ("json_object", None)):
            try:
                walks = [RUNNERS[lib](tok_json, eos, n_vocab, grammar, path)
                         for _ in range(args.repeat)]
            except Exception as e:  # noqa: BLE001 - a library that cannot run is reported
                print(f"{lib:14s} {gname:12s} failed: {type(e).__name__}: {e}")
                results["libs"][f"{lib}/{gname}"] = {"error": f"{type(e).__name__}: {e}"}
                continue
            s = _stats([u for w in walks for u in w[2]])
            r = {"tokenizer_s": min(w[0] for w in walks), "compile_s": min(w[1] for w in walks),
                 **s}
            results["libs"][f"{lib}/{gname}"] = r
            print(f"{lib:14s} {gname:12s} tokenizer {r['tokenizer_s']:.2f} s, compile "
                  f"{r['compile_s'] * 1000:8.1f} ms, mask p50 {s['p50_us']:7.1f} us p90 "
                  f"{s['p90_us']:7.1f} max {s['max_us']:8.1f}")
    out = OUT / f"bench_constraints_{n_vocab}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
