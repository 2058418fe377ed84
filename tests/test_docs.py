"""The documentation runs as written: every fenced block of README.md and docs/*.md.

- Every fence carries a language tag; an untagged fence fails (listings and sample
  output are `text`, Python `python`, shell commands `sh`).
- Every `sh` block runs, with bash (`set -e`: each line must succeed) and a 60 s cap,
  unless the line just above it is `<!-- no-run: reason -->`; those are reported as
  skipped with the reason (pytest's `-ra` summary lists them).
- The blocks of one page run in order, as a reader follows it, in a temporary copy of
  the repository's tracked files (`git ls-files`, plus the compiled kernels), so a
  `colibri convert ... --force` or a build cannot touch the checkout.
- Placeholders are bound to fixtures: `path/to/hf_checkpoint` to a tiny Hugging Face
  checkpoint built here with transformers, `big_moe/` to its conversion, `{PORT}` to a
  free port of the page.
- A long-running command (a server) is marked `<!-- background: URL -->` above its block:
  it is started in the background, the page's later blocks run once URL answers, and
  after the page's last block it gets SIGTERM and must exit within 10 s. The port in URL
  (e.g. 8000) is the page's documented port: `--port 8000`, `:8000/` and `:8000` followed
  by a space or quote in the page's blocks are bound to a free port, so the docs show
  the usual address and the test never collides with a server already running.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CAP_S = 60
CI = bool(os.environ.get("CI"))

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(.+?)\s*-->\s*$")
BACKGROUND = re.compile(r"^\s*<!--\s*background:\s*(\S+)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int               # 1-based line of the opening fence
    tag: str
    text: str
    no_run: str | None      # the reason, when marked
    background: str | None  # readiness URL, when marked

    @property
    def where(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{name}:{self.line}"


def parse(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.groups()
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$",
                                                 lines[end]):
            end += 1
        above = lines[i - 1] if i else ""
        nr, bg = NO_RUN.match(above), BACKGROUND.match(above)
        body = "\n".join(l[len(indent):] if l.startswith(indent) else l for l in lines[i + 1:end])
        out.append(Block(path, i + 1, tag, body, nr.group(1) if nr else None,
                         bg.group(1) if bg else None))
        i = end + 1
    return out


BLOCKS = [b for p in DOCS for b in parse(p)]
SH = [b for b in BLOCKS if b.tag == "sh"]


def test_every_fence_has_a_language_tag():
    untagged = [b.where for b in BLOCKS if not b.tag]
    assert not untagged, (f"untagged fences (tag them: sh / text / python / ...): "
                          f"{', '.join(untagged)}")
    misplaced = [b.where for b in BLOCKS if b.background and b.tag != "sh"]
    assert not misplaced, f"background markers on blocks that are not sh: {misplaced}"


def test_parser_on_a_sample(tmp_path):
    """The rules above, on a page written for the purpose."""
    page = tmp_path / "p.md"
    page.write_text("x\n```sh\necho a\n```\n<!-- no-run: too long -->\n```sh\nsleep 99\n```\n"
                    "````text\n```\nnested\n```\n````\n```\nbare\n```\n"
                    "<!-- background: http://127.0.0.1:{PORT}/ -->\n```sh\nserve\n```\n")
    got = [(b.line, b.tag, b.text, b.no_run, b.background) for b in parse(page)]
    assert got == [(2, "sh", "echo a", None, None), (6, "sh", "sleep 99", "too long", None),
                   (9, "text", "```\nnested\n```", None, None), (14, "", "bare", None, None),
                   (18, "sh", "serve", None, "http://127.0.0.1:{PORT}/")]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    if not CI:
        pytest.importorskip("torch", reason="path/to/hf_checkpoint is built with torch")
        pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_helpers import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("docs_hf") / "hf_checkpoint")


@pytest.fixture(scope="session")
def converted_model(hf_checkpoint, tmp_path_factory):
    from colibri_core.convert import convert
    out = tmp_path_factory.mktemp("docs_model") / "model"
    convert(hf_checkpoint, out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """One page's copy of the repository, its port and its background processes."""

    def __init__(self, path: Path, tmp: Path):
        self.path, self.dir, self.port = path, tmp / "repo", free_port()
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0")
        for name in filter(None, files):
            src = ROOT / name
            if src.is_file():
                dst = self.dir / name
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        for so in (ROOT / "colibri_core").glob("_colibri_kernels*.so"):   # built, not tracked
            shutil.copy2(so, self.dir / "colibri_core" / so.name)
        self.done: set[int] = set()
        urls = [b.background for b in SH if b.path == path and b.background]
        ports = {m.group(1) for u in urls if (m := re.search(r":(\d+)(?:/|$)", u))}
        self.doc_port = ports.pop() if len(ports) == 1 else None
        self.background: list[tuple[Block, subprocess.Popen]] = []

    def env(self) -> dict:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def stop_background(self) -> list[str]:
        problems = []
        for b, p in self.background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    problems.append(f"{b.where}: did not exit within 10 s of SIGTERM")
        self.background.clear()
        return problems


