"""`colibri experts train` against a live server (issue 35 item 4's command line): the job
is submitted from a local file or a path on the server, followed with progress lines to
built (the candidate then in shadow) or failed (non-zero, one line saying why); bad input
is one line naming the file/field."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from server_helpers import training_server, wait_until
from test_server_training import AUTH, CONFIG, KEY, examples


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with training_server(tmp_path_factory.mktemp("cli_train"), CONFIG, KEY) as w:
        yield w


def colibri(*args, key=KEY, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_API_KEY"}
    if key:
        env["COLIBRI_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "colibri_core", "experts", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_follows_a_job_to_a_candidate(server):
    url = server["url"]
    ex = examples(400, 5)
    f = write_jsonl(server["tmp"] / "local.jsonl", ex)
    r = colibri("ct_cli", "--examples", str(f), "--steps", "20", "--interval", "0.2",
                "--url", url)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    jid = lines[0].split(":")[0]
    assert lines[0] == f"{jid}: ct_cli 1 queued" or lines[0] == f"{jid}: ct_cli 1 running"
    assert all(x.startswith(f"{jid}: ") for x in lines) and len(set(lines)) == len(lines)
    assert any("router row: selects" in x for x in lines), r.stdout   # the child's progress
    so = server["experts"] / "shadow" / "ct_cli.so"
    assert lines[-1].startswith(f"{jid}: built {so} ({len(ex)} examples, "
                                f"{sum(e['route'] for e in ex)} routed"), lines[-1]
    job = httpx.get(f"{url}/v1/experts/train/{jid}", headers=AUTH, timeout=30).json()
    assert job["status"] == "built" and job["candidate"] == str(so) and so.is_file()
    assert [f"{jid}: {x}" for x in job["log"]] == lines[-1 - len(job["log"]):-1]
    wait_until(lambda: any(c["name"] == "ct_cli" for c in httpx.get(
        url + "/v1/experts", headers=AUTH, timeout=30).json()["candidates"]), "in shadow")


def test_a_failed_job_exits_non_zero_with_its_reason(server):
    url = server["url"]
    write_jsonl(server["data"] / "srv.jsonl", examples(200, 3))
    r = colibri("early_cli", "--path", "srv.jsonl", "--layer", "1", "--interval", "0.2",
                "--url", url)
    assert r.returncode == 1 and r.stdout, r.stderr
    jid = r.stdout.splitlines()[0].split(":")[0]
    err = r.stderr.strip()
    assert "\n" not in err and err.startswith(f"colibri: training job {jid} failed: ")
    assert "layer 1" in err and "last layer" in err


def test_bad_input_is_one_line(server):
    url, tmp = server["url"], server["tmp"]
    ex = examples(200, 3)
    bad = write_jsonl(tmp / "bad_target.jsonl", ex[:4] + [dict(ex[4], target=10**6)] + ex[5:])
    cases = [(("x", "--examples", str(bad)), "examples[4].target"),
             (("x", "--path", "../allow.txt"), "path="),
             (("../x", "--examples", str(bad)), "name="),
             (("x", "--examples", str(tmp / "missing.jsonl")), "missing.jsonl"),
             (("x", "--path", "srv.jsonl"), "API key"),                  # no key
             (("x", "--path", "srv.jsonl", "--url", "http://127.0.0.1:9"), "cannot reach")]
    (tmp / "notjson.jsonl").write_text(json.dumps(ex[0]) + "\n{oops\n")
    cases.append((("x", "--examples", str(tmp / "notjson.jsonl")), "notjson.jsonl line 2"))
    for args, want in cases:
        key = None if want == "API key" else KEY
        r = colibri(*args, *(() if "--url" in args else ("--url", url)), key=key, timeout=60)
        err = r.stderr.strip()
        assert r.returncode != 0 and "\n" not in err and "Traceback" not in err, (args, err)
        assert want in err, (args, err)
    assert httpx.get(url + "/v1/experts/train", headers=AUTH).json()["data"][0]["name"] \
        != "x"                                                          # nothing submitted
