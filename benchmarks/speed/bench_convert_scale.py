"""The converter at scale (issue 30, item 4): a random bf16 Hugging Face checkpoint of
OLMoE-1B-7B's published shape (6.9 B parameters, about 14 GB), converted by `colibri
convert` inside a memory cgroup (limit 3 GiB, swap 0; the input's page-cache pages count
against it), timed beside llama.cpp's `convert_hf_to_gguf.py` (bf16 GGUF) + `llama-quantize`
Q4_0 on the same checkpoint.

    python -m benchmarks.speed.bench_convert_scale [--limit-gib 3] [--dir D] [--keep]
    python -m benchmarks.speed.bench_convert_scale --small      # the same path, tiny dims

The checkpoint is written shard by shard with `safetensors` (shards of at most 5 GB, as the
published checkpoint's, so that a converter reading a whole shard cannot fit under the
limit), from torch's random bf16 numbers; it is never instantiated in transformers. Its
tensor names are transformers' OlmoeForCausalLM names (`--small` checks them against a
tiny transformers model). A synthetic byte-level BPE tokenizer is written beside it (the
real one is not needed to time weights). llama.cpp's script recognises a tokenizer by the
hash of its output on a fixed text, which a synthetic one cannot match, so it runs with
that lookup answering "olmo" (OLMoE's pre-tokenizer); nothing else of the script changes.

Each step runs in its own cgroup (benchmarks/robustness/cgroups.py) with the same limit;
memory.peak, time, rc and OOM kills are recorded with the output's size. Disk: the
checkpoint, then one output at a time (the Colibri model is deleted before llama.cpp runs,
the bf16 GGUF after quantizing); `--keep` keeps the checkpoint (it is deleted by default).
Writes benchmarks/out/convert_scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, REPO, git_commit, machine
from benchmarks.peers import _llamacpp_tools as lt
from benchmarks.robustness.cgroups import Cgroup, _kv
from benchmarks.speed._realscale_models import DEFAULT_DIR, SHAPES, check_written

SHARD_BYTES = 5 * 10**9                  # transformers' max_shard_size="5GB"
SPARE_DISK = 10 << 30
SMALL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512,
             eos_token_id=256, pad_token_id=257)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def hf_config(small: bool) -> dict:
    c = dict(SHAPES["olmoe-1b-7b"], torch_dtype="bfloat16")
    c.update(SMALL if small else {})
    return c


def tensor_shapes(c: dict):
    """(name, shape) of OlmoeForCausalLM's state dict, in the published checkpoint's order."""
    H, I, E, V = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (H // c["num_attention_heads"])
    yield "model.embed_tokens.weight", (V, H)
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        yield p + "self_attn.q_proj.weight", (H, H)
        yield p + "self_attn.k_proj.weight", (kv, H)
        yield p + "self_attn.v_proj.weight", (kv, H)
        yield p + "self_attn.o_proj.weight", (H, H)
        yield p + "self_attn.q_norm.weight", (H,)
        yield p + "self_attn.k_norm.weight", (kv,)
        yield p + "mlp.gate.weight", (E, H)
        for e in range(E):
            for m, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                yield f"{p}mlp.experts.{e}.{m}.weight", s
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
    yield "model.norm.weight", (H,)
    yield "lm_head.weight", (V, H)


def checkpoint_bytes(c: dict) -> int:
    n = 0
    for _, s in tensor_shapes(c):
        k = 1
        for d in s:
            k *= d
        n += 2 * k
    return n


def write_tokenizer(d: Path) -> None:
    """A byte-level BPE over the 256 bytes plus two special tokens (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|padding|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
         "pad_token": "<|padding|>", "add_bos_token": False}))


