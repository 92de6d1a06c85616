"""What a simulated replica does when told to stop (SIGTERM), as vLLM 0.32 does.

vLLM stops in one of two ways, by `--shutdown-timeout` (seconds; the sim takes the same flag).
As measured on vLLM 0.32 (the CPU build) with streams in flight:

- 0, vLLM's default ("abort"): the engine is stopped at once. Each request in flight ends
  within milliseconds with vLLM's dead-engine error: a stream, its 200 already sent, with
  one error event (`InternalServerError`, code 500, "EngineCore encountered an issue. ...")
  then `[DONE]`, no finish reason and no usage; an answer not streamed with that error as
  a 500. The server stops listening (new connections are refused) and closes its idle
  kept-alive connections; nothing answers /health, not even a 503. It exits about 2 s
  later. (vLLM does not always get the error out: as often its streams just stall, no
  byte more and the connection open, until the client leaves or the process is killed.
  The sim always sends it.)
- N > 0 ("drain"): requests in flight go on, to their end if it comes within N s. The
  server keeps listening and /health answers 200, but every new request, on a kept-alive
  connection or a new one, streamed or not, is refused with a 500 JSON error
  (`InternalServerError`, "cannot schedule new futures after shutdown"). About N s after
  the signal, however early the last request ended, the server stops listening and exits.
  (A request still running then stalls in vLLM, as above; the sim ends it with the
  dead-engine error.)

A second SIGTERM, or SIGINT, stops the server as uvicorn does: at once if already stopping.

An engine that dies (a failed KV load under `kv_load_failure_policy` fail,
loadtest/sim/kv_transfer.py) takes vLLM's API server with it: the requests in flight end
with the dead-engine error and the server exits. Under `spillgate sim` the replica does the
same; an app served some other way (a test's server thread) cannot exit, so it answers
every POST with the dead-engine 500 and /health with 503, as vLLM does between the engine's
death and its server's exit.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from loadtest.sim.asgi import send_json
from loadtest.sim.engine import Engine
from loadtest.sim.wire import DONE, error_body

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
REFUSED = "cannot schedule new futures after shutdown"


def _internal_error(message: str) -> bytes:
    return error_body(message=message, error_type="InternalServerError", param=None, code=500)


ENGINE_DEAD_BODY = _internal_error(ENGINE_DEAD)
ENGINE_DEAD_EVENT = b"data: " + ENGINE_DEAD_BODY + b"\n\n" + DONE
REFUSED_BODY = _internal_error(REFUSED)


class Shutdown:
    """The replica's side of a SIGTERM: refuse new requests, then stop the engine, at once
    or after `timeout_s` (vLLM's `--shutdown-timeout`)."""

    def __init__(self, *, engine: Engine, timeout_s: float = 0.0) -> None:
        if timeout_s < 0:
            raise ValueError("shutdown timeout must be at least 0")
        self._engine = engine
        self._timeout_s = timeout_s
        self.refusing = False
        self.dead = False
        self.died = asyncio.Event()  # set once, from the event loop that serves the app

    async def run(self) -> None:
        """From the signal until the server may stop listening."""
        self.refusing = True
        if self._timeout_s > 0:
            await asyncio.sleep(self._timeout_s)
        self._engine.close()  # what is still running ends with the dead-engine error

    def engine_died(self) -> None:
        """The engine hit a fatal error: everything in flight fails, and the server goes."""
        self.dead = True
        self._engine.close()
        self.died.set()


class RefuseWhileStopping:
    """Pure ASGI: while the replica stops, every POST gets vLLM's refusal; the rest
    (/health, /metrics, /v1/models) is served as before."""

    def __init__(self, app: ASGIApp, *, shutdown: Shutdown) -> None:
        self._app = app
        self._shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            shutdown = self._shutdown
            if shutdown.dead and scope["method"] == "POST":
                await send_json(send, 500, ENGINE_DEAD_BODY)
                return
            if shutdown.dead and scope["path"] == "/health":
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            if shutdown.refusing and scope["method"] == "POST":
                await send_json(send, 500, REFUSED_BODY)
                return
        await self._app(scope, receive, send)


class SimServer(uvicorn.Server):
    """uvicorn, with its first SIGTERM handled by `shutdown` before uvicorn's own stop."""

    def __init__(self, config: uvicorn.Config, *, shutdown: Shutdown) -> None:
        super().__init__(config)
        self._shutdown = shutdown
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = self._loop.create_task(self._exit_when_engine_dies())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def _exit_when_engine_dies(self) -> None:
        await self._shutdown.died.wait()
        self._stop_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._signalled or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # a signal handler runs between two steps of the loop: start the stop from the loop
        self._signalled = True
        self._loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        self._stopping = asyncio.get_running_loop().create_task(self._stop())

    async def _stop(self) -> None:
        await self._shutdown.run()
        self._stop_listening()

    def _stop_listening(self) -> None:
        # as vLLM, stop listening and drop idle connections now; uvicorn's own stop, next,
        # would leave them for up to a tick of its main loop (a response under way ends
        # first: uvicorn closes its connection after it)
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        self.should_exit = True
