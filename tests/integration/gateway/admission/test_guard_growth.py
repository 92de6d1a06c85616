"""The prefix herding guard counts a stream at the size it has grown to.

Two simulated vLLMs of 16,384 tokens behind a real gateway that routes by prefix. Each
stream reserves its prompt (about 130 tokens) and 16 tokens of output (`prior_tokens`),
then grows block by block as it streams. A second request of the same prompt joins the
first where the prompt is cached. Once the first has grown past 3,700 tokens, the prompt
alone would hold (3,700 + 160) / 16,384 = 0.236 of that backend with another request,
over the guard's bound for a pool whose mean fill is then 0.118 (0.118 + 0.1): a third
request goes to the other backend. Counted at its admitted 160 tokens, the first would
leave the prompt at 0.02 of the backend, and the third would join it: the backend is a
fifth full, under the floor past which its whole load counts (0.45).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.capacity.perf import StepCost
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, admin_status, run_fleet
from tests.support.shared_prompt import streaming

SYSTEM = {"role": "system", "content": "You route by prefix. " * 20}  # 420 characters
FAST_STEPS = StepCost(  # a decode step of 1 ms: 3,700 tokens in about 4 s
    weights_bytes_per_rank=1.0,
    kv_bytes_per_token_per_rank=1e-9,
    bandwidth_bytes_per_s=1000.0,
    prefill_flops_per_token=1.0,
    flops_per_s=1e9,
)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    sim = SimConfig(
        model="m", kv_tokens=16_384, block_size=16, max_model_len=8192, step_cost=FAST_STEPS
    )
    options = {
        "routing": "prefix",
        "target_fill": 0.9,
        "feedback": False,
        "overflow": ["reject"],
        "reservation": {"mode": "learned", "prior_tokens": 16, "min_samples": 1000},
    }
    with run_fleet(pools={"m": [sim, sim]}, pool_options={"m": options}) as f:
        deadline = time.monotonic() + 20
        while httpx.get(f"{f.url}/readyz", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never became ready"
            time.sleep(0.05)
        yield f


def sessions(fleet: Fleet) -> dict[str, tuple[int, int]]:
    """backend → (tokens in flight, sessions)."""
    (pool,) = admin_status(fleet.url)["pools"]
    return {b["name"]: (b["tokens_in_flight"], b["active_sessions"]) for b in pool["backends"]}


def test_a_grown_stream_counts_at_its_grown_size_in_the_herding_guard(fleet: Fleet) -> None:
    key = fleet.keys["acme"]

    async def run() -> None:
        async with streaming(fleet.url, key, "q1", system=SYSTEM, max_tokens=6000):
            (home,) = [name for name, (_, n) in sessions(fleet).items() if n == 1]
            # at its admitted size, the first leaves room for the prompt's next request
            async with streaming(fleet.url, key, "q2", system=SYSTEM, max_tokens=6000):
                assert sessions(fleet)[home][1] == 2
            deadline = time.monotonic() + 20
            while sessions(fleet)[home][0] < 3700:
                assert time.monotonic() < deadline, f"the stream never grew: {sessions(fleet)}"
                await asyncio.sleep(0.05)
            async with streaming(fleet.url, key, "q3", system=SYSTEM, max_tokens=6000):
                placed = sessions(fleet)
                assert placed[home][1] == 1, placed
                assert sum(n for _, n in placed.values()) == 2

    asyncio.run(run())
