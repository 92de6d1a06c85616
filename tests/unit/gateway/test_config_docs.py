"""docs/configuration.md is the settings models' own description: every key, its default
and its meaning, regenerated in memory and compared, so the page cannot drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel, Field

from gateway.config import Settings
from gateway.config.docs import (
    BEGIN,
    COMMAND,
    END,
    PAGE,
    Undocumented,
    main,
    rewrite,
    sections,
)


def rows() -> dict[str, tuple[str, str]]:
    return {row.key: (row.default, row.meaning) for s in sections() for row in s.rows}


def test_the_page_is_what_the_models_generate() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert rewrite(page) == page, f"{PAGE} is stale: run `{COMMAND}` to rewrite it"


def test_every_setting_of_every_model_has_a_row() -> None:
    def keys(model: type[BaseModel], prefix: str) -> set[str]:
        found = set()
        for name, field in model.model_fields.items():
            many = get_origin(field.annotation) is list
            inner = get_args(field.annotation)[0] if many else field.annotation
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                key = f"{prefix}{name}" + ("[]" if many else "")
                found |= keys(inner, f"{key}.")
                if prefix:  # a top-level key is a section, not a row
                    found.add(key)
            else:
                found.add(f"{prefix}{name}")
        return found

    assert set(rows()) == keys(Settings, "")
    assert [s.key for s in sections()] == [
        *("server", "redis", "ratelimit", "ledger", "tenants[]", "pools[]", "providers[]"),
        *("routing_profiles[]", "tracing", "batch"),
    ]


def test_defaults_are_written_as_in_the_file() -> None:
    table = rows()
    assert table["server.max_body_bytes"][0] == "`1048576`"
    assert table["server.request_read_timeout_s"][0] == "`30`"
    assert table["redis.cluster"][0] == "`false`"
    assert table["pools[].overflow"][0] == "`[reject]`"
    assert table["pools[].queue.max_wait_s"][0] == "`auto`"
    assert table["pools[].queue.max_tokens"][0] == "none"
    assert table["tenants[].name"][0] == "—"
    assert table["providers[].models"][0] == "`{}`"
    assert table["pools[].timeouts"][0] == "`connect 2, first_token 30, idle 30, total 600`"
    # a nested model's defaults are those of the instance its parent holds
    assert table["providers[].timeouts.first_token"][0] == "`20`"
    assert table["pools[].timeouts.first_token"][0] == "`30`"


def test_a_nested_model_without_a_description_is_described_by_its_docstring() -> None:
    meaning = rows()["pools[].queue"][1]
    assert meaning.startswith("The fair queue: priority class first, then the tenant")


def test_a_setting_without_a_meaning_is_refused_by_name() -> None:
    class Inner(BaseModel):
        """Inner."""

        size: int = 1

    class Root(BaseModel):
        inner: Inner = Inner()

    with pytest.raises(Undocumented, match=r"^inner\.size: give the field a description="):
        sections(Root)


def test_a_pipe_in_a_meaning_does_not_split_the_cell() -> None:
    class Inner(BaseModel):
        """Inner."""

        mode: str = Field("a", description="`a` | `b`")

    class Root(BaseModel):
        inner: Inner = Inner()

    page = rewrite(f"{BEGIN}\n{END}\n", Root)
    assert "| `inner.mode` | `a` | `a` \\| `b` |" in page


def test_the_command_rewrites_a_stale_page_and_check_refuses_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# Reference\n\n{BEGIN}\nold\n{END}\n\nAfter.\n")
    assert main([str(page), "--check"]) == 1
    assert f"run `{COMMAND}` to rewrite it" in capsys.readouterr().err
    assert main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Reference\n\n") and text.endswith(f"{END}\n\nAfter.\n")
    assert "| `pools[].continue_streams` | `2` |" in text
    assert main([str(page), "--check"]) == 0


def test_a_page_without_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no markers"):
        rewrite("# Reference\n")


def test_a_meaning_is_a_sentence_or_two_and_names_no_internals() -> None:
    """How a setting works inside lives in the architecture pages; the reference says what it
    means, with no source paths or Redis key names."""
    for section in sections():
        for row in section.rows:
            assert len(row.meaning) <= 360, f"{row.key}: {len(row.meaning)} characters"
            assert not re.search(r"\.py\b|spillgate:", row.meaning), row.key
        assert not re.search(r"\.py\b|spillgate:", section.intro), section.key
