"""What the benchmarks arrange on the machine they run on: the backend on a core of its own
and everything else on the others, a folder for their processes' output, progress on
stderr (stdout is the report's)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def backend_core() -> int | None:
    """The core the backend runs on alone, the bench on the others (`off_core`); None where
    that cannot be arranged: a single core, or no `taskset` (not Linux)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(allowed) < 2 or not shutil.which("taskset"):
        return None
    return min(allowed)


@contextlib.contextmanager
def off_core(core: int | None) -> Iterator[None]:
    """Run this thread, and every process it starts meanwhile (the gateways, the provider
    simulator), on every core but `core`; as before, after. None: as it is.

    The backend runs on `core` alone (RealVllm.confined, SimOptions.core). Sharing cores
    with the real vLLM, a gateway or the load generator took turns with its engine, which
    polls its worker flat out while it generates, and whole runs of every arm, direct
    included, stalled for seconds. A deployment runs the gateway on other machines than the
    GPUs; this is the nearest a 2-core machine gets.
    """
    before = os.sched_getaffinity(0) if core is not None else set()
    if not before - {core}:
        yield
        return
    os.sched_setaffinity(0, before - {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def logs_dir(kept: Path | None, *, prefix: str) -> Iterator[Path]:
    """Where the bench's processes write their output: `kept` (`--logs`), else a
    temporary folder removed after."""
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def parse_cores(text: str) -> set[int]:
    """A `taskset -c` list (`0`, `0,2`, `0-1`) as a set of cores."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no core in {text!r}")
    return cores


def cores_text(cores: set[int]) -> str:
    """A set of cores as `taskset -c` takes it: `0`, `0,1`."""
    return ",".join(map(str, sorted(cores)))


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Run this thread, and every process and thread it starts meanwhile, on `cores`
    alone; as before, after. None: as it is."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cores_seen(*fragments: str) -> str | None:
    """The cores the processes whose command line holds every one of `fragments` may run
    on, with their descendants' (a server's engine process, say), as `taskset -c` lists
    them; None where no such process runs or /proc cannot tell (not Linux)."""
    proc = Path("/proc")
    commands: dict[int, str] = {}
    parents: dict[int, int] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = command
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found = {pid for pid, command in commands.items() if all(f in command for f in fragments)}
    if not found:
        return None
    tree, grew = set(found), True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    cores: set[int] = set()
    for pid in tree:
        with contextlib.suppress(OSError):
            cores |= os.sched_getaffinity(pid)
    return cores_text(cores) if cores else None


Figures = TypeVar("Figures")


def print_checked(
    figures: Mapping[str, Figures],
    checks: Mapping[str, Mapping[str, bool]],
    table: Callable[[str, Figures], str],
) -> int:
    """Each case's table and whether each of its checks was met; the exit status: 0 when
    every check was."""
    for name, arms in figures.items():
        print(table(name, arms), end="\n\n")
        for check, ok in checks[name].items():
            print(f"{'met' if ok else 'NOT met'}: {check}")
        print()
    return 0 if all(ok for case in checks.values() for ok in case.values()) else 1


def print_targets(checks: Sequence[tuple[bool, str]]) -> int:
    """Each target as PASS or MISS; the exit status: 0 when every one was met."""
    for ok, text in checks:
        print(("PASS " if ok else "MISS ") + text)
    return 0 if all(ok for ok, _ in checks) else 1
