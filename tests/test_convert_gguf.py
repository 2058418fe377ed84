"""GGUF files in (issue 33): `colibri convert model.gguf OUT_DIR`.

Every file under tests/data/gguf/ was written by llama.cpp's own tools (convert_hf_to_gguf.py,
llama-quantize; tests/data/gguf/remake.py remakes them) from tiny random transformers models,
and `<case>.npz` holds, per prompt, transformers' float32 logits (`hf_<i>`) and llama.cpp's
logits for each file (`<type>__<i>`, libllama). Nothing here compares against numbers made
by Colibri: a wrong name map, a missed q/k permutation or a wrong config field cannot pass.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from colibri_core.convert import convert, tensor_classes  # noqa: E402
from colibri_core.errors import ConfigError  # noqa: E402

DATA = Path(__file__).parent / "data" / "gguf"
FAMILY_CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                "granitemoe", "granitemoeshared", "glm4_moe", "ernie4_5_moe", "llama4")


def _engine(out):
    from colibri_core.engine import Engine
    return Engine.from_model_dir(out, routing="float", activations="float")


def _prompts(case: str):
    d = np.load(DATA / f"{case}.npz")
    n = len([k for k in d.files if k.startswith("ids_")])
    return d, n


def _logits(out, d, n) -> list[np.ndarray]:
    with _engine(out) as eng:
        return [np.asarray(eng.next_token_logits(d[f"ids_{i}"].tolist(), all_positions=True),
                           np.float64) for i in range(n)]


def max_rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def token_error(a: list, ref: list) -> float:
    """The logit error of a model: the median over every position of every prompt of
    the position's relative RMS error (RMS of a - ref over the vocabulary / RMS of ref over
    the prompt). The median, not the mean: on these tiny random models a weight error
    flips a near-tied expert choice at one position in tens (both llama.cpp's and ours),
    which moves that position's logits by 0.1-0.4 and would make a mean a coin toss."""
    errs = []
    for x, r in zip(a, ref):
        x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
        errs.append(np.sqrt(((x - r) ** 2).mean(axis=1) / (r ** 2).mean()))
    return float(np.median(np.concatenate(errs)))


def _f32_file(case: str) -> str:
    split = sorted(DATA.glob(f"{case}-F32-00001-of-*.gguf"))
    return split[0].name if split else f"{case}-F32.gguf"


def _convert(name: str, tmp_path, **kw):
    out = tmp_path / name.replace(".gguf", "")
    report: list = []
    cfg = convert(DATA / name, out, bits=kw.pop("bits", None), report=report, **kw)
    return out, cfg, report


@pytest.mark.parametrize("case", FAMILY_CASES + ("phimoe", "llama4_rope"))
def test_f32_gguf_matches_transformers(case, tmp_path):
    """An F32 GGUF converts to f32 sections and runs within 1e-4 (max relative logit error)
    of transformers on the model llama.cpp's converter read."""
    out, cfg, _ = _convert(_f32_file(case), tmp_path)      # qwen3_moe: a split GGUF
    assert {r["formats"] for r in tensor_classes(out)} == {"f32"}
    d, n = _prompts(case)
    got = _logits(out, d, n)
    errs = [max_rel(got[i], d[f"hf_{i}"]) for i in range(n)]
    llama = [max_rel(d[f"F32__{i}"], d[f"hf_{i}"]) for i in range(n)]
    print(f"{case} F32: max rel logit error vs transformers {max(errs):.2e} (llama.cpp on the "
          f"same file {max(llama):.2e})")
    assert max(errs) <= 1e-4, errs


def test_llama_qk_permutation_is_undone(tmp_path, monkeypatch):
    """Mixtral's q/k rows are stored permuted by llama.cpp; without undoing it the logits
    are far off (the 1e-4 above is not reachable by accident)."""
    from colibri_core.convert import gguf_families as gf
    real = gf.unpermute
    monkeypatch.setattr(gf, "unpermute", lambda a, op, m: a if op in ("q", "k") else real(a, op, m))
    out, _, _ = _convert("mixtral-F32.gguf", tmp_path)
    d, n = _prompts("mixtral")
    got = _logits(out, d, n)
    assert max(max_rel(got[i], d[f"hf_{i}"]) for i in range(n)) > 1e-2


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_16_bit_gguf_kept(kind, tmp_path):
    """F16 / BF16 tensors are copied bit for bit (the class stays 16-bit) and the logits are
    as close to transformers as llama.cpp's own on the same file."""
    import gguf
    out, _, report = _convert(f"mixtral_types-{kind}.gguf", tmp_path)
    rows = {r["class"]: r for r in tensor_classes(out)}
    assert {r["formats"] for r in rows.values()} == {kind.lower()}
    from colibri_core.format.modelfile import ContainerFile
    f = ContainerFile(out / "model.bin")
    try:
        emb = np.array(f.tensor("embed"))
    finally:
        f.close()
    rd = gguf.GGUFReader(str(DATA / f"mixtral_types-{kind}.gguf"))
    t = next(t for t in rd.tensors if t.name == "token_embd.weight")
    assert np.array_equal(emb.view(np.uint16).ravel(), np.asarray(t.data).view(np.uint16).ravel())
    d, n = _prompts("mixtral_types")
    got = _logits(out, d, n)
    ours = token_error(got, [d[f"hf_{i}"] for i in range(n)])
    llama = token_error([d[f"{kind}__{i}"] for i in range(n)], [d[f"hf_{i}"] for i in range(n)])
    print(f"mixtral {kind}: logit error {ours:.2e}, llama.cpp {llama:.2e}")
    assert ours <= 1.15 * llama
    assert any("kept" in line for line in report)


# deepseek_v2_yarn: YaRN from rope.scaling.* (mscale from yarn_log_multiplier) and
# group-limited routing; without the YaRN fields its logit error is 0.080, not 0.016
QUANT_CASES = [(c, "Q8_0") for c in FAMILY_CASES + ("deepseek_v2_yarn",)] + [
    ("mixtral_types", "Q4_0"), ("mixtral_types", "MXFP4_MOE"), ("mixtral_types", "Q4_1")]


@pytest.mark.parametrize("case,kind", QUANT_CASES, ids=[f"{c}-{k}" for c, k in QUANT_CASES])
def test_quantized_gguf_requantized(case, kind, tmp_path):
    """Q8_0 / Q4_0 / Q4_1 files: requantized (q8 / q4 g128) at no more bits per weight per
    class than the GGUF had (on matrices at least one group wide), with a logit error
    against transformers (token_error) within 1.5x llama.cpp's own on the
    same file."""
    out, cfg, report = _convert(f"{case}-{kind}.gguf", tmp_path)
    d, n = _prompts(case)
    got = _logits(out, d, n)
    ref = [d[f"hf_{i}"] for i in range(n)]
    ours = token_error(got, ref)
    llama = token_error([d[f"{kind}__{i}"] for i in range(n)], ref)
    print(f"{case} {kind}: logit error {ours:.4f}, llama.cpp {llama:.4f}, "
          f"ratio {ours / llama:.2f}")
    rec = cfg.quantization["gguf"]["classes"]
    for r in tensor_classes(out):
        assert r["formats"].split()[0] in ("q8", "q6", "q4"), r
    assert ours <= 1.5 * llama
    assert rec and any("requantized" in line for line in report)


def test_phimoe_q8_0_follows_transformers(tmp_path):
    """Phi-3.5-MoE: llama.cpp's phimoe graph is not transformers' (softmax top-2 routing in
    place of the sparse mixer, RMS norms; 0.42 logit error on its own F32 file), so its
    logits are no bound here: the Q8_0 file runs as transformers runs the model, at the
    other families' Q8_0 error (0.007 .. 0.016), far below llama.cpp's on the same file."""
    out, _, _ = _convert("phimoe-Q8_0.gguf", tmp_path)
    d, n = _prompts("phimoe")
    ref = [d[f"hf_{i}"] for i in range(n)]
    ours = token_error(_logits(out, d, n), ref)
    llama = token_error([d[f"Q8_0__{i}"] for i in range(n)], ref)
    print(f"phimoe Q8_0: logit error {ours:.4f}, llama.cpp {llama:.4f}")
    assert ours <= 0.02 and ours < 0.1 * llama


def test_llama4_rope_freqs_recovered():
    """llama.cpp keeps llama3 rope scaling only as per-frequency factors (rope_freqs.weight);
    the parameters come back from them: those remake.py's llama4_rope model was made with."""
    import gguf
    from colibri_core.convert import gguf_families as gf
    rd = gguf.GGUFReader(str(DATA / "llama4_rope-F32.gguf"))
    f = np.asarray(next(t for t in rd.tensors if t.name == "rope_freqs.weight").data, np.float64)
    assert 1.0 < f.max() and ((f > 1) & (f < f.max())).sum() == 2     # two in the blend band
    rs = gf.llama3_from_factors(f, 10000.0, None, "x.gguf")
    assert rs == dict(rope_type="llama3", factor=16.0, original_max_position_embeddings=4096,
                      low_freq_factor=1.0, high_freq_factor=8.0)
    # Scout's kind: low = high = 1, no blend band (1 below the context's wavelength, 16 above)
    wl = 2 * np.pi * 500000.0 ** (np.arange(0, 128, 2) / 128)
    scout = gf.llama3_from_factors(np.where(wl > 8192, 16.0, 1.0), 500000.0, None, "x.gguf")
    assert scout == dict(rope_type="llama3", factor=16.0, original_max_position_embeddings=8192,
                         low_freq_factor=1.0, high_freq_factor=1.0)


def test_llama4_rope_freqs_that_fit_no_llama3_refused(tmp_path):
    """Factors no llama3 parameters give back are refused in one line naming the tensor,
    and nothing is written: a third blend-band factor off the line the other two give (a
    fit alone finds parameters for it; the recomputed factors do not match)."""
    import gguf
    src = tmp_path / "bad.gguf"
    shutil.copy(DATA / "llama4_rope-F32.gguf", src)
    rd = gguf.GGUFReader(str(src), "r+")
    t = next(t for t in rd.tensors if t.name == "rope_freqs.weight")
    t.data[6] = 12.0                                   # 16 in the file
    rd.data.flush()
    del rd, t
    with pytest.raises(ConfigError, match=r"bad.gguf: GGUF rope_freqs.weight \(8 factors, "
                                          r"largest 16\) fits no llama3 rope parameters") as e:
        convert(src, tmp_path / "out", bits=None)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


KQ_CASES = [("mixtral_kq", "Q4_K_M"), ("qwen3_moe_kq", "Q4_K_M"), ("mixtral_kq5", "Q5_K_M"),
            ("mixtral_kq5", "Q6_K"), ("qwen3_moe_kq_tied", "Q4_K_M")]
# what the K-quant classes become (the headroom's moves aside): q5 for Q5_K's 5.5 bits and
# the Q5_K_M experts' 5.85, q6 for Q6_K's 6.56 (FFNs included)
KQ_FORMATS = {("mixtral_kq5", "Q5_K_M"): {"experts": "q5 g64", "attn_qo": "q5 g128"},
              ("mixtral_kq5", "Q6_K"): {"experts": "q6 g128", "attn_qo": "q6 g128"},
              ("mixtral_kq", "Q4_K_M"): {"experts": "q4 g64", "attn_kv": "q5 g64"}}


@pytest.mark.parametrize("case,kind", KQ_CASES, ids=[f"{c}-{k}" for c, k in KQ_CASES])
def test_k_quants_requantized_within_bits_and_error(case, kind, tmp_path):
    """Q4_K_M (Q4_K + Q6_K), Q5_K_M (Q5_K + Q6_K) and Q6_K files, widths multiples of 256
    so that llama-quantize kept every K-quant: every class stored at no more bits per weight
    than the GGUF's class, except those that took the model's headroom (embedding, then
    attention), the whole model at no more than the GGUF's, and the logit error against
    the F32 reference (transformers) within 1.5x llama.cpp's own error on the same file
    (Q5_K_M 1.34x: its experts are q5 g64; before q5 they were q4 g64 and it was 1.57x).
    qwen3_moe_kq_tied: tied embeddings (no output.weight), stored once."""
    out, cfg, report = _convert(f"{case}-{kind}.gguf", tmp_path)
    rec = cfg.quantization["gguf"]["classes"]
    up = cfg.quantization["gguf"].get("headroom", {})
    assert {t for c in rec.values() for t in c["types"]} >= {kind[:4], "Q6_K"}
    rows = tensor_classes(out)
    fmt = {r["class"]: r["formats"] for r in rows}
    assert {c: fmt[c] for c in KQ_FORMATS.get((case, kind), {})} == KQ_FORMATS.get((case, kind), {})
    for r in rows:
        if r["class"] not in up:
            assert r["bits"] <= rec[r["class"]]["bits"] + 1e-9, (r, rec[r["class"]])
    w = {r["class"]: sum(rec[r["class"]]["types"].values()) for r in rows}
    ours = 8 * sum(r["bytes"] for r in rows) / sum(r["weights"] for r in rows)
    gguf_bits = sum(rec[c]["bits"] * w[c] for c in w) / sum(w.values())
    assert ours <= gguf_bits + 1e-9
    assert ("embed" in up) != cfg.tie_word_embeddings       # tied: the lm_head's format
    d, n = _prompts(case)
    got = _logits(out, d, n)
    ref = [d[f"hf_{i}"] for i in range(n)]
    err = token_error(got, ref)
    llama = token_error([d[f"{kind}__{i}"] for i in range(n)], ref)
    print(f"{case} {kind}: logit error {err:.4f}, llama.cpp {llama:.4f}, ratio "
          f"{err / llama:.3f}; bits per weight {ours:.3f} (GGUF {gguf_bits:.3f}); "
          + "; ".join(f"{c} {v['bits']:.2f}" for c, v in rec.items()))
    assert err <= 1.5 * llama


def test_tied_embedding_gguf(tmp_path):
    """A GGUF without output.weight (llama.cpp's converter on a tied transformers model;
    llama.cpp's lm_head is token_embd): the converted model is tied (no lm_head section),
    its F32 logits within 1e-4 of transformers', its Q8_0 ones within 1.5x llama.cpp's own
    error."""
    from colibri_core.format.modelfile import ContainerFile
    d, n = _prompts("qwen3_moe_tied")
    ref = [d[f"hf_{i}"] for i in range(n)]
    out, cfg, report = _convert("qwen3_moe_tied-F32.gguf", tmp_path)
    assert cfg.tie_word_embeddings
    f = ContainerFile(out / "model.bin", "header")
    try:
        assert "embed" in f.sections and "lm_head" not in f.sections
    finally:
        f.close()
    assert any(line.split()[:1] == ["lm_head"] and line.endswith("tied") for line in report)
    got = _logits(out, d, n)
    assert max(max_rel(got[i], ref[i]) for i in range(n)) <= 1e-4
    out, cfg, _ = _convert("qwen3_moe_tied-Q8_0.gguf", tmp_path)
    ours = token_error(_logits(out, d, n), ref)
    llama = token_error([d[f"Q8_0__{i}"] for i in range(n)], ref)
    assert ours <= 1.5 * llama


def test_q5_refused_for_mla_attention(tmp_path):
    """MLA's attn_qo holds wkv_b, whose rows the C block reads one at a time: q5 there is
    refused in one line (GGUF Q5_K attention of a deepseek2 file goes to q4 / q6 instead)."""
    with pytest.raises(ConfigError, match="attn_qo=5: MLA's wkv_b rows") as e:
        convert(DATA / "deepseek_v2-Q8_0.gguf", tmp_path / "o", bits=None,
                tensor_bits={"attn_qo": 5})
    assert "\n" not in str(e.value)
    from colibri_core.convert.gguf_convert import choose
    assert choose("attn_qo", 5.5) == (5, 128)
    assert choose("attn_qo", 5.5, five=()) == (4, 64)


def test_split_gguf_missing_part_named(tmp_path):
    """A split GGUF converts from its first file (test_f32_gguf_matches_transformers
    [qwen3_moe]); a missing part is one line naming it."""
    parts = sorted(DATA.glob("qwen3_moe-F32-*-of-*.gguf"))
    assert len(parts) >= 2
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / parts[0].name).symlink_to(parts[0])
    with pytest.raises(ConfigError, match=parts[1].name) as e:
        convert(lone / parts[0].name, tmp_path / "o2", bits=None)
    assert "\n" not in str(e.value)


