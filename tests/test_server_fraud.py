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
    assert res["live_at"] is not None and res["live_at"] >= 768     # after the drop
    assert res["generations"][0] == 0 and res["generations"][-1] >= 1
    assert res["max_abs_prob_diff"] < 1e-6            # the same P(FRAUD) as the engine's
