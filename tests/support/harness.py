"""Run ASGI apps on loopback in threads of this process: for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from loadtest.procs import free_port


class ServerThread:
    """One uvicorn server in a thread with its own event loop."""

    def __init__(self, app: Any, *, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", lifespan="on", loop="asyncio"
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} failed to start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def servers(*apps: Any) -> Iterator[list[ServerThread]]:
    started: list[ServerThread] = []
    try:
        for app in apps:
            started.append(ServerThread(app).start())
        yield started
    finally:
        for s in reversed(started):
            s.stop()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
