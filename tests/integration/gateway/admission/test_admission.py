"""Admission by tokens in flight: a full pool refuses politely and is never over-filled."""

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.config import SimConfig
from tests.support.fleet import Fleet, run_fleet

CAPACITY = 2000
TARGET_FILL = 0.5


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # real-time decode: 300 tokens take ~2.5 s, so the pool is still full when the extra
    # request arrives 0.5 s in, however loaded the machine is
    sims = [SimConfig(model="m", kv_tokens=CAPACITY, speed=1.0) for _ in range(2)]
    with run_fleet(
        pools={"big": sims},
        pool_options={"big": {"target_fill": TARGET_FILL}},
        capacity={"big": CAPACITY},
    ) as f:
        yield f


def test_full_pool_answers_503_with_retry_after_and_never_overfills(fleet: Fleet) -> None:
    peak: dict[str, int] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for backend in fleet.status()["pools"][0]["backends"]:
                name = backend["name"]
                peak[name] = max(peak.get(name, 0), backend["tokens_in_flight"])
            time.sleep(0.01)

    live: dict[str, float] = {}
    watcher = threading.Thread(target=watch)
    watcher.start()

    async def scenario() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {fleet.keys['acme']}"}
        body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
        async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=30) as client:
            long = [
                asyncio.create_task(client.post("/v1/chat/completions", json=body))
                for _ in range(12)
            ]
            await asyncio.sleep(0.5)
            extra = await client.post("/v1/chat/completions", json=body)
            live.update(pool_gauges(await client.get("/metrics")))
            return [extra, *await asyncio.gather(*long)]

    try:
        extra, *rest = asyncio.run(scenario())
    finally:
        stop.set()
        watcher.join()
    assert extra.status_code == 503
    assert extra.headers["x-spillgate-outcome"] == "rejected"
    assert int(extra.headers["retry-after"]) >= 1
    assert extra.json()["error"]["code"] == "capacity_exhausted"
    served = [r for r in rest if r.status_code == 200]
    refused = [r for r in rest if r.status_code == 503]
    assert len(served) == 6  # 3 requests of ~310 tokens under 1000 per backend, 2 backends
    assert len(served) + len(refused) == 12
    assert all("retry-after" in r.headers for r in refused)
    limit = int(CAPACITY * TARGET_FILL)
    assert peak and all(0 < tokens <= limit for tokens in peak.values()), peak
    # what an autoscaler reads while the spike is on: the pool is at its target fill, and
    # 13 requests of ~310 tokens want 4+ backends' worth of 1000 tokens each
    assert live["spillgate_pool_fill_ratio"] == pytest.approx(0.465, abs=0.04)
    assert live["spillgate_pool_desired_backends"] >= 4
    assert live["spillgate_pool_demand_tokens_per_second"] >= 0


def pool_gauges(response: httpx.Response) -> dict[str, float]:
    wanted = {
        "spillgate_pool_fill_ratio",
        "spillgate_pool_desired_backends",
        "spillgate_pool_demand_tokens_per_second",
    }
    return {
        sample.name: sample.value
        for sample in samples(response.text, wanted)
        if sample.labels.get("pool") == "big"
    }