@pytest.fixture(scope="session")
def pages(tmp_path_factory):
    made: dict[Path, Page] = {}

    def get(path: Path) -> Page:
        if path not in made:
            made[path] = Page(path, tmp_path_factory.mktemp("docs_" + path.stem))
        return made[path]
    yield get
    for page in made.values():
        page.stop_background()


def bind_port(text: str, page: Page) -> str:
    text = text.replace("{PORT}", str(page.port))
    if page.doc_port:
        p, new = re.escape(page.doc_port), str(page.port)
        text = re.sub(rf"(--port[ =]){p}\b", rf"\g<1>{new}", text)
        text = re.sub(rf":{p}(?=[/\s'\"]|$)", f":{new}", text, flags=re.M)
    return text


def bind(block: Block, page: Page, request) -> str:
    text = bind_port(block.text, page)
    if "path/to/hf_checkpoint" in text:
        text = text.replace("path/to/hf_checkpoint", str(request.getfixturevalue("hf_checkpoint")))
    if "big_moe/" in text:
        text = text.replace("big_moe/", f"{request.getfixturevalue('converted_model')}/")
    return text


def wait_ready(url: str, proc: subprocess.Popen, deadline: float) -> str | None:
    """None once `url` answers (any HTTP status), else why not."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode} before {url} answered"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return None
        except urllib.error.HTTPError:
            return None
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    return f"{url} did not answer within {CAP_S} s"


def run_block(block: Block, page: Page, request) -> None:
    script = "set -e -o pipefail\n" + bind(block, page, request)
    if block.background:
        url = bind_port(block.background, page)
        log = open(page.dir.parent / f"background-{block.line}.log", "w+")
        proc = subprocess.Popen(["bash", "-c", script], cwd=page.dir, env=page.env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        page.background.append((block, proc))
        why = wait_ready(url, proc, time.monotonic() + CAP_S)
        if why:
            page.stop_background()
            log.seek(0)
            pytest.fail(f"{block.where}: background command: {why}\n{log.read()[-3000:]}")
        return
    proc = subprocess.Popen(["bash", "-c", script], cwd=page.dir, env=page.env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{block.where}: still running after {CAP_S} s (mark it "
                    f"`<!-- no-run: reason -->` if it is meant to be long)\n{block.text}\n"
                    f"--- stderr ---\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{block.where}: exit status {proc.returncode}\n{block.text}\n"
                    f"--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-3000:]}")


@pytest.mark.parametrize("block", SH, ids=[b.where for b in SH])
def test_sh_block_runs_as_written(block, pages, request):
    if block.no_run:
        pytest.skip(f"{block.where}: no-run: {block.no_run}")
    page = pages(block.path)
    same = [b for b in SH if b.path == block.path and not b.no_run]
    # a block runs after the page's blocks above it, as a reader follows the page
    for earlier in same[:same.index(block)]:
        if earlier.line not in page.done:
            run_block(earlier, page, request)
            page.done.add(earlier.line)
    if block.line not in page.done:
        run_block(block, page, request)
        page.done.add(block.line)
    if block is same[-1]:
        problems = page.stop_background()
        assert not problems, problems


def test_documented_port_is_rebound(tmp_path):
    page = Page.__new__(Page)
    page.port, page.doc_port = 41234, "8000"
    text = ("colibri serve --port 8000   # http://127.0.0.1:8000\n"
            "curl -s http://127.0.0.1:8000/v1/x -d '{\"n\": 8000}' 'localhost:8000'")
    assert bind_port(text, page) == (
        "colibri serve --port 41234   # http://127.0.0.1:41234\n"
        "curl -s http://127.0.0.1:41234/v1/x -d '{\"n\": 8000}' 'localhost:41234'")


def test_background_block_runs_until_ready_then_gets_sigterm(tmp_path, request):
    """The mechanism for server blocks, on a stand-in server: started in the background,
    the next block reaches it on the page's port, and SIGTERM ends it."""
    page = Page(tmp_path / "page.md", tmp_path)
    url = "http://127.0.0.1:{PORT}/README.md"
    server = Block(page.path, 1, "sh", "exec python -m http.server {PORT} --bind 127.0.0.1",
                   None, url)
    client = Block(page.path, 5, "sh", 'python -c "import urllib.request as u; '
                   "assert b'Colibri' in u.urlopen('http://127.0.0.1:{PORT}/README.md').read()\"",
                   None, None)
    run_block(server, page, request)
    (_, proc), = page.background
    assert proc.poll() is None
    run_block(client, page, request)
    assert page.stop_background() == [] and proc.returncode is not None
    with pytest.raises(pytest.fail.Exception, match="exit status 3"):
        run_block(Block(page.path, 9, "sh", "true\nexit 3\necho never", None, None), page, request)
