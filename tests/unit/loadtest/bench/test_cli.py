"""`spillgate bench NAME`: the names, each wired to its benchmark's own options, and
`spillgate bench` alone still the overhead benchmark. The dispatch, not a measurement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.bench.cli import BENCHES

ROOT = Path(__file__).resolve().parents[4]


def spillgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_list_names_every_benchmark_with_what_it_measures() -> None:
    done = spillgate("bench", "--list")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert list(listed) == list(BENCHES)
    for name, (_, help_) in BENCHES.items():
        assert listed[name].split(None, 1)[1] == help_


def test_an_unknown_name_is_refused_with_the_valid_ones() -> None:
    done = spillgate("bench", "admision")
    assert done.returncode == 2
    assert "unknown benchmark 'admision'" in done.stderr
    assert all(name in done.stderr for name in BENCHES)


@pytest.mark.parametrize("name", list(BENCHES))
def test_each_name_reaches_its_own_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: spillgate bench {name} ")


def test_options_without_a_name_go_to_the_overhead_benchmark(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--repeats", "many"])
    assert exited.value.code == 2
    assert "spillgate bench overhead: error: argument --repeats" in capsys.readouterr().err
