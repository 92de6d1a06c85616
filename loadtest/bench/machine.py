"""What the benchmarks arrange on the machine they run on: the backend on a core of its own
and everything else on the others, a folder for their processes' output, progress on
stderr (stdout is the report's)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


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
