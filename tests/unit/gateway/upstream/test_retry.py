"""How many more times an upstream call is tried after a first failure, and when the
tries stop."""

from __future__ import annotations

import asyncio

import pytest

from gateway.clock import ManualClock
from gateway.errors import UpstreamUnavailable
from gateway.upstream.retry import ATTEMPTS, tried_again


class Tries:
    """An upstream call failing before its first byte `failures` times, then answering;
    each try takes `takes_s` on the clock."""

    def __init__(self, clock: ManualClock, *, failures: int, takes_s: float = 0.0) -> None:
        self.clock = clock
        self.failures = failures
        self.takes_s = takes_s
        self.made = 0

    async def __call__(self) -> str:
        self.made += 1
        self.clock.advance(self.takes_s)
        if self.made <= self.failures:
            raise UpstreamUnavailable(f"http_503: try {self.made}")
        return f"answered on try {self.made}"


def again(tries: Tries, *, deadline_s: float = 60.0) -> str:
    deadline = tries.clock.monotonic() + deadline_s
    return asyncio.run(tried_again(tries, deadline=deadline, clock=tries.clock))


def test_the_next_try_that_answers_is_returned() -> None:
    tries = Tries(ManualClock(), failures=0)
    assert again(tries) == "answered on try 1"
    assert tries.made == 1


def test_a_failure_before_the_first_byte_is_tried_again_while_tries_are_left() -> None:
    # after the first try (made by the caller), ATTEMPTS - 1 more
    tries = Tries(ManualClock(), failures=ATTEMPTS - 2)
    assert again(tries) == f"answered on try {ATTEMPTS - 1}"


def test_the_tries_end_at_ATTEMPTS_raising_the_last_failure() -> None:
    tries = Tries(ManualClock(), failures=10)
    with pytest.raises(UpstreamUnavailable, match="try 2"):
        again(tries)
    assert tries.made == ATTEMPTS - 1 == 2


def test_no_new_try_starts_once_the_deadline_has_passed_on_the_clock() -> None:
    tries = Tries(ManualClock(), failures=10, takes_s=11.0)
    with pytest.raises(UpstreamUnavailable, match="try 1"):
        again(tries, deadline_s=10.0)
    assert tries.made == 1


def test_other_errors_are_not_tried_again() -> None:
    clock = ManualClock()
    made = 0

    async def fails() -> str:
        nonlocal made
        made += 1
        raise ValueError("not an upstream failure")

    with pytest.raises(ValueError):
        asyncio.run(tried_again(fails, deadline=clock.monotonic() + 60, clock=clock))
    assert made == 1
