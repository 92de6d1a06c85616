"""The `tracing:` keys: validated with the rest of the config, and where spans go."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import ConfigError, TracingSettings, parse_settings
from gateway.front.tracing import build_tracing, otlp_endpoint


def config(tracing: dict[str, Any]) -> dict[str, Any]:
    return {
        "tenants": [{"name": "acme", "key_sha256": "0" * 64}],
        "pools": [{"name": "big", "backends": [{"url": "http://127.0.0.1:9"}]}],
        "tracing": tracing,
    }


def test_tracing_is_off_by_default_and_builds_nothing() -> None:
    settings = parse_settings({k: v for k, v in config({}).items() if k != "tracing"})
    assert settings.tracing == TracingSettings(
        enabled=False, otlp_endpoint=None, service_name="spillgate", sample_ratio=1.0
    )
    assert build_tracing(settings.tracing, environ={}) is None


def test_the_tracing_keys_are_checked_with_the_rest_of_the_file() -> None:
    bad = {"enabled": True, "otlp_endpoint": "collector:4318", "sample_ratio": 2, "sampler": 1}
    with pytest.raises(ConfigError) as caught:
        parse_settings(config(bad))
    problems = "\n".join(caught.value.problems)
    assert "tracing.otlp_endpoint" in problems and "http://" in problems
    assert "tracing.sample_ratio" in problems
    assert "tracing.sampler" in problems


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        ("http://collector:4318/", {}, "http://collector:4318/v1/traces"),
        (None, {}, "http://localhost:4318/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}, "http://otel:4318/v1/traces"),
        (
            None,
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom",
            },
            "http://traces:9999/custom",
        ),
        (
            "http://collector:4318",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"},
            "http://collector:4318/v1/traces",
        ),
    ],
)
def test_spans_go_to_the_configured_collector_else_the_standard_variables(
    configured: str | None, environ: dict[str, str], expected: str
) -> None:
    settings = TracingSettings(enabled=True, otlp_endpoint=configured)
    assert otlp_endpoint(settings, environ) == expected


def test_an_unsampled_request_records_nothing_but_sends_its_context_on() -> None:
    exporter = InMemorySpanExporter()
    tracing = build_tracing(
        TracingSettings(enabled=True, sample_ratio=0.0), environ={}, exporter=exporter
    )
    assert tracing is not None
    scope = {"path": "/v1/chat/completions", "method": "POST", "headers": []}
    trace = tracing.begin(scope)
    assert not trace.recording
    carrier = trace.unsampled_headers()
    context = trace.span.get_span_context()
    assert not context.trace_flags.sampled
    flags = f"{context.trace_flags:02x}"
    assert carrier == {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags}"}
    trace.end()
    assert exporter.get_finished_spans() == ()


def test_a_sampled_clients_context_is_followed_whatever_the_ratio() -> None:
    exporter = InMemorySpanExporter()
    tracing = build_tracing(
        TracingSettings(enabled=True, sample_ratio=0.0), environ={}, exporter=exporter
    )
    assert tracing is not None
    parent = f"00-{'a' * 32}-{'b' * 16}-01"
    scope = {
        "path": "/v1/completions",
        "method": "POST",
        "headers": [(b"traceparent", parent.encode())],
    }
    trace = tracing.begin(scope)
    assert trace.recording
    trace.end()
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "b" * 16
