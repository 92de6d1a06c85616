"""`python -m loadtest.bench_instructions`: machine instructions per request under callgrind,
each arm's own app against the real zero-delay backend."""

from __future__ import annotations

import shutil

import pytest

from loadtest.bench_instructions import count

pytestmark = pytest.mark.skipif(
    shutil.which("valgrind") is None, reason="needs valgrind (apt-get install valgrind)"
)


def test_counts_instructions_per_request_and_the_gateway_runs_more_than_the_raw_relay() -> None:
    result = count(requests=4, warmup=2)
    raw, gateway = result["raw relay"], result["spillgate"]
    # a relayed request through aiohttp and uvloop is some hundreds of thousands
    assert 100_000 < raw < 2_000_000
    # the gateway relays the same way and runs its pipeline besides
    assert raw < gateway < 4 * raw
