"""The fraud example scored through `colibri serve` (/v1/score) while its new expert goes
live: examples/fraud/score_via_server.py, reduced."""
from __future__ import annotations

import sys
from pathlib import Path

FRAUD_DIR = Path(__file__).resolve().parent.parent / "examples" / "fraud"


def test_fraud_scoring_through_the_server(tmp_path):
    sys.path.insert(0, str(FRAUD_DIR))
    try:
        import score_via_server
        res = score_via_server.main(["--before", "768", "--after", "1280", "--batch", "256",
                                     "--out", str(tmp_path / "out")])
    finally:
        sys.path.remove(str(FRAUD_DIR))
    assert res["live_at"] is not None and res["live_at"] > 0      # dropped mid-stream
    assert res["generations"][0] == 0 and res["generations"][-1] >= 1
    # each transaction scored in-process under the set the server named for it: the same
    # P(FRAUD) and decisions; and the server's audit log replays bit for bit
    assert res["max_abs_prob_diff"] < 1e-6
    assert res["same_as_in_process"]
    # every item the server scored is in its log: the 2,048, plus the last batch again when
    # the expert went live only after the stream's end (a fast machine)
    assert res["scored"] in (2048, 2048 + 256)
    assert res["replayed"] == res["scored"] and res["replay_differ"] == 0
