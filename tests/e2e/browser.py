"""Debian's headless chromium: screenshots and DOM dumps from the command line, and a tab
driven over the DevTools protocol where a test measures the page's layout.

No browser-driver dependency: `--screenshot` writes a PNG and `--dump-dom` prints the DOM
after the page's scripts ran for `--virtual-time-budget` milliseconds of page time; `Tab`
speaks the protocol's JSON over the websocket client uvicorn already brings.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect

BROWSER_TIMEOUT_S = 60
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
)  # fmt: skip


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium is not installed (apt-get install -y chromium)"
)


def _run(url: str, *args: str, budget_ms: int) -> str:
    binary = chromium()
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="spillgate-chromium-") as profile:
        done = subprocess.run(
            [binary, *FLAGS, f"--user-data-dir={profile}",
             f"--virtual-time-budget={budget_ms}", *args, url],
            capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dump_dom(url: str, *, budget_ms: int = 3000) -> str:
    return _run(url, "--dump-dom", budget_ms=budget_ms)


def screenshot(url: str, path: Path, *, size: tuple[int, int], budget_ms: int = 3000) -> None:
    _run(url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}", budget_ms=budget_ms)


def png_facts(path: Path) -> tuple[int, int, int]:
    """Width, height and how many distinct byte values the pixel data holds.

    A blank page compresses to a handful of byte values; a page with text and charts
    has many, so the last figure tells "something rendered" from "white rectangle".
    """
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


class Tab:
    """One page of a headless chromium, driven over the DevTools protocol."""

    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; the events in between are not kept."""
        ident = next(self._ids)
        # a text frame: the DevTools server drops the connection on a binary one
        command = {"id": ident, "method": method, "params": params}
        await self._socket.send(orjson.dumps(command).decode())
        while True:
            message = orjson.loads(await self._socket.recv())
            if message.get("id") == ident:
                assert "error" not in message, message["error"]
                result: dict[str, Any] = message["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page, as JSON brings it back."""
        done = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        assert "exceptionDetails" not in done, done["exceptionDetails"]
        return done["result"].get("value")

    async def wait_for(self, expression: str, *, within_s: float = 15.0) -> None:
        deadline = time.monotonic() + within_s
        while not await self.evaluate(expression):
            assert time.monotonic() < deadline, f"never true in the page: {expression}"
            await asyncio.sleep(0.1)

    async def resize(self, width: int, height: int) -> None:
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip

    async def screenshot(self) -> bytes:
        """The page as it shows now, a PNG."""
        shot = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(shot["data"])


@contextlib.asynccontextmanager
async def open_tab(url: str, *, size: tuple[int, int]) -> AsyncIterator[Tab]:
    """A chromium of its own with one tab at `url`, the window `size` wide and high."""
    binary = chromium()
    assert binary is not None
    # its helpers may still be writing to the profile as the browser goes
    with tempfile.TemporaryDirectory(
        prefix="spillgate-chromium-", ignore_cleanup_errors=True
    ) as profile:
        browser = await asyncio.create_subprocess_exec(
            binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
            f"--window-size={size[0]},{size[1]}", "about:blank",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            port = await _devtools_port(Path(profile) / "DevToolsActivePort")
            async with httpx.AsyncClient() as client:
                targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
            page = next(t for t in targets if t["type"] == "page")
            async with connect(page["webSocketDebuggerUrl"], max_size=None) as socket:
                tab = Tab(socket)
                await tab.resize(*size)
                await tab.call("Page.navigate", url=url)
                yield tab
        finally:
            browser.terminate()
            await asyncio.wait_for(browser.wait(), BROWSER_TIMEOUT_S)


async def _devtools_port(announced: Path) -> int:
    """The port chromium writes to its profile once its DevTools server listens."""
    deadline = time.monotonic() + BROWSER_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int((await asyncio.to_thread(announced.read_text)).splitlines()[0])
        await asyncio.sleep(0.05)
    raise AssertionError("chromium announced no DevTools port")
