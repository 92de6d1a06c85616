"""Admission in vLLM's blocks: the burst that made a real vLLM preempt never preempts here.

On a real vLLM 0.32 server with 32 blocks of 128 tokens (one kept back), seven sequences of
~106 + 412 tokens fitted the gateway's old token limit (4,096 x 0.9 = 3,686) but grew to 35
blocks: vLLM preempted. The simulator allocates as vLLM does; sent directly, the burst
preempts there too. Through the gateway, which counts whole blocks and the block kept back,
it never does.
"""

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet, until_ready
from tests.support.overflow import sample

PROMPT = list(range(100, 206))  # 106 token ids
MAX_TOKENS = 412
BURST = 7


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sim = SimConfig(model="m", kv_tokens=32 * 128, block_size=128, speed=4.0)
    with run_fleet(
        pools={"m": [sim]},
        pool_options={
            "m": {
                "target_fill": 0.9,
                "overflow": ["queue", "reject"],
                "queue": {"max_wait_s": 30.0},
                # the block arithmetic alone: the direct burst's preemptions would otherwise
                # (rightly) lower the fill the gateway admits to
                "feedback": False,
            }
        },
    ) as f:
        yield f


def preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_preemptions_total")


async def burst(url: str, headers: dict[str, str]) -> list[int]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(BURST))
        )
    return [r.status_code for r in responses]


def test_a_burst_that_preempts_direct_never_preempts_through_the_gateway(fleet: Fleet) -> None:
    backend = fleet.backends["m"][0].url
    until_ready(fleet)
    assert sample(fleet, "spillgate_capacity_tokens", backend="m-0") == 31 * 128

    assert asyncio.run(burst(backend, {})) == [200] * BURST
    direct = preemptions(backend)
    assert direct > 0  # what the gateway's old arithmetic let through

    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    assert asyncio.run(burst(fleet.url, headers)) == [200] * BURST
    assert preemptions(backend) == direct  # none more
    assert sample(fleet, "spillgate_requests_total", pool="m", tenant="acme", outcome="queued") == 2