def test_dense_llama_refused(tmp_path):
    with pytest.raises(ConfigError, match="'llama' without experts") as e:
        convert(DATA / "llama_dense-Q8_0.gguf", tmp_path / "o", bits=None)
    assert "\n" not in str(e.value)


def test_unsupported_tensor_type_named(tmp_path, monkeypatch):
    from colibri_core.convert import gguf_families as gf
    monkeypatch.setattr(gf, "READ_TYPES", tuple(t for t in gf.READ_TYPES if t != "Q8_0"))
    with pytest.raises(ConfigError, match="tensor type Q8_0 is not supported") as e:
        convert(DATA / "mixtral-Q8_0.gguf", tmp_path / "o", bits=None)
    assert "\n" not in str(e.value)


def test_class_below_the_smallest_format_refused_unless_bits_given(tmp_path, monkeypatch):
    """A Q2_K expert class (2.63 bits) would grow to q4 g256's 4.16: refused in one line
    naming the class and the way out; --bits 4 asks for it and converts."""
    from colibri_core.convert import gguf_convert as gc
    real = gc.class_types

    def as_q2k(src, shapes):
        types = real(src, shapes)
        types["experts"] = {"Q2_K": sum(types["experts"].values())}
        return types
    monkeypatch.setattr(gc, "class_types", as_q2k)
    with pytest.raises(ConfigError, match=r"tensor class experts is Q2_K \(2\.62 bits per "
                       r"weight\), below Colibri's smallest format \(q4 g256") as e:
        convert(DATA / "mixtral-Q8_0.gguf", tmp_path / "o", bits=None)
    assert "\n" not in str(e.value) and "--bits 4" in str(e.value)
    assert not (tmp_path / "o").exists()
    out, cfg, _ = _convert("mixtral-Q8_0.gguf", tmp_path, bits=4)
    assert {r["class"]: r["formats"] for r in tensor_classes(out)}["experts"].startswith("q4")


