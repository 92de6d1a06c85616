"""Python bytecode run per request, counted in-process: a figure a noisy machine cannot move.

`spillgate bench ops` builds the raw relay and the gateway (with the config of
`spillgate bench`) as ASGI apps in this process, starts the bench's zero-delay backend in
another, sends each app the bench's request through its ASGI interface one at a time,
and counts the bytecode instructions run per request (sys.settrace opcode events), by
where their code lives. The HTTP server in front is left out: it is the same for both.
Timings on this machine drift by 2x over minutes; these counts move by a few tens of
opcodes in seven thousand.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import orjson
import uvloop
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from starlette.types import ASGIApp, Message

from loadtest.bench.overhead import BODY, KEY, _spillgate_config, _uvicorn
from loadtest.procs import free_port, serving_process

ARMS = ("raw relay", "spillgate")
LEAN = "lean relay"  # the raw relay on the gateway's own upstream client
TRACED = "spillgate, traced"  # tracing on, every span sampled and handed to an exporter
ALL_ARMS = (*ARMS, LEAN, TRACED)
DRIVER = "driver"  # this script's own ASGI calls: counted apart, left out of the total
# installed packages first: a virtualenv's site-packages may sit under the stdlib's prefix
LIBRARIES = [Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"])]


@functools.cache  # asked once per opcode run: each file is worked out once
def _where(filename: str) -> str:
    """The package a code object belongs to: gateway, policies, aiohttp, asyncio, ..."""
    if filename == __file__:
        return DRIVER
    if filename == "<string>":
        return "generated"  # dataclasses' __init__ and the like
    path = Path(filename)
    for root in LIBRARIES:
        if path.is_relative_to(root):
            return path.relative_to(root).parts[0].removesuffix(".py")
    for package in ("gateway", "policies", "loadtest"):
        if package in path.parts:
            return package
    return "other"


class OpcodeCounter:
    """Counts opcodes run in this thread between start() and stop(), by package and function."""

    def __init__(self) -> None:
        self.by_package: collections.Counter[str] = collections.Counter()
        self.by_function: collections.Counter[str] = collections.Counter()

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            where = _where(code.co_filename)
            self.by_package[where] += 1
            if where != DRIVER:
                self.by_function[f"{where}:{code.co_qualname}"] += 1
        return self._trace

    def start(self) -> None:
        sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)


def _scope() -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {KEY}".encode()),
            (b"content-length", str(len(BODY)).encode()),
        ],
    }  # fmt: skip


async def _request(app: ASGIApp) -> int:
    """One bench request through `app`'s ASGI interface; returns the status answered."""
    sent = False
    answered = asyncio.Event()
    status = 0

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(), receive, send)
    answered.set()
    return status


async def _lifespan(app: ASGIApp, started: asyncio.Future[None], stop: asyncio.Event) -> None:
    """Runs `app`'s lifespan: startup, then shutdown once `stop` is set."""
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "lifespan.startup"}
        await stop.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: Message) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set_result(None)
        elif message["type"] == "lifespan.startup.failed":
            started.set_exception(RuntimeError(f"startup failed: {message.get('message')}"))

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)


class _Dropped(SpanExporter):
    """A span exporter that drops what it is given: the arm counts the spans' making and
    hand-off in the request's thread, not an export (OTLP's runs on a thread of its own)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _app(arm: str, backend: str, tmp: Path) -> ASGIApp:
    if arm == "raw relay":
        from loadtest.bench.apps import RawRelay

        return RawRelay(backend)
    if arm == LEAN:
        from loadtest.bench.apps import LeanRelay

        return LeanRelay(backend)
    from gateway.app import create_app
    from gateway.config import TracingSettings, load_settings

    config = tmp / "spillgate.yaml"
    _spillgate_config(backend, config)
    loaded = load_settings(config)
    # no background reads of the backend (its load every 0.5 s, its health every 5 s) while
    # requests are counted: they would land in some runs' window and not in others'
    quiet = {"feedback": False, "capacity_refresh_s": 3600.0}
    pools = [pool.model_copy(update=quiet) for pool in loaded.pools]
    settings = loaded.model_copy(update={"pools": pools})
    if arm != TRACED:
        return create_app(settings, environ={})
    traced = settings.model_copy(update={"tracing": TracingSettings(enabled=True)})
    return create_app(traced, environ={}, span_exporter=_Dropped())


async def drive(
    app: ASGIApp, requests: int, *, warmup: int = 0, counter: OpcodeCounter | None = None
) -> None:
    """`warmup`, then `requests` bench requests through `app`, one at a time, inside its
    lifespan; `counter`, when given, counts the second lot only. Raises unless every one
    of them was answered 200."""
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    lifespan = asyncio.create_task(_lifespan(app, started, stop))
    try:
        await asyncio.wait_for(asyncio.shield(started), timeout=30)
        for _ in range(warmup):  # connections opened, caches filled, estimators settled
            await _request(app)
        if counter is not None:
            counter.start()
        try:
            statuses = [await _request(app) for _ in range(requests)]
        finally:
            if counter is not None:
                counter.stop()
    finally:
        stop.set()  # the app's shutdown closes its upstream connections on every path
        if not started.done():
            lifespan.cancel()  # still in its startup: there is nothing to shut down
        await asyncio.gather(lifespan, return_exceptions=True)
    if set(statuses) != {200}:
        raise RuntimeError(f"the arm answered {sorted(set(statuses))}, not only 200")


async def _count(app: ASGIApp, requests: int, warmup: int) -> OpcodeCounter:
    counter = OpcodeCounter()
    await drive(app, requests, warmup=warmup, counter=counter)
    return counter


def count(arms: tuple[str, ...] = ARMS, *, requests: int = 200, warmup: int = 50) -> dict[str, Any]:
    """Opcodes per request for each arm: total, by package, and the costliest functions."""
    result: dict[str, Any] = {}
    port = free_port()
    backend_cmd = _uvicorn("loadtest.bench.apps:backend", port)
    with serving_process(backend_cmd, port) as backend, tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            app = _app(arm, backend, Path(tmp))
            counter = uvloop.run(_count(app, requests, warmup))
            own = sum(n for where, n in counter.by_package.items() if where != DRIVER)
            result[arm] = {
                "opcodes_per_request": own / requests,
                "by_package": {k: v / requests for k, v in counter.by_package.most_common()},
                "top_functions": {k: v / requests for k, v in counter.by_function.most_common(25)},
            }
    return result


def _report(result: dict[str, Any]) -> str:
    arms = list(result)
    packages: list[str] = []
    for arm in arms:
        packages += [p for p in result[arm]["by_package"] if p not in packages]
    lines = ["opcodes per request".ljust(24) + "".join(a.rjust(14) for a in arms)]
    lines.append("total".ljust(24) + "".join(
        f"{result[a]['opcodes_per_request']:14,.0f}" for a in arms))  # fmt: skip
    for package in packages[:12]:
        cells = "".join(f"{result[a]['by_package'].get(package, 0):14,.0f}" for a in arms)
        lines.append(f"  {package}".ljust(24) + cells)
    for arm in arms:
        lines += ["", f"{arm}: costliest functions (opcodes per request)"]
        lines += [f"  {n:8.0f}  {f}" for f, n in result[arm]["top_functions"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillgate bench ops", description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests counted per arm")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--arm",
        action="append",
        choices=ALL_ARMS,
        help=f"an arm to count (repeatable; default: {', '.join(ARMS)})",
    )
    args = parser.parse_args(argv)
    result = count(tuple(args.arm or ARMS), requests=args.requests)
    print(_report(result))
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json.resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
