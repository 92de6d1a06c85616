"""Debian's headless chromium driven from the command line: screenshots and DOM dumps.

No browser-driver dependency: `--screenshot` writes a PNG and `--dump-dom` prints the DOM
after the page's scripts ran for `--virtual-time-budget` milliseconds of page time.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest

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
