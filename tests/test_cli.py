"""The command line: the main job, its prompt sources, inspect/convert/verify, help on
every option, and one-line errors with a non-zero exit.

Expected outputs come from the Python API on the same model (Engine), never from recorded
text, so the tests hold for any built-in model."""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_core.config import builtin_model_dir

CI = bool(os.environ.get("CI"))


def colibri(*args, timeout=120, stdin=None):
    return subprocess.run([sys.executable, "-m", "colibri_core", *args], capture_output=True,
                          text=True, timeout=timeout, cwd="/", input=stdin)


def api_greedy(prompt, n, model=None):
    """The same request through the Python API: (generated text, token ids, prompt ids)."""
    from colibri_core.engine import Engine
    eng = Engine.from_model_dir(model) if model else Engine.from_config("builtin")
    with eng:
        g = eng.generate(prompt, max_new_tokens=n, temperature=0).run()
        return g.text, g.token_ids, g.prompt_ids


def test_run_builtin_streams_text():
    r = colibri("run", "--prompt", "The import statement", "-n", "24", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The import statement")
    assert len(r.stdout.split()) > 5
    assert "24 tokens, stop=length" in r.stderr


def test_run_with_mode_prefix_and_quiet():
    """-q: only the generated text (no prompt echo), nothing on stderr."""
    r = colibri("run", "--prompt", "MODE:k1|The class", "-n", "4", "--quiet", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    from colibri_core.engine import Engine
    with Engine.from_config("builtin") as eng:
        want = eng.generate("The class", max_new_tokens=4, temperature=0, experts_per_token=1).run().text
    assert r.stdout == want + "\n" and r.stderr == ""


def test_prompt_ids_and_prompt_file_match_the_api(tmp_path):
    text, _, _ = api_greedy([1, 2, 3], 6)
    r = colibri("run", "--prompt-ids", "1,2,3", "-n", "6", "-q", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text + "\n"
    text, _, _ = api_greedy("The import statement", 6)
    f = tmp_path / "prompt.txt"
    f.write_text("The import statement")
    for args, stdin in (((str(f),), None), (("-",), "The import statement")):
        r = colibri("run", "--prompt-file", *args, "-n", "6", "--temperature", "0", stdin=stdin)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "The import statement" + text + "\n"     # echo, then the text


def test_model_without_tokenizer_needs_ids_and_prints_ids(tiny_model_dir):
    assert not (tiny_model_dir / "tokenizer.json").exists()
    r = colibri("run", "--model", str(tiny_model_dir))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("colibri: error: ") and "no tokenizer" in line
    assert "--prompt-ids" in line
    _, ids, _ = api_greedy([5, 6, 7], 5, model=tiny_model_dir)
    r = colibri("run", "--model", str(tiny_model_dir), "--prompt-ids", "5, 6,7", "-n", "5",
                "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(i) for i in [5, 6, 7] + ids]
    r = colibri("run", "--model", str(tiny_model_dir), "--prompt-ids", "5,6,7", "-n", "5",
                "--temperature", "0", "-q")
    assert r.stdout.split() == [str(i) for i in ids]


def test_n_capped_by_the_context_warns_once():
    from colibri_core.engine import Engine
    with Engine.from_config("builtin") as eng:
        ctx = eng.model_cfg.max_position_embeddings
        p = len(eng.prepare_ids("The ")[0])
    r = colibri("run", "-n", str(10 * ctx), "-q", "--seed", "0")
    assert r.returncode == 0, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line == (f"colibri: warning: -n {10 * ctx} is capped at {ctx - p + 1} new tokens by "
                    f"the model's context of {ctx} positions (prompt {p} tokens)")
    r = colibri("run", "-n", str(ctx - p + 1), "-q", "--seed", "0")
    assert r.returncode == 0 and r.stderr == ""


def test_long_prompt_is_not_echoed_whole():
    prompt = "word " * 5000
    r = colibri("run", "--prompt", prompt, "-n", "2", "--seed", "0")       # longer than ECHO_MAX_CHARS
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("…") and len(r.stdout) < 400
    assert prompt.rstrip().endswith(r.stdout[1:].split("\n")[0][:50].rstrip())
    r = colibri("run", "--prompt", prompt, "-n", "2", "--seed", "0", "-q")
    assert "word word" not in r.stdout


@pytest.mark.parametrize("size", ["small", "huge"])
def test_budget_report_shows_what_exists(size):
    """For a budget that holds a few experts and for one larger than the model."""
    from colibri_core.config import EngineConfig, load_model_config
    from colibri_core.experts.residency import check_budget
    cfg = load_model_config(builtin_model_dir() / "config.json")
    plan = check_budget(builtin_model_dir(), EngineConfig(max_resident_mb=100000))
    mb = ((plan.minimum + 3 * plan.expert_bytes) / 2**20 + 0.05 if size == "small"
          else 100000)
    names = [f"expert_{L}_{e}.bin" for L in cfg.moe_layers for e in range(cfg.num_experts)]
    total = sum(cfg.files[n].size for n in names) / 2**20
    r = colibri("run", "-n", "2", "--max-resident-mb", f"{mb:.2f}", "--seed", "0")
    assert r.returncode == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("colibri: experts:")]
    assert f"the model has {len(names)} routed experts, {total:.1f} MB" in line
    budget = next(x for x in r.stderr.splitlines() if x.startswith("colibri: budget"))
    cache = float(budget.split("expert cache ")[1].split()[0])
    if cache >= total:
        assert f"holds the whole model ({cache - total:.1f} MB of it unused)" in line
    else:
        held = int(line.split("holds ")[1].split()[0])
        assert 2 <= held < len(names)
    assert (cache >= total) == (size == "huge")


def test_inspect_verify():
    r = colibri("inspect", str(builtin_model_dir()), "--verify")
    assert r.returncode == 0, r.stderr
    assert "qwen2_moe" in r.stdout and "verify: all" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("run", "--prompt", "MODE:kx|hi"), "malformed MODE: prefix"),
    (("run", "--prompt", "hi", "--experts-per-token", "9"), "experts_per_token=9 from the experts_per_token argument is out of range"),
    (("run", "--prompt", "hi", "--threads", "0"),
     "argument --threads: '0': expected an integer from 1 to 512"),
    (("run", "-n", "-1"), "argument -n: '-1': expected an integer >= 0"),
    (("run", "--temperature", "x"), "argument --temperature: 'x': expected a number >= 0"),
    (("run", "--top-p", "0"), "argument --top-p: '0': expected a number > 0 and <= 1"),
    (("run", "--max-resident-mb", "0"), "argument --max-resident-mb: '0': expected a number > 0"),
    (("run", "--prompt-ids", "1,,x"), "argument --prompt-ids: '1,,x': expected token ids"),
    (("run", "--prompt-ids", "1,99999"), "token id 99999 out of range"),
    (("run", "--prompt-file", "/nonexistent"), "--prompt-file /nonexistent: file not found"),
    (("run", "--prompt", "a", "--prompt-ids", "1"), "not allowed with argument"),
    (("run", "--bogus"), "unrecognized arguments: --bogus"),
    (("run", "--debug", "routing,foo"), "argument --debug: 'routing,foo': expected a "
                                        "comma-separated list of routing, memory, timing, or all"),
    (("run", "--plugins-dir", "/nonexistent"), "error: plugins folder '/nonexistent' does not"),
    (("run", "--config", str(builtin_model_dir() / "config.json")),
     f"this is a model config.json, not a run config (YAML/JSON with `model:` and `engine:`); "
     f"run it with --model {builtin_model_dir()}"),
    (("run", "--config", "/dev"), "--config /dev: is a folder; expected a run config file"),
    (("convert", "/dev", "/tmp/never"), "/dev: no config.json; expected a Hugging Face "
                                        "checkpoint folder"),
    (("run", "--model", "/nonexistent"), "/nonexistent: model directory not found"),
    (("run", "--config", "nope"), "config 'nope': no such file"),
    (("run", "--prompt", ""), "empty prompt"),
    (("inspect", "/dev"), "/dev is not a Colibri model directory (no config.json); convert"),
    (("inspect", str(builtin_model_dir().parent)),
     f"(no config.json); did you mean {builtin_model_dir()}?"),
    (("expert", "build", "x.npz"), "the following arguments are required: -o/--output"),
    (("expert", "build", "/nonexistent.npz", "-o", "/tmp/x.so", "--layer", "1", "--name", "a",
      "--version", "1"), "/nonexistent.npz: cannot read the .npz"),
])
def test_user_errors_are_one_line(args, message):
    r = colibri(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), r.stderr
    assert message in lines[0]


