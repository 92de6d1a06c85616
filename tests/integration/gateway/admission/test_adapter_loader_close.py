"""A load still running when the gateway stops is cancelled before its client closes: a
spread's load has no waiter to end it."""

from __future__ import annotations

import asyncio

import httpx

from gateway.admission.adapters import AdapterLoader
from gateway.admission.fleet.backends import build_pools
from gateway.clock import SystemClock
from gateway.config import parse_settings


def test_closing_the_loader_cancels_a_load_a_silent_backend_holds() -> None:
    async def scenario() -> None:
        accepted = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await reader.read()  # never answers; returns once the gateway hangs up
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        settings = parse_settings(
            {
                "tenants": [{"name": "t", "key_env": "K"}],
                "pools": [
                    {
                        "name": "m",
                        "adapters": [{"name": "a1", "path": "/a1"}],
                        "backends": [{"url": f"http://127.0.0.1:{port}", "capacity": 1000}],
                    }
                ],
            }
        )
        pools = build_pools(settings.pools, clock=SystemClock())
        pool = pools["m"]
        async with server, httpx.AsyncClient(timeout=30) as client:
            loader = AdapterLoader(
                client=client, clock=SystemClock(), candidates=lambda name: pool.backends
            )
            waiter = asyncio.create_task(
                loader.load(pool, pool.adapter("a1"), deadline=loader_deadline())
            )
            await asyncio.wait_for(accepted.wait(), 5)
            waiter.cancel()  # the request left; the shielded load goes on
            await asyncio.gather(waiter, return_exceptions=True)
            assert loader.loading() == [("m", "a1")]
            await asyncio.wait_for(loader.aclose(), 5)
            assert loader.loading() == []

    def loader_deadline() -> float:
        return SystemClock().monotonic() + 60

    asyncio.run(scenario())