def write_checkpoint(out: Path, small: bool, seed: int = 0) -> Path:
    """The random bf16 checkpoint, shard by shard (at most SHARD_BYTES held at once)."""
    import torch
    from safetensors.torch import save_file
    c = hf_config(small)
    if (out / "model.safetensors.index.json").exists():
        return out
    need = checkpoint_bytes(c)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need + (0 if small else SPARE_DISK):
        raise SystemExit(f"{out.parent}: {free / 2**30:.1f} GiB free, the checkpoint needs "
                         f"{need / 2**30:.1f} GiB + {SPARE_DISK >> 30} GiB spare")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    g = torch.Generator().manual_seed(seed)
    shards, cur, size, t0 = [], {}, 0, time.time()
    names = list(tensor_shapes(c))

    def flush():
        nonlocal cur, size
        if cur:
            shards.append(cur)
            save_file(cur, str(tmp / f"shard-{len(shards)}.safetensors"), {"format": "pt"})
            log(f"  shard {len(shards)}: {len(cur)} tensors, {size / 1e9:.2f} GB "
                f"({time.time() - t0:.0f} s)")
            shards[-1] = list(cur)
            cur, size = {}, 0

    for name, shape in names:
        n = 2
        for d in shape:
            n *= d
        if size + n > SHARD_BYTES:
            flush()
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:        # N(0, 1/fan_in): activations keep their scale through every product
            t = (torch.randn(shape, generator=g) * shape[1] ** -0.5).to(torch.bfloat16)
        cur[name], size = t, size + n
    flush()
    k = len(shards)
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{k:05d}.safetensors"
        os.replace(tmp / f"shard-{i}.safetensors", tmp / final)
        weight_map.update({t: final for t in tensors})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": need}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(c, indent=1))
    write_tokenizer(tmp)
    check_written(sorted(tmp.glob("*.safetensors")))
    os.replace(tmp, out)
    log(f"{out}: written in {time.time() - t0:.0f} s, {need / 1e9:.2f} GB in {k} shards")
    return out


def dir_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def run_limited(name: str, cmd: list, limit: int, timeout: int) -> dict:
    """`cmd` in a fresh memory cgroup (swap 0); its output passes through (progress)."""
    cg = Cgroup.create(f"convscale-{os.getpid()}-{time.time_ns() % 10**9}", limit)
    t0, anon = time.time(), [0]
    stat = (cg.memory_dir / "memory.stat") if cg.memory_dir is not None else None
    try:
        p = subprocess.Popen(cmd, cwd=REPO, preexec_fn=cg.enter)
        while True:              # memory.peak counts page cache; sample the process memory
            try:
                rc = p.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.time() - t0 > timeout:
                    p.kill()
                    p.wait()
                    rc = "timeout"
                    break
            st = _kv(stat) if stat is not None else {}
            anon[0] = max(anon[0], st.get("rss", st.get("anon", 0)) + st.get("mapped_file", 0))
        r = cg.result()
    finally:
        cg.close()
    row = {"step": name, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "memory_peak_mib": (r.get("memory_peak") or 0) / 2**20 if r.get("cgroup") else None,
           "memory_limit_mib": limit / 2**20, "rss_peak_mib": anon[0] / 2**20, "oom_kills": r.get("oom_kill") or 0,
           "limit_hits": r.get("limit_hits"), "cgroup": r.get("cgroup"),
           "cgroup_why": r.get("cgroup_why"), "memory_stat": r.get("memory_stat")}
    if r.get("memsw_peak") is not None and r.get("memory_peak") is not None:
        row["swap_peak_mib"] = max(0, r["memsw_peak"] - r["memory_peak"]) / 2**20
    log(f"  {name}: rc {rc}, {row['wall_s']} s, memory.peak "
        f"{row['memory_peak_mib'] or 0:.0f} MiB (process memory {row['rss_peak_mib']:.0f} MiB), "
        f"OOM kills {row['oom_kills']}")
    return row


