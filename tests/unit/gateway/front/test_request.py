import pytest

from gateway.errors import InvalidRequest
from gateway.front.parse import decode_body, parse_request
from gateway.front.request import effective_priority, slo_seconds
from gateway.request import TTFT_HEADER, Endpoint, PromptEstimator


def _parse(body: dict[str, object], **kw: object) -> object:
    opts: dict[str, object] = dict(
        endpoint=Endpoint.CHAT, tenant="t", pool="p", priority="standard",
        default_max_tokens=100, max_model_len=4096, chars_per_token=4.0,
    )  # fmt: skip
    opts.update(kw)
    return parse_request(body, **opts)  # type: ignore[arg-type]


def test_reserves_prompt_estimate_plus_max_tokens() -> None:
    req = _parse({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50})
    assert req.max_output_tokens == 50  # type: ignore[attr-defined]
    assert 100 <= req.prompt_tokens <= 110  # type: ignore[attr-defined]
    assert req.charge_tokens == req.prompt_tokens + 50  # type: ignore[attr-defined]


def test_default_max_tokens_when_absent_and_stream_usage_flag() -> None:
    req = _parse(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.max_output_tokens == 100  # type: ignore[attr-defined]
    assert req.stream and req.client_wants_usage  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_input_names_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _parse(body)
    assert info.value.param == param
    assert info.value.status == 400


def test_completions_prompt_forms() -> None:
    assert _parse({"prompt": "abcd" * 10}, endpoint=Endpoint.COMPLETIONS).prompt_chars == 40  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest):
        _parse({"prompt": 3}, endpoint=Endpoint.COMPLETIONS)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'"x"', b"\xff"])
def test_undecodable_bodies(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode_body(raw)


def test_priority_can_be_lowered_never_raised() -> None:
    assert effective_priority("standard", "sheddable") == "sheddable"
    assert effective_priority("standard", "critical") == "standard"
    assert effective_priority("critical", None) == "critical"
    assert effective_priority("sheddable", "bogus") == "sheddable"


def test_estimator_moves_toward_observed_ratio() -> None:
    est = PromptEstimator(chars_per_token=4.0, weight=0.5)
    for _ in range(20):
        est.observe(prompt_chars=300, prompt_tokens=100)
    assert est.chars_per_token == pytest.approx(3.0, abs=0.01)


@pytest.mark.parametrize(
    ("header", "default_s", "expected_s"),
    [
        (None, None, None),
        (None, 1.5, 1.5),  # the tenant's default
        ("250", 1.5, 0.25),  # the header wins, tighter or looser
        ("2500.5", 1.5, 2.5005),
        ("3600000", None, 3600.0),
    ],
)
def test_a_requests_objective_is_its_headers_else_its_tenants(
    header: str | None, default_s: float | None, expected_s: float | None
) -> None:
    assert slo_seconds(header, TTFT_HEADER, default_s) == expected_s


@pytest.mark.parametrize("header", ["0", "-5", "soon", "nan", "inf", "3600001", ""])
def test_an_objective_that_is_no_positive_number_of_ms_is_refused_naming_its_header(
    header: str,
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        slo_seconds(header, TTFT_HEADER, 1.0)
    assert caught.value.param == TTFT_HEADER
    assert TTFT_HEADER in str(caught.value) and repr(header) in str(caught.value)
