"""The one reader of Prometheus text: every sample, or the named ones, summed by labels."""

import pytest

from gateway.admission.fleet.metrics_text import families, samples, total, values

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 5.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 2.5
"""


def test_every_sample_or_only_the_named_ones_with_their_labels() -> None:
    assert len(samples(PAGE)) == 7
    named = samples(PAGE, {"vllm:num_requests_running", "vllm:num_preemptions_total"})
    assert [(s.name, s.labels["engine"], s.value) for s in named] == [
        ("vllm:num_requests_running", "0", 3.0),
        ("vllm:num_requests_running", "1", 2.0),
        ("vllm:num_preemptions_total", "0", 7.0),
    ]
    assert {f.name: f.type for f in families(PAGE)}["vllm:num_preemptions"] == "counter"


def test_values_and_totals_by_name_and_labels() -> None:
    found = samples(PAGE)
    assert values(found, "vllm:num_requests_running", engine="1") == [2.0]
    assert total(found, "vllm:num_requests_running") == 5.0
    assert total(found, "vllm:num_requests_running", engine="9") is None
    assert total(found, "vllm:e2e_request_latency_seconds_sum") == 2.5


def test_a_line_the_parser_cannot_read_is_an_error_only_when_it_is_read() -> None:
    broken = PAGE + "other_metric{oops 1\n"
    assert total(samples(broken, {"vllm:num_requests_running"}), "vllm:num_requests_running") == 5
    with pytest.raises(ValueError):
        samples(broken)
