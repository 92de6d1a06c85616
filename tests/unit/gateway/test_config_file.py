"""A config file's problems name the file and the line each key is written on."""

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.config.problems import Problem

GOOD = """\
tenants:
  - name: acme
    key_env: ACME_API_KEY
pools:
  - name: big
    overflow: [queue, reject]
    backends:
      - url: http://127.0.0.1:1
"""


def _problems(tmp_path: Path, text: str | bytes) -> list[str]:
    path = tmp_path / "gw.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return [line.replace(str(path), "gw.yaml") for line in info.value.problems]


def test_each_problem_is_told_on_the_line_of_its_key(tmp_path: Path) -> None:
    text = GOOD.replace("[queue, reject]", "[queue, degrad]").replace(
        "    backends:", "    targetfill: 0.5\n    degrade_to: smal\n    backends:"
    )
    assert _problems(tmp_path, text) == [
        "gw.yaml:6: pools[0].overflow[1]: unknown overflow policy 'degrad'; did you mean "
        "'degrade'?",
        "gw.yaml:7: pools[0].targetfill: unknown key 'targetfill'; did you mean 'target_fill'?",
        "gw.yaml:8: pools[0].degrade_to: no pool named 'smal'",
    ]


def test_a_missing_key_is_told_on_the_line_of_what_lacks_it(tmp_path: Path) -> None:
    assert _problems(tmp_path, GOOD.replace("      - url: http://127.0.0.1:1", "      - {}")) == [
        "gw.yaml:8: pools[0].backends[0].url: required, and missing"
    ]
    assert _problems(tmp_path, GOOD.split("pools:")[0]) == ["gw.yaml: pools: required, and missing"]


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    assert _problems(tmp_path, GOOD.replace("    key_env:", "   key_env:")) == [
        "gw.yaml:3:4: not valid YAML: expected <block end>, but found '<block mapping start>' "
        "(while parsing a block collection from line 2, column 3)"
    ]
    assert _problems(tmp_path, "pools: [a, b\n") == [
        "gw.yaml:2:1: not valid YAML: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence from line 1, column 8)"
    ]


def test_a_key_written_twice_is_refused(tmp_path: Path) -> None:
    text = GOOD.replace(
        "    overflow:", "    target_fill: 0.5\n    target_fill: 0.8\n    overflow:"
    )
    assert _problems(tmp_path, text) == [
        "gw.yaml:7: pools[0].target_fill: written twice (first on line 6); only the last "
        "would count"
    ]


def test_a_file_that_cannot_be_read_says_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.yaml")
    assert info.value.problems == [
        f"{tmp_path / 'absent.yaml'}: cannot be read: No such file or directory"
    ]
    assert _problems(tmp_path, b"tenants: \xff\n") == ["gw.yaml: not UTF-8 text (byte 9)"]
    assert _problems(tmp_path, "") == [
        "gw.yaml: (top level): the file is empty: it needs tenants and pools"
    ]


def test_a_later_problem_is_told_on_its_line_and_a_warning_says_so(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(GOOD)
    loaded = load_config(path)
    unset = [Problem(loc=("tenants", 0, "key_env"), message="$ACME_API_KEY is not set")]
    assert loaded.document.lines(unset) == [
        f"{path}:3: tenants[0].key_env: $ACME_API_KEY is not set"
    ]
    assert loaded.document.lines(unset, warning=True) == [
        f"{path}:3: warning: tenants[0].key_env: $ACME_API_KEY is not set"
    ]
