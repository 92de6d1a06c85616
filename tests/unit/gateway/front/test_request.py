import pytest

from gateway.errors import InvalidRequest
from gateway.front.parse import decode_body, parse_request
from gateway.front.request import Endpoint, PromptEstimator, effective_priority


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
    assert req.reserved_tokens == req.prompt_tokens + 50  # type: ignore[attr-defined]


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
