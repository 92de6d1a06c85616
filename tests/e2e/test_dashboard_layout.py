"""The dashboard fits a laptop's screen: at 1,280 px wide and up, in a real browser, the page
scrolls no wider than the window, every column of each backend table shows inside its card,
and a backend's name stays on one line. Measured from the page's own DOM, with a
screenshot taken at each width."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import free_port
from loadtest.sim.config import SimConfig
from tests.e2e.browser import needs_chromium, open_tab, png_facts
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet

pytestmark = needs_chromium
WIDTHS = (1280, 1920)
COLUMNS = 9  # backend, reserved, limit, capacity, sessions, KV use, fill, prefix hits, bar
MEASURE = """(() => {
  const box = (node) => {
    const r = node.getBoundingClientRect();
    return { left: r.left, right: r.right, width: r.width, height: r.height };
  };
  return {
    window: window.innerWidth,
    page: document.documentElement.scrollWidth,
    cards: [...document.querySelectorAll("section.pool")].map((card) => ({
      id: card.id,
      card: box(card),
      table: box(card.querySelector("table")),
      heads: [...card.querySelectorAll("th")].map((th) => ({ text: th.textContent, ...box(th) })),
      rows: [...card.querySelectorAll("tr[data-backend]")].map((tr) => ({
        backend: tr.dataset.backend,
        cells: [...tr.children].map(box),
        name: box(tr.querySelector(".name")),
        font: parseFloat(getComputedStyle(tr.querySelector(".name")).fontSize),
      })),
    })),
  };
})()"""


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Pools as a real fleet names them, and a backend that is down with a long reason."""
    big = [SimConfig(model="meta-llama/Llama-3.1-70B-Instruct", kv_tokens=65536) for _ in range(2)]
    small = [SimConfig(model="meta-llama/Llama-3.1-8B-Instruct", kv_tokens=32768)]
    gone = {"url": f"http://127.0.0.1:{free_port()}", "served_model": "m"}
    with run_fleet(
        pools={"llama-3.1-70b-instruct": big, "llama-3.1-8b-instruct": small, "gone": []},
        pool_options={"gone": {"backends": [gone]}},
    ) as f:
        yield f


async def _measure(url: str, width: int) -> tuple[dict[str, Any], bytes]:
    """The page's measurements at `width`, and its screenshot."""
    async with open_tab(url, size=(width, 900)) as tab:
        await tab.wait_for("document.querySelectorAll('tr[data-backend]').length === 4")
        measured: dict[str, Any] = await tab.evaluate(MEASURE)
        return measured, await tab.screenshot()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_backend_tables_fit_the_window(fleet: Fleet, width: int, tmp_path: Path) -> None:
    page, png = asyncio.run(_measure(f"{fleet.url}/dashboard?token={ADMIN_TOKEN}", width))
    shot = tmp_path / f"dashboard-{width}.png"
    shot.write_bytes(png)
    assert page["window"] == width
    assert page["page"] <= width, "the page scrolls sideways"
    assert [c["id"] for c in page["cards"]] == [
        "pool-llama-3.1-70b-instruct",
        "pool-llama-3.1-8b-instruct",
        "pool-gone",
    ]
    for card in page["cards"]:
        edge = card["card"]["right"]
        assert card["table"]["right"] <= edge, f"{card['id']}: the table runs over its card"
        assert len(card["heads"]) == COLUMNS
        for head in card["heads"]:
            assert head["width"] > 0 and head["right"] <= edge, f"{card['id']}: {head['text']}"
        for row in card["rows"]:
            assert len(row["cells"]) == COLUMNS
            for cell in row["cells"]:
                assert cell["width"] > 0 and cell["right"] <= edge, row["backend"]
            assert row["name"]["height"] < 2 * row["font"], f"{row['backend']} wraps"
    width_px, height_px, variety = png_facts(shot)
    assert (width_px, height_px) == (width, 900)
    assert variety > 50, "the screenshot looks blank"
