"""The gateway serves its OpenAPI description, and schemathesis, generating valid and
invalid requests from it against the live gateway, finds no server error and no response
the description does not allow."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.ops.openapi import openapi_document
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet

EXAMPLES_PER_OPERATION = 25
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with run_fleet(
        pools={"big": [SimConfig(model="m", kv_tokens=8192, no_delay=True)]},
        pool_options={"big": {"max_model_len": 4096}},
        tenants={"acme": {"requests_per_minute": 100_000, "tokens_per_minute": 10**9}},
        extra={"server": {"max_body_bytes": 64 * 1024}},
    ) as f:
        yield f


# The description is static data, so the schema is loaded from it at collection time (the
# lazy, fixture-based loader does not run under this pytest); another test checks that the
# gateway serves exactly this document.
schema = schemathesis.openapi.from_dict(openapi_document())
MODES = list(schemathesis.GenerationMode)
schema.config.generation.update(modes=MODES, deterministic=True)
# one test per operation, each with an id of its own (schemathesis' own parametrize gives
# them all one node id, which `make test`'s --dist loadfile would take for a single test)
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
@given(data=st.data())
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_server_error_and_no_response_outside_the_description(
    operation: APIOperation, data: st.DataObject, fleet: Fleet
) -> None:
    # valid and invalid requests, as the schema's generation modes say
    case = data.draw(st.one_of(*(operation.as_strategy(mode) for mode in MODES)))
    token = ADMIN_TOKEN if operation.path.startswith("/admin") else fleet.keys["acme"]
    response = case.call(
        base_url=fleet.url, headers={"authorization": f"Bearer {token}"}, timeout=10
    )
    case.validate_response(response, checks=CHECKS)


def test_the_description_covers_every_gateway_endpoint(fleet: Fleet) -> None:
    served = httpx.get(f"{fleet.url}/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.json() == openapi_document()
    app = fleet.gateway.server.config.app
    routes = {
        (route.path, method)
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    }
    described = {
        (path, method.upper())
        for path, item in openapi_document()["paths"].items()
        for method in item
    }
    contract = {
        ("/v1/chat/completions", "POST"),
        ("/v1/completions", "POST"),
        ("/v1/embeddings", "POST"),
        ("/v1/responses", "POST"),
        ("/v1/models", "GET"),
        ("/healthz", "GET"),
        ("/readyz", "GET"),
        ("/metrics", "GET"),
        ("/admin/status", "GET"),
        ("/openapi.json", "GET"),
    }
    assert contract <= described <= routes


def test_errors_and_refusals_describe_their_headers() -> None:
    responses = openapi_document()["components"]["responses"]
    for name in ("Throttled", "Rejected", "UpstreamFailed", "UpstreamTimeout"):
        headers = responses[name]["headers"]
        assert headers["retry-after"]["$ref"].endswith("/RetryAfter")
        assert headers["x-spillgate-outcome"]["$ref"].endswith("/Outcome")
    error = openapi_document()["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
