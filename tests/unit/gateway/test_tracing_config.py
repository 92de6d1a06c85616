"""The `tracing:` keys: validated with the rest of the config, and where spans go."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import ConfigError, TracingSettings, parse_settings
from gateway.tracing import build_tracing, otlp_endpoint


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
