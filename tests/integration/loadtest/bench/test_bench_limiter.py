"""The limiter benchmark's plumbing: every limiter decides, on a private redis-server.

A smoke test of the script, not a measurement: a few hundred decisions per limiter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def test_every_limiter_admits_every_decision_and_reports_its_figures() -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "gateway.cli", "bench", "limiter", "--decisions", "300",
            "--concurrency", "1,8", "--tenants", "5", "--json",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = json.loads(out)
    arms = ("local", "ping", "redis", "resilient", "sliced")
    assert [(r["limiter"], r["concurrency"]) for r in rows] == [
        (arm, c) for c in (1, 8) for arm in arms
    ]
    for r in rows:
        assert r["decisions"] == 300 // r["concurrency"] * r["concurrency"]  # whole rounds
        assert r["decisions_per_s"] > 0
        assert 0 <= r["p50_ms"] <= r["p99_ms"]
