"""The dashboard in a real headless browser: it renders the fleet's numbers, or asks to log in."""

import asyncio
import html
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.admission.fleet.fill import MAX_FILL
from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import free_port
from loadtest.sim.config import SimConfig
from tests.e2e.browser import dump_dom, needs_chromium, png_facts, screenshot
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet, tenant
from tests.support.harness import ServerThread

pytestmark = needs_chromium
CAPACITY = 2000


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sims = [SimConfig(model="m", kv_tokens=CAPACITY, speed=0.5) for _ in range(2)]
    with run_fleet(
        pools={"big": sims},
        pool_options={"big": {"target_fill": 0.5}},
        capacity={"big": CAPACITY},
    ) as f:
        yield f


def _burst(fleet: Fleet, n: int, max_tokens: int) -> list[httpx.Response]:
    async def scenario() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens}  # fmt: skip
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as c:
            return list(await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(n))
            ))  # fmt: skip

    return asyncio.run(scenario())


def _text(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', dom)
    assert match, f"no element #{element_id} in the DOM"
    return html.unescape(match.group(1))


def test_dashboard_shows_capacity_in_flight_and_outcomes(fleet: Fleet, tmp_path: Path) -> None:
    answers = _burst(fleet, 8, max_tokens=20)  # 8 x ~30 tokens: all fit, all local
    assert {r.status_code for r in answers} == {200}
    holding = asyncio.run(_hold_and_look(fleet, tmp_path))
    dom, status = holding
    backends = status["pools"][0]["backends"]
    held = sum(b["tokens_in_flight"] for b in backends)
    assert held > 0
    assert _text(dom, "inflight-big") == f"{held:,}"
    assert _text(dom, "capacity-big") == f"{2 * CAPACITY:,}"
    assert _text(dom, "total-big-local") == "local 8"
    assert _text(dom, "total-big-rejected") == "rejected 3"
    assert _text(dom, "queue-big") == "0"
    for b in backends:
        row = re.search(rf'data-backend="{b["name"]}".*?</tr>', dom, re.S)
        assert row and f'class="capacity">{CAPACITY:,}<' in row.group(0)
        # the target fill, 50 %, or more once the fill calibrates to what the backend holds
        # under the two long requests' reservations, never past the whole cache
        # (gateway/admission/fleet/fill.py)
        limit = re.search(r'class="limit-tokens">([\d,]+)<', row.group(0))
        most = MAX_FILL * CAPACITY
        assert limit and CAPACITY // 2 <= int(limit.group(1).replace(",", "")) <= most
        fill = re.search(r'class="effective-fill"[^>]*>([\d.]+) %( \(calibrated\))?<', row.group(0))
        assert fill and 50 <= float(fill.group(1)) <= 100 * MAX_FILL
        assert fill.group(2) or float(fill.group(1)) == 50  # above the target: says why
        assert re.search(r'class="kv-used"[^>]*>[\d.]+ %<', row.group(0))
        # one-word prompts fill no whole block: nothing for the prefix index to expect
        assert re.search(r'class="prefix-hits"[^>]*>– / [\d.]+ %<', row.group(0))
    assert '<form id="login" hidden=""' in dom
    width, height, variety = png_facts(tmp_path / "dashboard.png")
    assert (width, height) == (1280, 720)
    assert variety > 50, "the screenshot looks blank"


async def _hold_and_look(fleet: Fleet, tmp_path: Path) -> tuple[str, dict[str, object]]:
    """Keep two long requests in flight (a third finds no room) while the browser looks."""
    headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}
    url = f"{fleet.url}/dashboard?token={ADMIN_TOKEN}"
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as client:
        long = [asyncio.create_task(client.post("/v1/chat/completions", json=body))
                for _ in range(2)]  # fmt: skip
        deadline = time.monotonic() + 5
        # each reserves its prompt and the expected output (the 512-token prior), one a backend
        while sum(b["tokens_in_flight"] for b in fleet.status()["pools"][0]["backends"]) < 1024:
            assert time.monotonic() < deadline, "the long requests never got admitted"
            await asyncio.sleep(0.02)
        refused = [await client.post("/v1/chat/completions", json=body) for _ in range(3)]
        assert [r.status_code for r in refused] == [503] * 3
        status = fleet.status()
        dom = await asyncio.to_thread(dump_dom, url, budget_ms=1500)
        shot = tmp_path / "dashboard.png"
        await asyncio.to_thread(screenshot, url, shot, size=(1280, 720), budget_ms=1500)
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    return dom, status


def test_without_a_good_token_the_page_asks_for_one(fleet: Fleet) -> None:
    blank = dump_dom(f"{fleet.url}/dashboard", budget_ms=1000)
    assert '<form id="login">' in blank
    assert '<main id="pools" hidden=""' in blank
    wrong = dump_dom(f"{fleet.url}/dashboard?token=wrong", budget_ms=1500)
    assert _text(wrong, "login-error") == "Incorrect admin token."
    assert 'id="pool-big"' not in wrong


def test_a_dead_backend_shows_as_down_with_its_reason_not_as_a_full_pool() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = parse_settings(
        {
            "tenants": [tenant("acme", "sk-dashboard-dead")],
            "pools": [{"name": "gone", "backends": [{"url": url, "served_model": "m"}]}],
        }
    )
    app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    with ServerThread(app) as gateway:
        dom = dump_dom(f"{gateway.url}/dashboard?token={ADMIN_TOKEN}", budget_ms=1500)
    assert _text(dom, "fill-gone") == "down"
    assert f"down: connection refused at {url}" in html.unescape(dom)
    assert 'class="dot down"' in dom
