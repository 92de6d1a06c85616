"""docs/commands.md is the commands' own parsers: every option, its default and its help,
regenerated in memory and compared, so the page cannot drift from what the commands accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import COMMANDS, command_parser
from gateway.cli_docs import BEGIN, COMMAND, END, PAGE, main, rewrite


def test_the_page_is_what_the_parsers_generate() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert rewrite(page) == page, f"{PAGE} is stale: run `{COMMAND}` to rewrite it"


def test_every_command_and_every_option_of_it_is_on_the_page() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for name in COMMANDS:
        assert f"### `spillgate {name}`" in page
        built = command_parser(name)
        if built is None:
            continue
        for action in built[0]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page, f"spillgate {name} {flag}"


def test_a_row_says_the_default_and_the_help() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert "| `--target-fill TARGET_FILL` | `0.9` | fraction of the KV bound" in page
    assert "| `-c CONFIG`, `--config CONFIG` | required | YAML config file |" in page
    assert "| `--check` |  | validate the config and exit |" in page
    assert "| `overhead` |" in page  # bench's benchmarks, each with its own --help


def test_the_command_rewrites_a_stale_page_and_check_refuses_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "commands.md"
    page.write_text(f"# Commands\n\n{BEGIN}\nold\n{END}\n\nAfter.\n")
    assert main([str(page), "--check"]) == 1
    assert f"run `{COMMAND}` to rewrite it" in capsys.readouterr().err
    assert main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Commands\n\n") and text.endswith(f"{END}\n\nAfter.\n")
    assert main([str(page), "--check"]) == 0
