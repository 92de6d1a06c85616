"""`spillgate bench builds`: two builds side by side, each round beside the raw relay."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loadtest.bench.builds import RAW, compare, summary

ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="needs wrk (apt-get install wrk)"
)


def test_the_same_build_twice_is_measured_beside_the_raw_relay() -> None:
    # one round of one second: the plumbing, in seconds; the measurement is the script's
    figures = compare(ROOT, ROOT, rounds=1, seconds=1)
    assert set(figures) == {RAW, "before", "after"}
    for arm in figures.values():
        assert len(arm["rps"]) == len(arm["cpu_us"]) == 1
        assert all(rps > 50 for rps in arm["rps"])
        assert all(cpu > 0 for cpu in arm["cpu_us"])
    result = summary(figures)
    # one round: the summary pairs its two arms (a one-second figure on a shared machine
    # is not a measurement to hold the ratio to)
    (after,), (before,) = figures["after"]["rps"], figures["before"]["rps"]
    assert result["rounds"] == 1
    assert result["after/before req/s"] == after / before
    assert result["rounds after was faster"] == int(after > before)
    # each ratio is the round's own pair (how large it is is the script's measurement)
    ((after_cpu,), (raw_cpu,)) = figures["after"]["cpu_us"], figures[RAW]["cpu_us"]
    assert result["after CPU vs raw relay"] == after_cpu / raw_cpu
    assert result["after req/s vs raw relay"] == after / figures[RAW]["rps"][0]


def test_a_checkout_without_its_virtualenv_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make the checkout's virtualenv"):
        compare(tmp_path, tmp_path, rounds=1, seconds=1)
