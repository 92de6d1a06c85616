"""`spillgate` command line: one subcommand per module, imported only when chosen.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`; one with
commands of its own (`bench`) exposes `main(argv) -> int` instead and parses its arguments.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway from a YAML config"),
    "demo": ("loadtest.sim.demo", "run a whole local fleet: gateway, simulated backends, provider"),
    "plan": ("gateway.capacity.cli", "capacity plan: KV-cache sessions, tokens/s, GPUs needed"),
    "sim": ("loadtest.sim.cli", "simulated vLLM replica (or external provider)"),
    "loadtest": ("loadtest.loadgen.cli", "open-loop streaming load generator"),
    "drill": ("loadtest.drill.cli", "spike drill: fails loudly if an overflow path is broken"),
    "measure": ("loadtest.measure.cli", "measure batch fill vs TTFT of a live endpoint"),
    "bench": (
        "loadtest.bench.cli",
        "benchmarks by name (`spillgate bench --list`); alone, the gateway's overhead",
    ),
}


class CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class CommandsModule(Protocol):
    def main(self, argv: Sequence[str] | None = None) -> int: ...


def shown_default(action: argparse.Action) -> str | None:
    """An option's default as `--help` and docs/commands.md show it; None where it has none
    to show, or its help says it already."""
    default = action.default
    if (
        not action.option_strings
        or default is None
        or default is False
        or default is argparse.SUPPRESS
        or default == []
        or "default" in (action.help or "")
    ):
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(str(d) for d in default)
    return str(default)


class DefaultsShown(argparse.HelpFormatter):
    """`--help` names each option's default where it has one and its help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = shown_default(action)
        if default is None:
            return action.help
        said = f"default: {default}".replace("%", "%%")
        return f"{action.help} ({said})" if action.help else said


def command_parser(name: str) -> tuple[argparse.ArgumentParser, CommandModule] | None:
    """The parser `spillgate NAME` reads its options with, and the module that runs them;
    None for a command with commands of its own (`bench`)."""
    module_name, help_ = COMMANDS[name]
    imported = importlib.import_module(module_name)
    if not hasattr(imported, "add_arguments"):
        return None
    module = cast(CommandModule, imported)
    parser = argparse.ArgumentParser(
        prog=f"spillgate {name}", description=help_, formatter_class=DefaultsShown
    )
    module.add_arguments(parser)
    return parser, module


def _usage() -> str:
    lines = ["usage: spillgate COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `spillgate COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = args[0]
    if name not in COMMANDS:
        print(f"spillgate: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        built = command_parser(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        # the wheel leaves the benchmarks out (pyproject.toml): they run from a checkout
        print(f"spillgate: `{name}` is not installed here; run it from a checkout", file=sys.stderr)
        return 2
    if built is None:
        return cast(CommandsModule, importlib.import_module(module_name)).main(args[1:])
    parser, module = built
    return module.run(parser.parse_args(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
