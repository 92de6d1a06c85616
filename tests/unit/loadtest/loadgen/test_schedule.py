"""Open-loop schedules: fixed before the run, the right rate and shape for each profile."""

import itertools
import statistics

import pytest

from loadtest.loadgen.schedule import ArrivalProfile, arrival_times


def test_constant_profile_is_evenly_spaced_at_the_rate() -> None:
    times = arrival_times(ArrivalProfile(kind="constant", rate=10, duration_s=2))
    assert len(times) == 20
    gaps = {round(b - a, 9) for a, b in itertools.pairwise(times)}
    assert gaps == {0.1}
    assert 0 < times[0] < times[-1] < 2


def test_poisson_profile_has_the_expected_count_and_exponential_gaps() -> None:
    times = arrival_times(ArrivalProfile(kind="poisson", rate=200, duration_s=20), seed=3)
    assert 3800 < len(times) < 4200
    gaps = [b - a for a, b in itertools.pairwise(times)]
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1
    assert times == sorted(times)
    assert all(0 <= t < 20 for t in times)


def test_gamma_profile_is_burstier_than_poisson_at_the_same_rate() -> None:
    times = arrival_times(ArrivalProfile(kind="gamma", rate=100, duration_s=40, cv=3.0), seed=1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 2.5 < statistics.stdev(gaps) / statistics.mean(gaps) < 3.5
    assert 3000 < len(times) < 5000


def test_spike_profile_multiplies_the_rate_for_its_window_then_recovers() -> None:
    profile = ArrivalProfile(
        kind="spike", rate=20, duration_s=30, spike_factor=5, spike_start_s=10, spike_duration_s=10
    )
    assert [(p.label, p.start_s, p.rate) for p in profile.phases()] == [
        ("baseline", 0.0, 20),
        ("spike", 10, 100),
        ("recovery", 20, 20),
    ]
    assert profile.expected_arrivals() == pytest.approx(20 * 10 + 100 * 10 + 20 * 10)
    times = arrival_times(profile, seed=7)
    before = sum(1 for t in times if t < 10)
    during = sum(1 for t in times if 10 <= t < 20)
    after = sum(1 for t in times if t >= 20)
    assert 150 < before < 250 and 150 < after < 250
    assert 900 < during < 1100


def test_spike_from_the_first_second_has_no_baseline_phase() -> None:
    profile = ArrivalProfile(
        kind="spike", rate=2, duration_s=5, spike_start_s=0, spike_duration_s=2
    )
    assert [p.label for p in profile.phases()] == ["spike", "recovery"]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    profile = ArrivalProfile(kind="poisson", rate=50, duration_s=2)
    assert arrival_times(profile, seed=1) == arrival_times(profile, seed=1)
    assert arrival_times(profile, seed=1) != arrival_times(profile, seed=2)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "bursty"},
        {"rate": 0},
        {"duration_s": -1},
        {"cv": 0},
        {"spike_start_s": -2},
    ],
)
def test_invalid_profiles_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ArrivalProfile(**bad)  # type: ignore[arg-type]
