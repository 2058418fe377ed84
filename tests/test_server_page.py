"""The status page (`/`) in headless Chromium: its JavaScript fetches /status.json and
fills the DOM; the test asserts on the DOM Chromium dumps. A screenshot is written as an
artifact (never compared): to tmp, or to $COLIBRI_SCREENSHOT when set (docs/ keeps one).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser

import httpx
import pytest

from server_helpers import LiveServer


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (apt-get install -y chromium); CI must run "
                        "the status-page test")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return exe


def run_chromium(exe: str, *args: str, home) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={home}/profile",
           "--virtual-time-budget=8000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HOME": str(home)})


class Rows(HTMLParser):
    """Collects each <tr data-name=...>'s cell texts and the texts of elements by id."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.events: dict[int, list[str]] = {}
        self.candidates: dict[str, list[str]] = {}
        self.ids: dict[str, str] = {}
        self.body_attrs: dict = {}
        self._row = None
        self._cell = None
        self._id = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body_attrs = a
        if tag == "tr" and "data-name" in a:
            self._row = self.rows.setdefault(a["data-name"], [])
        if tag == "tr" and "data-seq" in a:          # the recent changes' rows
            self._row = self.events.setdefault(int(a["data-seq"]), [])
        if tag == "tr" and "data-candidate" in a:    # the candidates' rows
            self._row = self.candidates.setdefault(a["data-candidate"], [])
        if tag == "td" and self._row is not None:
            self._cell = []
        if "id" in a:
            self._id = a["id"]
            self.ids[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr":
            self._row = None
        self._id = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.ids[self._id] += data


def test_status_page_shows_live_experts_in_chromium(tmp_path):
    exe = chromium()
    from colibri_core.experts.hotplug.authoring.testing import compile_test_expert
    d = tmp_path / "experts"
    d.mkdir(mode=0o755)
    compile_test_expert(d / "page_expert.so", hidden=128, layer=2, name="fraud_pattern",
                        version="1.2")
    (d / "shadow").mkdir(mode=0o755)                # a candidate, tried before it joins
    compile_test_expert(d / "shadow" / "new_pattern.so", hidden=128, layer=2,
                        name="new_pattern", version="0.1")
    srv = LiveServer(experts_dir=d)
    try:
        for p in ("The assert statement", "The import system"):
            httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": p, "max_tokens": 64, "ignore_eos": True})
        time.sleep(2.5)                        # two 1 s samples of the status window
        gen = httpx.get(srv.url + "/v1/experts").json()["expert_set_generation"]
        r = run_chromium(exe, "--dump-dom", srv.url + "/", home=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        page = Rows()
        page.feed(r.stdout)
        assert page.body_attrs.get("data-loaded") == "yes", r.stdout[:2000]
        assert page.ids["generation"].strip() == str(gen)
        assert page.ids["hot-count"].strip() == "1"
        assert float(page.ids["tps"]) > 0
        hot = page.rows["fraud_pattern"]
        assert hot[:3] == ["fraud_pattern", "1.2", "8"] and hot[3] == "2"
        assert hot[5] == "active" and hot[9:] == ["portable", "page_expert.so"]
        # the history: its adoption, with the generation it went live in
        assert page.events[1][1:5] == ["adopt", "fraud_pattern", "1.2", "8"]
        assert page.events[1][7] == "1"
        shares = [float(re.search(r"([0-9.]+)%", row[7]).group(1)) for row in page.rows.values()]
        assert 99.0 <= sum(shares) <= 101.0        # every routed token is someone's
        assert len(page.rows) == 1 + 3 * 8
        # the candidate: its row, in shadow, the slot after the live expert's
        cand = page.candidates["new_pattern"]
        assert cand[:6] == ["new_pattern", "0.1", "9", "2", "shadow", "0.0%"], cand
        assert cand[11] == "no labels yet"
        shot = os.environ.get("COLIBRI_SCREENSHOT") or str(tmp_path / "status.png")
        s = run_chromium(exe, f"--screenshot={shot}", "--window-size=1100,900",
                         "--hide-scrollbars", srv.url + "/", home=tmp_path)
        assert s.returncode == 0 and os.path.getsize(shot) > 1000
    finally:
        srv.stop()
