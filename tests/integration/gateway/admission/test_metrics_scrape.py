"""One scrape of each backend's /metrics feeds every reader (admission/fleet/backend_load.py's
MetricsScrape): a page fetched within a reader's freshness is not fetched again, a failed
page is never handed to another reader."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.admission.fleet.backend_load import MetricsScrape
from gateway.clock import ManualClock
from tests.support.harness import ServerThread


class Backend:
    def __init__(self) -> None:
        self.hits = 0
        self.status = 200

    async def metrics(self, request: Request) -> Response:
        self.hits += 1
        return PlainTextResponse(f"vllm:num_requests_waiting {self.hits}\n", self.status)


def test_a_fresh_page_is_read_once_and_a_failed_one_is_not_kept() -> None:
    backend = Backend()
    server = ServerThread(Starlette(routes=[Route("/metrics", backend.metrics)])).start()
    clock = ManualClock()

    async def main() -> list[tuple[int, str]]:
        async with httpx.AsyncClient() as client:
            scrape = MetricsScrape(client, clock=clock)

            async def read(fresh_s: float) -> tuple[int, str]:
                page = await scrape.get(server.url, timeout_s=5, fresh_s=fresh_s)
                return page.status_code, page.text.strip()

            pages = [await read(0.5), await read(0.5)]  # the second reader takes the first's
            clock.advance(0.5)
            pages.append(await read(0.5))  # no longer fresh
            pages.append(await read(0.0))  # a reader that wants a page of its own
            backend.status = 503
            pages.append(await read(0.0))
            pages.append(await read(0.0))  # the failure was not kept: fetched again
            return pages

    try:
        pages = asyncio.run(main())
    finally:
        server.stop()
    waiting = "vllm:num_requests_waiting"
    assert pages == [
        (200, f"{waiting} 1"),
        (200, f"{waiting} 1"),
        (200, f"{waiting} 2"),
        (200, f"{waiting} 3"),
        (503, f"{waiting} 4"),
        (503, f"{waiting} 5"),
    ]
    assert backend.hits == 5
