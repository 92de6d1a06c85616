"""The batch tier runs only on spare room, survives a restart of the gateway, and takes an
overflowing request that may wait as a one-item batch answered 202."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from loadtest.procs import RedisProcess
from tests.support.batch import (
    POOL,
    batch_fleet,
    chat_line,
    client,
    lines_of,
    second_gateway,
    spike,
    submit,
    tokens_held,
    wait_status,
)
from tests.support.fleet import ADMIN_TOKEN
from tests.support.overflow import backend_requests, sample


def test_batch_yields_to_a_spike_and_runs_once_it_passes(tmp_path: Path) -> None:
    # capacity 1000: the spike holds about 710 tokens, over max_fill 0.5 of the pool
    with batch_fleet(tmp_path, max_fill=0.5, speed=0.5) as fleet:
        api = client(fleet)
        with spike(fleet, max_tokens=700):
            held = tokens_held(fleet)["chat-0"]
            assert held > 500
            batch_id = submit(api, [chat_line("a"), chat_line("b")])
            time.sleep(1.0)  # twenty passes of the runner
            batch = api.batches.retrieve(batch_id)
            assert batch.status == "in_progress"
            assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 0)
            assert tokens_held(fleet)["chat-0"] == held  # no item took room
            waiting = sample(fleet, "spillgate_batch_queued_tokens", pool=POOL)
            assert waiting is not None and waiting > 0
        batch = wait_status(api, batch_id, within_s=30)
        assert batch.status == "completed"
        assert batch.request_counts.completed == 2
        assert sorted(line["custom_id"] for line in lines_of(api, batch.output_file_id)) == [
            "a",
            "b",
        ]
        assert tokens_held(fleet) == {"chat-0": 0}
        prompts = sum(
            line["response"]["body"]["usage"]["prompt_tokens"]
            for line in lines_of(api, batch.output_file_id)
        )
        assert sample(fleet, "spillgate_batch_tokens_total", kind="completion") == 10.0
        assert sample(fleet, "spillgate_batch_tokens_total", kind="prompt") == float(prompts)
        assert sample(fleet, "spillgate_batch_completion_seconds_count") == 1.0
        assert sample(fleet, "spillgate_requests_total", outcome="rejected") is None
        assert sample(fleet, "spillgate_requests_total", tenant="acme", outcome="local") == 2.0
        assert sample(fleet, "spillgate_ttft_seconds_count", pool=POOL, outcome="local") is None
        time.sleep(0.2)  # a pass of the runner after the batch ended
        assert sample(fleet, "spillgate_batch_queued_tokens", pool=POOL) == 0.0
        history = httpx.get(
            f"{fleet.url}/admin/history", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        assert history["points"][-1]["batch_queued_tokens"] == {POOL: 0.0}


def _restart_finishes(tmp_path: Path, redis_url: str | None) -> None:
    with batch_fleet(tmp_path, max_fill=0.001, redis_url=redis_url) as fleet:
        api = client(fleet)
        batch_id = submit(api, [chat_line("a"), chat_line("b"), chat_line("c")])
        time.sleep(0.3)
        assert api.batches.retrieve(batch_id).status == "in_progress"
        fleet.gateway.stop()  # the first gateway goes away with its batch unrun
        with second_gateway(fleet, redis_url=redis_url, max_fill=0.6) as url:
            again = openai.OpenAI(base_url=f"{url}/v1", api_key=fleet.keys["acme"], max_retries=0)
            batch = wait_status(again, batch_id)
            assert batch.status == "completed"
            assert batch.request_counts.completed == 3
            out = lines_of(again, batch.output_file_id)
            assert sorted(line["custom_id"] for line in out) == ["a", "b", "c"]
            assert {line["response"]["status_code"] for line in out} == {200}


def test_a_new_gateway_on_the_same_directory_finishes_the_batch(tmp_path: Path) -> None:
    _restart_finishes(tmp_path, None)


def test_a_new_gateway_on_the_same_redis_finishes_the_batch(
    tmp_path: Path, redis_proc: RedisProcess
) -> None:
    _restart_finishes(tmp_path, redis_proc.url)


@pytest.mark.parametrize("shared", [False, True], ids=["directory", "redis"])
def test_two_gateways_on_one_store_run_each_item_once(
    tmp_path: Path, shared: bool, redis_proc: RedisProcess
) -> None:
    url = redis_proc.url if shared else None
    with (
        batch_fleet(tmp_path, redis_url=url, concurrency=2) as fleet,
        second_gateway(fleet, redis_url=url) as other,
    ):
        api = client(fleet)
        before = backend_requests(fleet.backends[POOL][0])
        batch = wait_status(api, submit(api, [chat_line(f"r{i}") for i in range(8)]))
        assert batch.request_counts.completed == 8
        out = lines_of(api, batch.output_file_id)
        assert sorted(line["custom_id"] for line in out) == [f"r{i}" for i in range(8)]
        assert backend_requests(fleet.backends[POOL][0]) - before == 8
        seen = openai.OpenAI(base_url=f"{other}/v1", api_key=fleet.keys["acme"])
        assert seen.batches.retrieve(batch.id).status == "completed"


def test_an_overflowing_request_that_may_wait_is_accepted_as_a_batch(tmp_path: Path) -> None:
    options = {"overflow": ["batch", "reject"]}
    tenants = {"acme": {}, "patient": {"batchable": True}}
    with batch_fleet(tmp_path, speed=0.5, pool_options=options, tenants=tenants) as fleet:
        api = client(fleet)
        ask = {"model": POOL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        with spike(fleet, max_tokens=800):  # the pool (limit 900 tokens) has no room left
            with pytest.raises(openai.InternalServerError) as refused:
                api.chat.completions.create(**ask)  # type: ignore[call-overload]
            assert refused.value.status_code == 503
            raw = api.chat.completions.with_raw_response.create(
                **ask, extra_headers={"x-spillgate-batchable": "true"}
            )  # type: ignore[call-overload]
            assert raw.status_code == 202
            assert raw.headers["x-spillgate-outcome"] == "queued"
            accepted = raw.http_response.json()
            assert (accepted["object"], accepted["status"]) == ("batch", "validating")
            assert accepted["endpoint"] == "/v1/chat/completions"
            patient = httpx.post(
                f"{fleet.url}/v1/chat/completions",
                json=ask,
                headers={"authorization": f"Bearer {fleet.keys['patient']}"},
                timeout=10,
            )
            assert patient.status_code == 202
        batch = wait_status(api, accepted["id"], within_s=30)
        assert batch.status == "completed"
        (line,) = lines_of(api, batch.output_file_id)
        assert line["custom_id"] == "request-1"
        assert line["response"]["body"]["usage"]["completion_tokens"] == 200
        assert tokens_held(fleet) == {"chat-0": 0}
