"""Traces: the gateway, simulated backends and a simulated provider on loopback, the openai
client in front, and an in-memory span exporter handed to create_app (no global provider).

Each backend is wrapped in a recorder that keeps the headers of every POST it receives,
so the `traceparent` the gateway sends on can be matched with its client span.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.metrics import metric_sum
from tests.support.traced import Traced, one, reserved_tokens, traced_fleet, traceparent


@pytest.fixture(scope="module")
def fleet() -> Iterator[Traced]:
    with traced_fleet(enabled=True) as f:
        yield f


@pytest.fixture
def traced(fleet: Traced) -> Traced:
    fleet.exporter.clear()
    for recorder in fleet.recorders.values():
        recorder.posts.clear()
    return fleet


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_is_one_server_span_with_genai_attributes_and_the_backend_joins_it(
    traced: Traced, stream: bool
) -> None:
    pool = "stream" if stream else "chat"
    body = {
        "model": pool,
        "messages": [{"role": "user", "content": "Hello there!"}],
        "max_tokens": 12,
        "temperature": 0.5,
    }
    client = traced.client()
    if stream:
        chunks = list(
            client.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            )
        )
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(**body).usage
    assert usage is not None and usage.completion_tokens == 12

    server = one(traced.spans(SpanKind.SERVER))
    assert server.name == f"chat {pool}"
    assert server.parent is None
    assert server.resource.attributes["service.name"] == "gateway-under-test"
    assert dict(server.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": pool,
        "gen_ai.request.max_tokens": 12,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.response.model": f"{pool}-served",
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": 12,
        "gen_ai.response.finish_reasons": ("length",),
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "http.response.status_code": 200,
        "spillgate.outcome": "local",
        "spillgate.pool": pool,
        "spillgate.backend": f"{pool}-0",
        "spillgate.tenant": "acme",
        "spillgate.priority": "standard",
        "spillgate.charge_tokens": reserved_tokens(body),
        "spillgate.stream": stream,
    }
    assert server.status.status_code is StatusCode.UNSET

    attempt = one(traced.spans(SpanKind.CLIENT))
    assert attempt.parent is not None and attempt.parent.span_id == server.context.span_id
    assert attempt.context.trace_id == server.context.trace_id
    assert attempt.name == f"chat {pool}-served"
    assert dict(attempt.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": f"{pool}-served",
        "gen_ai.response.model": f"{pool}-served",
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": 12,
        "gen_ai.response.finish_reasons": ("length",),
        "server.address": "127.0.0.1",
        "server.port": traced.ports[pool],
        "http.response.status_code": 200,
        "spillgate.backend": f"{pool}-0",
        "spillgate.external": False,
    }
    (post,) = traced.recorders[pool].posts
    assert post["traceparent"] == traceparent(attempt)


def test_a_clients_traceparent_becomes_the_server_spans_parent(traced: Traced) -> None:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    client = traced.client(
        default_headers={"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "vendor=x1"}
    )
    client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    server = one(traced.spans(SpanKind.SERVER))
    assert server.parent is not None and server.parent.is_remote
    assert (f"{server.parent.trace_id:032x}", f"{server.parent.span_id:016x}") == (
        trace_id,
        span_id,
    )
    assert f"{server.context.trace_id:032x}" == trace_id
    (post,) = traced.recorders["chat"].posts
    assert post["traceparent"].split("-")[1] == trace_id  # the backend joins the client's trace
    assert post["tracestate"] == "vendor=x1"


def test_a_retry_on_a_failing_backend_is_a_second_attempt_span(traced: Traced) -> None:
    completion = traced.client().chat.completions.create(
        model="flaky", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.usage is not None
    server = one(traced.spans(SpanKind.SERVER))
    first, second = traced.spans(SpanKind.CLIENT)
    assert [s.parent.span_id for s in (first, second) if s.parent] == [server.context.span_id] * 2
    assert (first.attributes or {})["spillgate.backend"] == "bad"
    assert (first.attributes or {})["http.response.status_code"] == 503
    assert (first.attributes or {})["error.type"] == "503"
    assert "http.request.resend_count" not in (first.attributes or {})
    assert first.status.status_code is StatusCode.ERROR
    assert (second.attributes or {})["spillgate.backend"] == "good"
    assert (second.attributes or {})["http.request.resend_count"] == 1
    assert (second.attributes or {})["http.response.status_code"] == 200
    assert (second.attributes or {})["gen_ai.usage.output_tokens"] == 4
    assert second.status.status_code is StatusCode.UNSET
    assert (server.attributes or {})["spillgate.backend"] == "good"
    assert (server.attributes or {})["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    # each attempt carried its own span as the parent of whatever the backend records
    (bad,) = traced.recorders["failing"].posts
    (good,) = traced.recorders["flaky"].posts
    assert (bad["traceparent"], good["traceparent"]) == (traceparent(first), traceparent(second))


def test_a_5xx_answer_is_an_error_span_with_its_type(traced: Traced) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        traced.client().chat.completions.create(
            model="dead", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    status = caught.value.status_code
    assert status >= 500
    server = one(traced.spans(SpanKind.SERVER))
    attributes = server.attributes or {}
    assert attributes["http.response.status_code"] == status
    assert attributes["spillgate.outcome"] == "error"
    assert attributes["error.type"] == type_of_error(status)
    assert server.status.status_code is StatusCode.ERROR


def type_of_error(status: int) -> str:
    return {502: "UpstreamError", 503: "BackendUnavailable", 504: "UpstreamTimeout"}[status]


def test_each_policy_the_chain_tries_is_a_spill_span_with_the_providers_attempt_under_it(
    traced: Traced,
) -> None:
    completion = traced.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert completion.usage is not None and completion.model == "tiny"
    server = one(traced.spans(SpanKind.SERVER))
    queue, provider = traced.spans(SpanKind.INTERNAL)
    assert (queue.name, provider.name) == ("spill queue", "spill provider")
    assert dict(queue.attributes or {}) == {"spillgate.policy": "queue", "spillgate.served": False}
    assert dict(provider.attributes or {}) == {
        "spillgate.policy": "provider",
        "spillgate.served": True,
        "spillgate.outcome": "provider",
    }
    for spill in (queue, provider):
        assert spill.parent is not None and spill.parent.span_id == server.context.span_id
    attempt = one(traced.spans(SpanKind.CLIENT))
    assert attempt.parent is not None and attempt.parent.span_id == provider.context.span_id
    attributes = attempt.attributes or {}
    assert attributes["server.port"] == traced.ports["hosted"]
    assert attributes["spillgate.external"] is True
    assert attributes["gen_ai.request.model"] == "hosted-model"
    assert attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    server_attributes = server.attributes or {}
    assert server_attributes["spillgate.outcome"] == "provider"
    assert server_attributes["spillgate.backend"] == "hosted"
    assert server_attributes["gen_ai.response.model"] == "hosted-model"
    assert server_attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    (post,) = traced.recorders["hosted"].posts
    assert post["traceparent"] == traceparent(attempt)


def test_a_bad_request_is_a_server_span_without_attempts(traced: Traced) -> None:
    response = httpx.post(
        f"{traced.gateway.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {traced.key}"},
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    )
    assert response.status_code == 400
    server = one(traced.spans())
    attributes = server.attributes or {}
    assert attributes["http.response.status_code"] == 400
    assert attributes["error.type"] == "InvalidRequest"
    assert server.status.status_code is StatusCode.UNSET  # a client's mistake is no server error


def test_with_tracing_off_no_span_is_made_and_no_traceparent_sent() -> None:
    with traced_fleet(enabled=False) as off:
        client = off.client(default_headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})
        for model in ("chat", "flaky", "tiny"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert off.exporter.get_finished_spans() == ()
        posts = [p for r in off.recorders.values() for p in r.posts]
        assert len(posts) == 4  # chat, flaky's bad then good, the provider
        assert all("traceparent" not in p and "tracestate" not in p for p in posts)


def _server_timing(response: httpx.Response, phase: str) -> float:
    for part in response.headers["server-timing"].split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == phase:
            return float(duration)
    raise AssertionError(f"no {phase} in server-timing")


def _queue_depth(traced: Traced, pool: str) -> float:
    return metric_sum(traced.gateway.url, "spillgate_queue_depth", pool=pool)


def test_a_request_the_queue_serves_is_a_spill_span_with_its_wait(traced: Traced) -> None:
    hold = {"model": "queued", "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 980, "stream": True}  # fmt: skip
    auth = {"authorization": f"Bearer {traced.key}"}
    with (
        httpx.Client(base_url=traced.gateway.url, headers=auth, timeout=20) as http,
        http.stream("POST", "/v1/chat/completions", json=hold) as held,
        ThreadPoolExecutor(1) as background,
    ):
        assert held.headers["x-spillgate-outcome"] == "local"  # the backend is full now
        waiting = background.submit(
            traced.client().chat.completions.with_raw_response.create,
            model="queued",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
        )
        deadline = time.monotonic() + 10
        while _queue_depth(traced, "queued") < 1:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.02)
        held.close()  # the gateway releases the hold, and the queue admits the waiter
        raw = waiting.result(timeout=20)
    assert raw.headers["x-spillgate-outcome"] == "queued"
    deadline = time.monotonic() + 5
    while not (
        servers := [
            s
            for s in traced.exporter.get_finished_spans()
            if s.kind is SpanKind.SERVER
            and (s.attributes or {}).get("spillgate.outcome") == "queued"
        ]
    ):
        assert time.monotonic() < deadline, "no span of the queued request"
        time.sleep(0.01)
    server = one(servers)
    spans = traced.exporter.get_finished_spans()
    trace = [s for s in spans if s.context.trace_id == server.context.trace_id]
    spill = one([s for s in trace if s.kind is SpanKind.INTERNAL])
    attempt = one([s for s in trace if s.kind is SpanKind.CLIENT])
    assert spill.name == "spill queue"
    assert spill.parent is not None and spill.parent.span_id == server.context.span_id
    assert attempt.parent is not None and attempt.parent.span_id == spill.context.span_id
    wait_s = (spill.attributes or {})["spillgate.queue_wait_s"]
    assert dict(spill.attributes or {}) == {
        "spillgate.policy": "queue",
        "spillgate.served": True,
        "spillgate.outcome": "queued",
        "spillgate.queue_wait_s": wait_s,
    }
    assert (server.attributes or {})["spillgate.queue_wait_s"] == wait_s
    # the wait the client is told in server-timing, to its 0.1 ms
    assert f"{wait_s * 1000:.1f}" == f"{_server_timing(raw.http_response, 'queue'):.1f}"
    assert wait_s > 0


@pytest.mark.parametrize("api", ["responses", "embeddings"])
def test_responses_and_embeddings_are_traced_as_their_operations(traced: Traced, api: str) -> None:
    with traced.client() as client:
        if api == "responses":
            client.responses.create(model="chat", input="Hi", max_output_tokens=4)
            pool, operation = "chat", "chat"
        else:
            client.embeddings.create(model="embed", input="Hi")
            pool, operation = "embed", "embeddings"
    server = one(traced.spans(SpanKind.SERVER))
    attempt = one(traced.spans(SpanKind.CLIENT))
    assert server.attributes is not None and server.attributes["spillgate.pool"] == pool
    assert server.attributes["gen_ai.operation.name"] == operation
    assert attempt.parent is not None and attempt.parent.span_id == server.context.span_id
    assert traced.recorders[pool].posts[-1]["traceparent"] == traceparent(attempt)


def test_a_split_request_has_a_span_per_leg_and_both_legs_one_request_id(
    traced: Traced,
) -> None:
    prompt = "Tell me everything about the fleet and its engines. " * 8
    answer = traced.client().chat.completions.create(
        model="split", messages=[{"role": "user", "content": prompt}], max_tokens=6
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    server = one(traced.spans(SpanKind.SERVER))
    assert (server.attributes or {})["spillgate.prefill"] == "split"
    legs = {
        (span.attributes or {}).get("spillgate.leg", "decode"): span
        for span in traced.spans(SpanKind.CLIENT)
    }
    assert {name: (s.attributes or {})["spillgate.backend"] for name, s in legs.items()} == {
        "prefill": "prefill",
        "decode": "decode",
    }
    (prefill,), (decode,) = traced.recorders["prefill"].posts, traced.recorders["decode"].posts
    assert prefill["traceparent"] == traceparent(legs["prefill"])
    assert decode["traceparent"] == traceparent(legs["decode"])
    assert prefill["x-request-id"] == decode["x-request-id"]
