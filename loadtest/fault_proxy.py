"""A TCP proxy on loopback that delays every chunk it relays: a slow network to Redis (or
anything else) on cue, for fault tests and the soak."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from loadtest.procs import free_port

CHUNK = 65536


class DelayProxy:
    """Listens on a free loopback port and relays to `target_port`, each chunk held back
    `delay_s` seconds in each direction (settable at any time; 0 relays at once)."""

    def __init__(self, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port()
        self.target_port = target_port
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> DelayProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        future.result(timeout=10)
        return self

    def stop(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        future.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except (OSError, TimeoutError):
            writer.close()
            return
        for pipe in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                if self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
