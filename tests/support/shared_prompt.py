"""Streams that begin with one system prompt, held open while a test reads the ledger.

The figures are worked out by hand for a simulated vLLM with blocks of 16 tokens, each
request reserving its whole `max_tokens` (`reservation: {mode: max_tokens}`):

- the system message is 4,000 characters: as JSON, `{"role":"system","content":"…"}`,
  4,030 bytes, and the user message's JSON follows it; blocks of 16 tokens are keyed every
  64 bytes (4 characters a token), so the first 62 keys lie wholly in the system message
  and the 63rd spans into the user message (4,030 + 30 bytes: 63 whole keys);
- the prompt is estimated at int((4,000 + 16 + 2 + 16) / 4) + 1 = 1,009 tokens (the
  estimator's first 4 characters a token); with `max_tokens` 2,000 a request needs
  ceil(3,009 / 16) = 189 blocks, 3,024 tokens;
- the 63 keys hold 4,032 of the prompt's 4,060 bytes: 1,009 x 4,032 / 4,060 = 1,002 of its
  estimated tokens, 62 whole blocks, one of which is kept back as margin for where the
  engine's block boundary falls: 61 blocks, 976 tokens, are shared.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from gateway.capacity.perf import StepCost

SYSTEM = {"role": "system", "content": "x" * 4000}
OTHER_SYSTEM = {"role": "system", "content": "y" * 4000}
NEED = 3024  # one request's whole reservation
SHARED = 976  # the system message's blocks, held once
MAX_TOKENS = 2000
# a decode step of 10 ms: a stream of 2,000 tokens outlasts a test
SLOW_STEPS = StepCost(
    weights_bytes_per_rank=1.0,
    kv_bytes_per_token_per_rank=1e-9,
    bandwidth_bytes_per_s=100.0,
    prefill_flops_per_token=1.0,
    flops_per_s=1e9,
)


@asynccontextmanager
async def streaming(
    url: str,
    key: str,
    question: str,
    *,
    system: dict[str, str] = SYSTEM,
    max_tokens: int = MAX_TOKENS,
) -> AsyncIterator[None]:
    """A stream, read in the background from its first event on, until the block ends;
    then the client leaves, which releases its reservation."""
    body = {
        "model": "m",
        "messages": [system, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {key}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        started = asyncio.Event()

        async def read() -> None:  # to its end, unless the block ends first
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    started.set()

        reading = asyncio.create_task(read())
        await started.wait()
        try:
            yield
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
