"""GET /dashboard and GET /admin/history over real sockets: who may see what."""

from collections.abc import Iterator

import httpx
import pytest

from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with run_fleet(pools={"p": [SimConfig(model="m", kv_tokens=4000, speed=50.0)]}) as f:
        yield f


def test_the_page_is_served_with_a_login_prompt_and_checks_a_given_token(fleet: Fleet) -> None:
    page = httpx.get(f"{fleet.url}/dashboard", timeout=5)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-store"
    assert '<form id="login"' in page.text and "/admin/history" in page.text
    good = httpx.get(f"{fleet.url}/dashboard", params={"token": ADMIN_TOKEN}, timeout=5)
    assert good.status_code == 200
    bad = httpx.get(f"{fleet.url}/dashboard", params={"token": "nope"}, timeout=5)
    assert bad.status_code == 401
    tenant = httpx.get(f"{fleet.url}/dashboard", params={"token": fleet.keys["acme"]}, timeout=5)
    assert tenant.status_code == 401


def test_history_needs_the_admin_token_and_counts_outcomes_per_pool(fleet: Fleet) -> None:
    url = f"{fleet.url}/admin/history"
    assert httpx.get(url, timeout=5).status_code == 401
    tenant = httpx.get(url, headers={"authorization": f"Bearer {fleet.keys['acme']}"}, timeout=5)
    assert tenant.status_code == 403
    with fleet.client() as client:
        for _ in range(3):
            body = {"model": "p", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    history = httpx.get(url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).json()
    assert history["step_s"] > 0 and history["window_s"] >= history["step_s"]
    total = sum(p["outcomes"].get("p", {}).get("local", 0) for p in history["points"])
    assert total == 3
    assert history["points"][-1]["tokens_in_flight"] == {"p-0": 0}
