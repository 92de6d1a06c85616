"""`spillgate bench instructions`: its plumbing, in seconds. A count of the gateway's
own instructions takes minutes under callgrind (imports alone run 2.5 billion); that is the
benchmark's to run, not the test suite's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from loadtest.bench.instructions import ARMS, callgrind_total, child_command
from loadtest.bench.overhead import _uvicorn
from loadtest.procs import free_port, serving_process

needs_valgrind = pytest.mark.skipif(
    shutil.which("valgrind") is None, reason="needs valgrind (apt-get install valgrind)"
)


@needs_valgrind
def test_callgrind_counts_the_instructions_a_command_ran(tmp_path: Path) -> None:
    true = shutil.which("true")
    assert true is not None
    total = callgrind_total([true], tmp_path / "true.out")
    assert 10_000 < total < 10_000_000  # /bin/true on glibc: about 127 thousand


@needs_valgrind
def test_a_command_that_fails_under_callgrind_is_an_error_not_a_count(tmp_path: Path) -> None:
    false = shutil.which("false")
    assert false is not None
    with pytest.raises(RuntimeError, match="false failed under callgrind"):
        callgrind_total([false], tmp_path / "false.out")


def test_the_child_sends_its_requests_through_each_arm_and_checks_the_answers() -> None:
    port = free_port()
    with serving_process(_uvicorn("loadtest.bench.apps:backend", port), port) as backend:
        for arm in ARMS:
            done = subprocess.run(
                child_command(arm, 3, backend), capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr
    # the backend is gone: the child fails rather than count requests that were refused
    done = subprocess.run(
        child_command("spillgate", 1, backend), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "not only 200" in done.stderr