def test_prompt_beyond_context_is_truncated_with_warning():
    from colibri_core.config import load_model_config
    ctx = load_model_config(builtin_model_dir() / "config.json").max_position_embeddings
    r = colibri("run", "--prompt", "word " * (ctx + 10), "-n", "2", "--quiet")   # >= 1 token a word
    assert r.returncode == 0, r.stderr
    assert "exceeds the context" in r.stderr


def test_experts_list_json(tmp_path):
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    r = colibri("experts", "list", "--experts-dir", str(d), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["expert_set_generation"] == 0
    assert sum(e["origin"] == "model file" for e in data["experts"]) == 24


def _all_parsers():
    from colibri_core.cli import build_parser
    from colibri_core.experts.hotplug.authoring.builder import build_parser as builder_parser
    todo, seen = [build_parser(), builder_parser()], []
    while todo:
        p = todo.pop()
        seen.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += list(a.choices.values())
    return seen


def test_every_option_has_help():
    missing = []
    for p in _all_parsers():
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            h = (a.help or "").strip()
            if not h or h == argparse.SUPPRESS or h.endswith((",", ":", ";", "(", " and", " or")):
                missing.append(f"{p.prog} {'/'.join(a.option_strings) or a.dest}: {h!r}")
    assert not missing, missing


def test_run_help_says_what_applies_with_model():
    r = colibri("run", "--help")
    assert r.returncode == 0
    from colibri_core.config import EngineConfig
    s = EngineConfig().sampling
    flat = " ".join(r.stdout.split())
    assert f"run with the engine defaults (temperature {s.temperature:g}, top-p {s.top_p:g}" in flat
    assert "not a config's settings" in flat


# -- convert, inspect and verify on a Hugging Face checkpoint --------------------------

@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    if not CI:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    from hf_helpers import write_tiny_checkpoint
    d = tmp_path_factory.mktemp("hf")
    return write_tiny_checkpoint(d / "with_tok"), write_tiny_checkpoint(d / "no_tok", tokenizer=False)


def test_convert_copies_tokenizer_files_or_says_they_are_absent(hf_checkpoints, tmp_path):
    from colibri_core.convert import TOKENIZER_FILES
    with_tok, no_tok = hf_checkpoints
    r = colibri("convert", str(with_tok), str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert f"colibri: copied {', '.join(TOKENIZER_FILES)}" in r.stderr
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    for n in TOKENIZER_FILES:                       # byte-identical, listed with their hash
        assert (tmp_path / "a" / n).read_bytes() == (with_tok / n).read_bytes()
        assert n in cfg["files"]
    assert colibri("inspect", str(tmp_path / "a"), "--verify").returncode == 0
    r = colibri("convert", str(no_tok), str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert f"colibri: not in {no_tok}: {', '.join(TOKENIZER_FILES)}; without tokenizer.json" in r.stderr
    assert "--prompt-ids" in r.stderr
    assert not any((tmp_path / "b" / n).exists() for n in TOKENIZER_FILES)


def test_wrong_or_swapped_folders_are_named(hf_checkpoints, tmp_path):
    with_tok, _ = hf_checkpoints
    model = tmp_path / "m"
    assert colibri("convert", str(with_tok), str(model)).returncode == 0
    cases = [
        (("verify", str(model), str(with_tok)),
         f"the two folders look swapped: {model} is a Colibri model and {with_tok} a Hugging "
         f"Face checkpoint; expected `colibri verify HF_DIR MODEL_DIR`, i.e. `colibri verify "
         f"{with_tok} {model}`"),
        (("verify", str(model), str(model)), f"{model} is a Colibri model directory; expected "
                                            f"the Hugging Face checkpoint"),
        (("verify", str(with_tok), str(with_tok)), f"{with_tok} is a Hugging Face checkpoint, "
                                                  f"not a Colibri model directory"),
        (("inspect", str(with_tok)), f"{with_tok} is a Hugging Face checkpoint, not a Colibri "
                                     f"model directory; convert it with `colibri convert "
                                     f"{with_tok} OUT_DIR`"),
        (("run", "--model", str(with_tok)), "is a Hugging Face checkpoint"),
        (("convert", str(model), str(tmp_path / "x")), f"{model} is already a Colibri model"),
    ]
    for args, message in cases:
        r = colibri(*args)
        assert r.returncode == 2, (args, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line == f"colibri: error: {message}" or (line.startswith("colibri: error: ")
                                                         and message in line), (args, line)
