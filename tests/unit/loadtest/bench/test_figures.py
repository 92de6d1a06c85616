"""How `spillgate bench` turns the paced sweep into "max req/s with added p99 < 5 ms"."""

from __future__ import annotations

import re
from pathlib import Path

from loadtest.bench.overhead import RATES, Arm, rate_under, script


def sweep(name: str, rows: dict[int, tuple[float, float]], *, errors: int = 0) -> Arm:
    """An arm whose paced runs at each offer gave (achieved req/s, p99 ms)."""
    arm = Arm(name, "http://127.0.0.1:1", None)
    for rate, (achieved, p99) in rows.items():
        arm.add(f"r{rate}_rps", achieved)
        arm.add(f"r{rate}_p99_ms", p99)
        arm.add(f"r{rate}_errors", errors)
    return arm


DIRECT = sweep("direct", {rate: (rate, 2.0) for rate in RATES})


def test_the_highest_achieved_rate_within_the_budget_counts() -> None:
    arm = sweep("relay", {250: (249, 3.0), 500: (498, 6.5), 1000: (990, 9.0), 1500: (1400, 30)})
    assert rate_under(arm, DIRECT, 5.0) == 498  # 1000/s added 7 ms
    assert rate_under(arm, DIRECT, 8.0) == 990  # 1500/s fell short of its offer


def test_a_higher_offer_that_happens_to_pass_after_a_miss_does_not_count() -> None:
    arm = sweep("relay", {250: (250, 3.0), 500: (500, 9.0), 1000: (1000, 4.0)})
    assert rate_under(arm, DIRECT, 5.0) == 250


def test_keeping_up_is_judged_against_what_direct_achieved_on_the_same_arrivals() -> None:
    direct = sweep("direct", {250: (240, 2.0), 500: (470, 2.0), 1000: (960, 2.0)})
    arm = sweep("relay", {250: (238, 3.0), 500: (465, 3.0), 1000: (880, 3.0)})
    assert rate_under(arm, direct, 5.0) == 465  # 880 is more than 5 % short of 960


def test_an_arm_over_budget_from_the_start_or_erring_scores_zero() -> None:
    assert rate_under(sweep("slow", {250: (250, 8.0)}), DIRECT, 5.0) == 0
    assert rate_under(sweep("erring", {250: (250, 2.0)}, errors=3), DIRECT, 5.0) == 0


def test_paced_scripts_space_arrivals_at_the_offered_rate(tmp_path: Path) -> None:
    paced = script(tmp_path / "paced.lua", rate=1000).read_text()
    mean_ms = float(re.search(r"local mean_ms = ([\d.]+)", paced).group(1))  # type: ignore[union-attr]
    assert 1000 / mean_ms == 1000
    assert "math.randomseed(1000)" in paced  # every arm gets the same arrivals
    assert "Bearer sk-bench-key" in paced and "delay = function()" in paced
    plain = script(tmp_path / "plain.lua").read_text()
    assert "delay" not in plain and "Bearer sk-bench-key" in plain
