"""The demo's banner tells how to type `spillgate` as the docs write it when the shell that
started it (`make demo`, which runs the virtual environment's script) could not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loadtest.sim.demo import _on_path


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("spillgate", "activate"):
        (bin_dir / name).write_text("#!/bin/sh\n")
    (bin_dir / "spillgate").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [".venv/bin/spillgate", "demo"])
    return bin_dir


def test_off_path_it_says_to_activate_the_environment(
    venv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert _on_path() == [
        "  commands:     . .venv/bin/activate   (puts spillgate on your PATH, in each new shell)"
    ]


def test_on_path_it_says_nothing(venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{venv}:/usr/bin:/bin")
    assert _on_path() == []