# llama.cpp's script, with the tokenizer-hash lookup answering OLMoE's pre-tokenizer name.
_LLAMA_WRAPPER = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as b
for c in vars(b).values():
    if isinstance(c, type) and "get_vocab_base_pre" in vars(c):
        c.get_vocab_base_pre = lambda self, tokenizer: "olmo"
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_steps(ck: Path, work: Path, limit: int, timeout: int) -> list[dict]:
    try:                                  # built on demand (6-11 minutes), then cached
        quant = lt.ensure_tools(("llama-quantize",))["llama-quantize"]
    except RuntimeError as e:
        return [{"step": "llama.cpp", "skipped": str(e)[:200]}]
    src = lt.source_dir()
    bf16, q4 = work / "olmoe-bf16.gguf", work / "olmoe-q4_0.gguf"
    rows = []
    r = run_limited("llama.cpp convert_hf_to_gguf (bf16)",
                    [sys.executable, "-c", _LLAMA_WRAPPER, str(src), str(ck), "--outtype", "bf16",
                     "--outfile", str(bf16)], limit, timeout)
    r["output_bytes"] = bf16.stat().st_size if bf16.exists() else None
    rows.append(r)
    if r["rc"] == 0:
        r = run_limited("llama-quantize Q4_0", [str(quant), str(bf16), str(q4), "Q4_0",
                                                str(os.cpu_count() or 1)], limit, timeout)
        r["output_bytes"] = q4.stat().st_size if q4.exists() else None
        rows.append(r)
    for f in (bf16, q4):
        f.unlink(missing_ok=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--limit-gib", type=float, default=3.0)
    ap.add_argument("--small", action="store_true", help="tiny dims: the same path in seconds")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--no-llama", action="store_true", help="Colibri's conversion only")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per step")
    a = ap.parse_args(argv)
    name = "olmoe-1b-7b-hf" + ("-small" if a.small else "")
    ck, limit = a.dir / name, int(a.limit_gib * 2**30)
    t0 = time.time()
    write_checkpoint(ck, a.small)
    written_s = time.time() - t0
    if a.small:
        check_names(ck)
    out = a.dir / (name + "-colibri")
    shutil.rmtree(out, ignore_errors=True)
    log(f"colibri convert {ck} -> {out} (memory.max {a.limit_gib} GiB, swap 0) ...")
    rows = [run_limited("colibri convert (q4)", [sys.executable, "-m", "colibri_core", "convert",
                                                 str(ck), str(out), "--progress"],
                        limit, a.timeout)]
    rows[0]["output_bytes"] = dir_bytes(out) if out.exists() else None
    rows[0]["output_files"] = len(list(out.iterdir())) if out.exists() else None
    shutil.rmtree(out, ignore_errors=True)
    if not a.no_llama:
        log("llama.cpp: convert_hf_to_gguf.py (bf16) + llama-quantize Q4_0, same limit ...")
        rows += llama_steps(ck, a.dir, limit, a.timeout)
    result = {"checkpoint": str(ck), "checkpoint_bytes": dir_bytes(ck),
              "checkpoint_written_s": round(written_s, 1), "limit_gib": a.limit_gib,
              "steps": rows, "loadavg": os.getloadavg(), "machine": machine(),
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not a.keep:
        shutil.rmtree(ck, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("convert_scale" + ("_small" if a.small else "") + ".json")).write_text(
        json.dumps(result, indent=1, default=str))
    print(f"checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB (bf16), limit "
          f"{a.limit_gib} GiB, swap 0, load {os.getloadavg()[0]:.1f}")
    print("| step | rc | time s | memory.peak MiB (page cache incl.) | process memory peak MiB "
          "(sampled) | OOM kills | output GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['step']} | skipped: {r['skipped']} | | | | | |")
            continue
        ob = r.get("output_bytes")
        print(f"| {r['step']} | {r['rc']} | {r['wall_s']} | {r['memory_peak_mib'] or 0:.0f} | "
              f"{r['rss_peak_mib']:.0f} | {r['oom_kills']} | {ob / 1e9 if ob else 0:.3f} |")
    if any(r.get("rc") not in (0, None) for r in rows):
        raise SystemExit(1)


def check_names(ck: Path) -> None:
    """transformers loads the written checkpoint with no missing and no unexpected tensor
    (tiny dims only: the full model would not fit in memory in float32). transformers 5
    fuses the experts on load; the published checkpoint, like this one, stores them one by
    one."""
    from transformers import AutoModelForCausalLM
    _, info = AutoModelForCausalLM.from_pretrained(ck, output_loading_info=True)
    bad = {k: sorted(v)[:3] for k, v in info.items() if v and k != "error_msgs"}
    if bad or info.get("error_msgs"):
        raise SystemExit(f"{ck}: transformers does not load it as written: {bad or info}")


if __name__ == "__main__":
    main()
