"""The configuration reference in docs/configuration.md, written from the settings models.

Each key's meaning is its field's `description` (a nested model's field without one takes the
model's docstring), and its default is the model's own, so the page cannot drift from what
`serve` accepts. The page's prose around the tables is written by hand; only the part between
the two markers is generated. `python -m gateway.config.docs` rewrites that part;
`--check` exits 1, changing nothing, when it is stale.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from gateway.config.settings import Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "python -m gateway.config.docs"
BEGIN = f"<!-- generated from gateway/config/ by `{COMMAND}`: edit the models, not this -->"
END = "<!-- end of the generated reference -->"
REQUIRED = "—"


@dataclass(frozen=True, kw_only=True)
class Row:
    key: str  # the key path as problems name it: `pools[].queue.max_depth`
    default: str  # as markdown
    meaning: str  # as markdown, on one line


@dataclass(frozen=True, kw_only=True)
class Section:
    """One top-level key of the file: its intro and the rows of the keys below it."""

    key: str
    intro: str
    rows: tuple[Row, ...]


class Undocumented(Exception):
    """A setting with neither a description nor, for a nested model, a docstring."""


def sections(root: type[BaseModel] = Settings) -> list[Section]:
    """The reference of `root`: one section per top-level key, in the model's order."""
    out = []
    for name, field in root.model_fields.items():
        model, many = _model_of(field.annotation)
        key = f"{name}[]" if many else name
        if model is None:
            raise Undocumented(f"{key}: a top-level setting should be a model or list of them")
        intro = field.description or _docstring(model)
        if not intro:
            raise Undocumented(
                f"{key}: give the field a description or {model.__name__} a docstring"
            )
        default = None if many or field.is_required() else field.get_default()
        out.append(Section(key=key, intro=intro, rows=tuple(_rows(model, key, default))))
    return out


def render(root: type[BaseModel] = Settings) -> str:
    """The generated part of the page, markers included."""
    parts = [BEGIN]
    for section in sections(root):
        parts += [
            f"### `{section.key}`",
            section.intro,
            "| key | default | meaning |\n|---|---|---|\n"
            + "\n".join(
                f"| `{row.key}` | {table_cell(row.default)} | {table_cell(row.meaning)} |"
                for row in section.rows
            ),
        ]
    parts.append(END)
    return "\n\n".join(parts)


def rewrite(page: str, root: type[BaseModel] = Settings) -> str:
    """`page` with the part between the markers generated afresh."""
    return splice(page, render(root), begin=BEGIN, end=END)


def splice(page: str, generated: str, *, begin: str, end: str) -> str:
    """`page` with its part from `begin` to `end` (markers included) replaced by `generated`,
    which starts and ends with those markers."""
    first, last = page.find(begin), page.find(end)
    if first < 0 or last < first:
        raise ValueError(f"the page has no markers: put {begin!r} and {end!r} where it goes")
    return page[:first] + generated + page[last + len(end) :]


def regenerate(
    argv: Sequence[str] | None,
    *,
    page: Path,
    rewritten: Callable[[str], str],
    command: str,
    description: str,
) -> int:
    """The command that writes a page's generated part afresh (`command [PAGE] [--check]`);
    with `--check` it exits 1 if the part is stale, changing nothing."""
    parser = argparse.ArgumentParser(prog=command, description=description)
    parser.add_argument("page", nargs="?", type=Path, default=page, help="default: %(default)s")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    fresh = rewritten(text)
    if fresh == text:
        return 0
    if args.check:
        print(f"{args.page} is stale: run `{command}` to rewrite it", file=sys.stderr)
        return 1
    args.page.write_text(fresh, encoding="utf-8")
    print(f"{args.page}: rewritten")
    return 0


def _rows(model: type[BaseModel], prefix: str, defaults: BaseModel | None) -> Iterator[Row]:
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        nested, many = _model_of(field.annotation)
        meaning = field.description or (_docstring(nested) if nested else "")
        if not meaning:
            raise Undocumented(f"{key}: give the field a description=")
        if field.is_required():
            value: Any = None
        elif defaults is not None:
            value = getattr(defaults, name)
        else:
            value = field.get_default(call_default_factory=True)
        shown = REQUIRED if field.is_required() else _default(value)
        yield Row(key=f"{key}[]" if many else key, default=shown, meaning=meaning)
        if nested is not None:
            yield from _rows(nested, f"{key}[]" if many else key, None if many else value)


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds, and whether it holds a list of them."""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return (item, True) if _is_model(item) else (None, False)
    return (annotation, False) if _is_model(annotation) else (None, False)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return " ".join(inspect.cleandoc(doc).split()) if isinstance(doc, str) else ""


def _default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        leaves = [
            f"{name} {_plain(getattr(value, name))}"
            for name, field in type(value).model_fields.items()
            if _model_of(field.annotation)[0] is None
        ]
        return f"`{', '.join(leaves)}`"
    return f"`{_plain(value)}`"


def _plain(value: Any) -> str:
    """A value as one would write it in the YAML file."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
    return str(value)


def table_cell(text: str) -> str:
    """`text` as one cell of a Markdown table: its pipes escaped, on one line."""
    return " ".join(text.replace("|", "\\|").split())


def main(argv: Sequence[str] | None = None) -> int:
    return regenerate(
        argv,
        page=PAGE,
        rewritten=rewrite,
        command=COMMAND,
        description="Write the configuration reference from the settings models.",
    )


if __name__ == "__main__":
    sys.exit(main())
