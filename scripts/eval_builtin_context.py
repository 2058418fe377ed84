#!/usr/bin/env python3
"""Does the built-in model use its context?  Held-out perplexity by position, on Colibri.

Windows of `context + 1` tokens, 256 tokens apart, are cut from the held-out split of the
corpus the model was trained on (scripts/builtin_corpus.py); each is scored in one forward pass, and the
perplexity is reported for the predictions made at positions 0-255 (little context) and
at the last 256 positions (up to a full context), then for the same last positions
scored again with their context cut to the last 256 tokens.  A model that uses its
context has the middle figure no worse than the first and lower than the third.

    python scripts/eval_builtin_context.py --cut-every 4    # every 4th cut position (minutes)
    python scripts/eval_builtin_context.py                  # every position (longer)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from builtin_corpus import build_corpus, encode_stream, split_docs  # noqa: E402

SPAN = 256  # positions per reported range, and the cut context


def heldout_windows(engine, n_windows: int | None = None, stride: int = SPAN) -> np.ndarray:
    """[n, context + 1] token windows of the held-out split, `stride` apart. At the
    default stride every 256-token stretch of the text is scored once among the first
    positions of a window and once among the last, so the two figures compare the same
    text with little and with much context (not easier text with harder)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.model_dir / "tokenizer.json"))
    _, val_docs = split_docs(build_corpus())
    stream = encode_stream(tok, val_docs, eos_id=tok.token_to_id("<|endoftext|>"))
    ctx = engine.model_cfg.max_position_embeddings
    starts = list(range(0, len(stream) - ctx - 1, stride))[:n_windows]
    return np.stack([stream[s:s + ctx + 1] for s in starts]).astype(np.int64)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    from colibri_core.model.ops import log_softmax

    return -log_softmax(logits)[np.arange(len(targets)), targets]


def context_figures(engine, windows: np.ndarray, cut_every: int = 1, batch: int = 64) -> dict:
    """Perplexities {'first', 'last', 'last_cut'} and the positions they cover. A model
    with a BOS token sees it first, as a prompt of text would: a window is BOS + its
    tokens, a cut context BOS + the 255 tokens before the predicted one."""
    ctx = windows.shape[1] - 1
    bos = engine.model_cfg.bos_token_id
    lead = [] if bos is None else [bos]
    n = ctx - len(lead)                          # window tokens that fit beside the BOS
    last = np.arange(n - SPAN, n)[::cut_every]   # predictions from these window positions
    nll_first, nll_last, nll_cut = [], [], []
    for w in windows:
        w = w[:n + 1]
        logits = engine.score_batch([lead + w[:n].tolist()], all_positions=True)[0][len(lead):]
        full = _nll(logits, w[1:])
        nll_first.append(full[:SPAN])
        nll_last.append(full[last])
        keep = SPAN - len(lead)
        cut = [lead + w[p - keep + 1:p + 1].tolist() for p in last]   # 256 tokens in all
        for i in range(0, len(cut), batch):
            out = engine.score_batch(cut[i:i + batch])
            nll_cut.append(_nll(np.stack(out), w[last[i:i + batch] + 1]))

    def ppl(parts):
        return float(math.exp(np.concatenate(parts).mean()))

    return {"first": ppl(nll_first), "last": ppl(nll_last), "last_cut": ppl(nll_cut),
            "windows": len(windows), "context": ctx, "last_positions": (int(last[0]), int(last[-1])),
            "cut_every": cut_every}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="builtin", help="a shipped config name or a config file")
    ap.add_argument("--windows", type=int, default=None, help="at most this many windows (default all)")
    ap.add_argument("--cut-every", type=int, default=1, help="score every Nth of the last positions cut")
    args = ap.parse_args(argv)

    from colibri_core.engine import Engine

    t0 = time.time()
    with Engine.from_config(args.config) as eng:
        windows = heldout_windows(eng, args.windows)
        f = context_figures(eng, windows, args.cut_every)
    a, b = f["last_positions"]
    print(f"held-out perplexity, {f['windows']} windows of {f['context']} positions "
          f"({time.time() - t0:.0f} s):")
    print(f"  positions 0-{SPAN - 1}, full context:            {f['first']:.2f}")
    print(f"  positions {a}-{b}, full context:      {f['last']:.2f}")
    print(f"  positions {a}-{b}, context cut to {SPAN}: {f['last_cut']:.2f}"
          + (f" (every {args.cut_every}th position)" if args.cut_every > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
