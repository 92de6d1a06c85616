"""The upstream connection pool: one aiohttp session per process, made in the event loop.

The forwarding path speaks aiohttp directly. On this project's benchmark httpx's own pool
answered a loopback request four times slower at concurrency 1 and six times slower at 64
(encode/httpx#3215), and httpx's request and cookie layers over the aiohttp transport
still cost a quarter of the gateway's CPU per request.
"""

from __future__ import annotations

import aiohttp

# uvicorn, which vLLM and SGLang serve with, closes a connection idle for 5 s: one taken
# from the pool as the server closes it fails before its first byte, and with one backend
# there is no other to try. The pool lets its idle connections go sooner.
KEEPALIVE_S = 4.0


class UpstreamPool:
    def __init__(self, *, max_connections: int, keepalive_s: float = KEEPALIVE_S) -> None:
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=self._keepalive_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
