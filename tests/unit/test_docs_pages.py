"""The README is the project's card (what it is, the two commands, the Quickstart, links into
the site) and the site holds the rest: its Quickstart is the site's, its links lead to files
that exist, and every example config is shown on the site whole."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"```\w*\n(.*?)```", re.DOTALL)
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_its_sections_are_the_card() -> None:
    assert README.count("\n") <= 100
    assert re.findall(r"^## (.+)$", README, re.MULTILINE) == [
        "Two commands",
        "Quickstart",
        "Documentation",
    ]
    assert "make demo" in README and "make test" in README


def test_the_readmes_quickstart_is_the_sites() -> None:
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    blocks = FENCE.findall(README.split("## Quickstart", 1)[1])
    assert len(blocks) == 2
    for block in blocks:
        assert block in quickstart


def test_every_link_of_the_readme_leads_to_a_file() -> None:
    targets = LINK.findall(README)
    assert "docs/getting-started.md" in targets
    for target in targets:
        assert (ROOT / target).is_file(), target


def test_every_example_config_is_on_the_site() -> None:
    page = (ROOT / "docs" / "examples.md").read_text()
    for example in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        assert f'--8<-- "deploy/examples/{example.name}"' in page, example.name
