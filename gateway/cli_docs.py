"""The command reference in docs/commands.md, written from each command's own parser.

Each option's row is what `spillgate COMMAND --help` prints for it: its flags, its default and
its help, so the page cannot drift from what the commands accept. The page's prose around the
reference is written by hand; only the part between the two markers is generated.
`python -m gateway.cli_docs` rewrites that part; `--check` exits 1, changing nothing, when it
is stale.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from gateway.cli import COMMANDS, command_parser, shown_default
from gateway.config.docs import regenerate, splice, table_cell

PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
COMMAND = "python -m gateway.cli_docs"
BEGIN = f"<!-- generated from each command's parser by `{COMMAND}`: edit the parsers, not this -->"
END = "<!-- end of the generated reference -->"
# argparse's own titles for the options outside any group the command named
UNGROUPED = ("options", "optional arguments", "positional arguments")


def render() -> str:
    """The generated part of the page, markers included."""
    parts = [BEGIN, "| command | what it does |\n|---|---|"]
    parts[-1] += "".join(
        f"\n| [`spillgate {n}`](#spillgate-{n}) | {h} |" for n, (_, h) in COMMANDS.items()
    )
    for name in COMMANDS:
        parts += list(_command(name))
    parts.append(END)
    return "\n\n".join(parts)


def rewrite(page: str) -> str:
    """`page` with the part between the markers generated afresh."""
    return splice(page, render(), begin=BEGIN, end=END)


def _command(name: str) -> Iterator[str]:
    yield f"### `spillgate {name}`"
    built = command_parser(name)
    if built is None:  # a command of commands (`bench`): each has its own --help
        yield from _subcommands(name)
        return
    parser, _ = built
    yield parser.description or ""
    # argparse offers no public view of its groups; --help reads the same lists
    for group in parser._action_groups:
        rows = [_row(parser, action) for action in group._group_actions if _shown(action)]
        if not rows:
            continue
        if group.title not in UNGROUPED:
            yield f"**{group.title}**" + (f": {group.description}" if group.description else "")
        yield "| option | default | meaning |\n|---|---|---|\n" + "\n".join(rows)


def _subcommands(name: str) -> Iterator[str]:
    module = importlib.import_module(COMMANDS[name][0])
    yield COMMANDS[name][1]
    yield f"`spillgate {name} NAME --help` shows a benchmark's own options."
    table = getattr(module, "BENCHES", {})
    yield "| name | what it measures |\n|---|---|\n" + "\n".join(
        f"| `{bench}` | {table_cell(what)} |" for bench, (_, what) in table.items()
    )


def _shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.option_strings:
        metavar = "" if action.nargs == 0 else f" {_metavar(action)}"
        flags = ", ".join(f"`{flag}{metavar}`" for flag in action.option_strings)
    else:
        flags = f"`{_metavar(action)}`"
    if action.required:
        default = "required"
    else:
        default = shown_default(action) or ""
        default = f"`{default}`" if default else ""
    meaning = (action.help or "") % {**vars(action), "prog": parser.prog}
    if action.choices is not None and not isinstance(action.choices, dict):
        meaning += f" (one of {', '.join(f'`{c}`' for c in action.choices)})"
    return f"| {flags} | {default} | {table_cell(meaning)} |"


def _metavar(action: argparse.Action) -> str:
    if isinstance(action.metavar, str):
        return action.metavar
    return action.dest.upper() if action.option_strings else action.dest


def main(argv: Sequence[str] | None = None) -> int:
    return regenerate(
        argv,
        page=PAGE,
        rewritten=rewrite,
        command=COMMAND,
        description="Write the command reference from the commands' parsers.",
    )


if __name__ == "__main__":
    sys.exit(main())
