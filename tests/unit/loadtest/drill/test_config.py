"""The drill's inputs: a drill file and flags, checked before anything starts."""

import argparse
from pathlib import Path

import pytest

from loadtest.drill import cli as drill


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    drill.add_arguments(parser)
    return parser.parse_args(argv)


def test_a_drill_file_sets_the_target_and_the_spike(tmp_path: Path) -> None:
    path = tmp_path / "drill.yaml"
    path.write_text("url: http://gw:8080\nkey: sk-1\nspike_factor: 8\nslo_ttft_ms: 900\n")
    target, script = drill.load_drill_file(path)
    assert target == {"url": "http://gw:8080", "key": "sk-1"}
    assert (script.spike_factor, script.slo_ttft_ms) == (8, 900)
    profile = script.profile
    assert profile.kind == "spike"
    assert profile.duration_s == script.warmup_s + script.spike_s + script.recovery_s


def test_unknown_settings_in_a_drill_file_are_named(tmp_path: Path) -> None:
    path = tmp_path / "drill.yaml"
    path.write_text("url: http://gw\nspike_factr: 8\n")
    with pytest.raises(ValueError, match=r"unknown settings \['spike_factr'\]"):
        drill.load_drill_file(path)


def test_flags_override_the_file_and_a_url_needs_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "drill.yaml"
    path.write_text("url: http://gw\nmodel: big\nslo_ttft_ms: 900\n")
    assert drill.run(_args("-c", str(path), "--slo-ttft-ms", "500", "--key", "k")) == 2
    assert "also give ['admin_token']" in capsys.readouterr().err
    given, script = drill.resolve_inputs(_args("-c", str(path), "--slo-ttft-ms", "500"))
    assert given["url"] == "http://gw" and script.slo_ttft_ms == 500
