"""How a config file's problems are told: one line each, naming the file, the line, the key
path and what is wrong, with a "did you mean" where a name looks misspelt.

Nothing here knows the gateway's settings: `describe` reads pydantic's errors against
whatever model it is given, and `ConfigDocument` finds a key path's line in the YAML text.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic_core import ErrorDetails

Loc = tuple[str | int, ...]

# what a value of these keys is called in a message ("unknown overflow policy 'degrad'")
NOUNS = {"overflow": "overflow policy"}


@dataclass(frozen=True, kw_only=True)
class Problem:
    loc: Loc  # the key path, as pydantic writes it: ("pools", 0, "overflow", 1)
    message: str

    @property
    def key(self) -> str:
        return key_path(self.loc)


class Problems(ValueError):
    """Several problems found by one validator, each with its own key path."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{p.key}: {p.message}" for p in problems))
        self.problems = problems


def key_path(loc: Loc) -> str:
    """`pools[0].overflow[1]`, as docs/configuration.md writes keys."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "(top level)"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe(errors: Sequence[ErrorDetails], *, root: type[BaseModel]) -> list[Problem]:
    """pydantic's errors for `root`, as problems a person reads."""
    return [problem for error in errors for problem in _describe(error, root)]


def _describe(error: ErrorDetails, root: type[BaseModel]) -> list[Problem]:
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, Problems):
        return [Problem(loc=(*loc, *p.loc), message=p.message) for p in cause.problems]
    if kind == "extra_forbidden":
        message = _unknown(f"key {loc[-1]!r}", str(loc[-1]), _keys(_type_at(root, loc[:-1])))
    elif kind == "missing":
        message = "required, and missing"
    elif kind == "literal_error":
        key = next((str(p) for p in reversed(loc) if isinstance(p, str)), "value")
        noun = NOUNS.get(key, key)
        message = _unknown(f"{noun} {value!r}", str(value), _choices(_type_at(root, loc)))
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = f"should be a mapping of keys to values, not {_kind(value)}"
    elif kind == "list_type":
        message = f"should be a list, not {_kind(value)}"
    elif kind == "value_error":
        message = str(cause)
    else:
        message = error["msg"].removeprefix("Input ") + _got(value)
    return [Problem(loc=loc, message=message)]


def _unknown(what: str, name: str, known: Sequence[str]) -> str:
    hint = did_you_mean(name, known)
    if hint or not known:
        return f"unknown {what}{hint}"
    return f"unknown {what} (known: {', '.join(known)})"


def _type_at(root: Any, loc: Loc) -> Any:
    """The annotation that types the value at `loc`, or None where it cannot be told."""
    kind = root
    for part in loc:
        kind = _without_none(kind)
        if isinstance(part, int) and get_origin(kind) is list:
            kind = get_args(kind)[0]
        elif get_origin(kind) is dict:
            kind = get_args(kind)[1]
        elif isinstance(kind, type) and issubclass(kind, BaseModel) and part in kind.model_fields:
            kind = kind.model_fields[str(part)].annotation
        else:
            return None
    return _without_none(kind)


def _without_none(kind: Any) -> Any:
    if get_origin(kind) in (Union, UnionType):
        args = [a for a in get_args(kind) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return kind


def _keys(kind: Any) -> list[str]:
    return list(kind.model_fields) if isinstance(kind, type) and issubclass(kind, BaseModel) else []


def _choices(kind: Any) -> list[str]:
    return [str(c) for c in get_args(kind)] if get_origin(kind) is Literal else []


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def _got(value: Any) -> str:
    scalar = isinstance(value, str | int | float | bool) or value is None
    return f", not {_kind(value)}" if scalar else ""


@dataclass(frozen=True, kw_only=True)
class ConfigDocument:
    """A config file's name and its YAML node tree (None when there is no text to point
    into), to tell each problem on the line where its key is written."""

    name: str
    root: yaml.Node | None = None

    @classmethod
    def parse(cls, name: str, text: str) -> ConfigDocument:
        """Raises yaml.YAMLError for text that is not YAML."""
        return cls(name=name, root=yaml.compose(text, Loader=yaml.SafeLoader))

    def line_of(self, loc: Loc) -> int | None:
        """The line of the deepest part of `loc` written in the file."""
        node, line = self.root, None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                found = [(k, v) for k, v in node.value if k.value == part]
                if not found:
                    break
                key, node = found[-1]
                line = key.start_mark.line + 1
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
                if not 0 <= part < len(node.value):
                    break
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                break
        return line

    def lines(self, problems: Iterable[Problem], *, warning: bool = False) -> list[str]:
        """One line per problem, in the order of the file."""
        found = [(self.line_of(p.loc), p) for p in problems]
        found.sort(key=lambda item: item[0] or 0)
        label = "warning: " if warning else ""
        return [
            f"{self.name if line is None else f'{self.name}:{line}'}: {label}{p.key}: {p.message}"
            for line, p in found
        ]

    def repeated_keys(self) -> list[Problem]:
        """Keys written twice in one mapping: YAML keeps the last, silently."""
        return list(_repeated(self.root, (), seen=set()))


def _repeated(node: yaml.Node | None, loc: Loc, *, seen: set[int]) -> Iterator[Problem]:
    if node is None or id(node) in seen:  # an alias: its node was walked already
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _repeated(item, (*loc, i), seen=seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name is not None and name != "<<":  # `<<` merges, and may be repeated
                if name in first:
                    yield Problem(
                        loc=(*loc, name),
                        message=f"written twice (first on line {first[name]}); "
                        "only the last would count",
                    )
                first.setdefault(name, key.start_mark.line + 1)
            yield from _repeated(value, (*loc, name) if name else loc, seen=seen)


def yaml_syntax(name: str, exc: yaml.YAMLError) -> str:
    """A YAML syntax error, as one line naming the file, the line and the column."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"{name}: not valid YAML: {exc}"
    mark, context = exc.problem_mark, ""
    if exc.context and exc.context_mark is not None:
        where = exc.context_mark
        context = f" ({exc.context} from line {where.line + 1}, column {where.column + 1})"
    return f"{name}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {exc.problem}{context}"
