"""Where the admission bench runs: the backend on one core, the bench on the others, and
the bench's own affinity as it was once the backend stops."""

from __future__ import annotations

import os
import shutil

from loadtest.bench.machine import backend_core, off_core


def test_the_bench_keeps_off_the_backends_core_and_then_returns_to_all() -> None:
    before = os.sched_getaffinity(0)
    core = min(before)
    with off_core(core):
        # a single core is kept: there is nowhere else to go
        assert os.sched_getaffinity(0) == (before - {core} or before)
    assert os.sched_getaffinity(0) == before


def test_without_a_core_to_spare_nothing_moves() -> None:
    before = os.sched_getaffinity(0)
    with off_core(None):
        assert os.sched_getaffinity(0) == before
    expected = min(before) if len(before) > 1 and shutil.which("taskset") else None
    assert backend_core() == expected