def test_bits_and_tensor_bits_override(tmp_path):
    out, cfg, _ = _convert("mixtral-F32.gguf", tmp_path, bits=8, tensor_bits={"lm_head": 6})
    rows = {r["class"]: r["formats"] for r in tensor_classes(out)}
    assert rows["lm_head"].startswith("q6") and rows["experts"].startswith("q8")


def test_tokenizer_from_gguf_metadata(tmp_path):
    """tokenizer.json built by transformers' GGUF loader from the file's metadata encodes as
    the original Hugging Face tokenizer (rebuilt here with `tokenizers`, as remake.py made
    it); the chat template is the file's."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    sys.path.insert(0, str(DATA))
    import remake
    out, _, report = _convert("mixtral-F32.gguf", tmp_path)
    assert any("tokenizer.json built" in line for line in report)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    remake.write_tokenizer(ref_dir)
    ref = Tokenizer.from_file(str(ref_dir / "tokenizer.json"))
    got = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("the weather and the sea", "on and on, there", " in the end", "héllo ørn"):
        assert got.encode(text).ids == ref.encode(text).ids, text
        assert got.decode(got.encode(text).ids) == text
    import json
    tmpl = json.loads((ref_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert (out / "chat_template.jinja").read_text() == tmpl


def test_tokenizer_refused_in_one_line_without_builder(tmp_path, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_tr(name, *a, **k):
        if name.startswith("transformers"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tr)
    out, cfg, report = _convert("mixtral-F32.gguf", tmp_path)
    line = next(x for x in report if x.startswith("tokenizer"))
    assert "--tokenizer DIR" in line and "\n" not in line
    assert not (out / "tokenizer.json").exists()


def test_cli_gguf(tmp_path):
    r = subprocess.run([sys.executable, "-m", "colibri_core", "convert",
                        str(DATA / "mixtral_kq-Q4_K_M.gguf"), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "GGUF tensor classes" in r.stderr and "Q4_K" in r.stderr and "requantized" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_core", "convert",
                        str(DATA / "llama_dense-Q8_0.gguf"), str(tmp_path / "o2")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "without experts" in r.stderr


def test_tokenizer_dir_copied(tmp_path):
    """--tokenizer DIR: its files are copied (and a DIR without tokenizer.json refused)."""
    sys.path.insert(0, str(DATA))
    import remake
    ref_dir = tmp_path / "tok"
    ref_dir.mkdir()
    remake.write_tokenizer(ref_dir)
    out, cfg, report = _convert("mixtral-Q8_0.gguf", tmp_path, tokenizer_dir=ref_dir)
    assert (out / "tokenizer.json").read_bytes() == (ref_dir / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in cfg.files and any(str(ref_dir) in line for line in report)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        convert(DATA / "mixtral-Q8_0.gguf", tmp_path / "o3", bits=None, tokenizer_dir=empty)


def test_tokenizer_matches_llama_cpp_test_vectors(tmp_path):
    """llama.cpp's own tokenizer test vectors for the Llama / Mistral sentencepiece
    vocabulary (models/ggml-vocab-llama-spm.gguf, .inp, .out): the tokenizer.json built from
    the GGUF gives llama.cpp's ids for each of its 47 inputs (leading spaces, tabs, newlines,
    emoji, CJK, byte fallback)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from colibri_core.convert.gguf_convert import build_tokenizer_json
    f = DATA / "ggml-vocab-llama-spm.gguf"
    cfg: dict = {}
    assert build_tokenizer_json(f, 32000, tmp_path, cfg) is None
    tk = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    inputs = (DATA / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8") \
        .split("\n__ggml_vocab_test__\n")
    outputs = (DATA / "ggml-vocab-llama-spm.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = list(zip(inputs, outputs))
    assert len(cases) >= 40
    bad = [(t, o) for t, o in cases
           if tk.encode(t, add_special_tokens=False).ids != [int(x) for x in o.split()]]
    assert not bad, bad[:3]
    assert cfg["bos_token"] == "<s>" and cfg["add_bos_token"] is True
