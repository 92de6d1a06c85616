"""The pure parts of `spillgate measure`: metrics parsing, percentiles, the steady window."""

from __future__ import annotations

import orjson
import pytest

from gateway.capacity import replica_profile, throughput
from loadtest.measure.report import Prediction, endpoint_sessions
from loadtest.measure.results import (
    EndpointKv,
    endpoint_kv,
    running_now,
    steady_tokens_per_s,
)
from loadtest.measure.stream import (
    Arrival,
    MeasureError,
    Sample,
    StreamReader,
    calibrated_words,
    prompt_text,
)

# Lines as a vLLM 0.32 server exports them (labels trimmed to the ones read here and a few).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",\
gpu_memory_utilization="0.92",kv_cache_size_tokens="1048576",num_gpu_blocks="8192",\
sliding_window="None"} 1.0
"""


def test_endpoint_kv_and_running_from_vllm_metrics() -> None:
    assert endpoint_kv(VLLM_METRICS) == EndpointKv(num_gpu_blocks=8192, block_size=128)
    assert running_now(VLLM_METRICS) == 5
    assert endpoint_kv("# nothing here\n") is None and running_now("") is None


def test_endpoint_sessions_count_whole_blocks_per_session() -> None:
    kv = EndpointKv(num_gpu_blocks=1719, block_size=16)
    workload = throughput.Workload(prompt_tokens=2000, output_tokens=32)
    assert endpoint_sessions(kv, workload) == 1719 // 127
    assert endpoint_sessions(None, workload) is None


def test_prompts_are_text_distinct_per_request_within_their_first_words() -> None:
    openings = {tuple(prompt_text(i, 64).split()[:8]) for i in range(1000)}
    assert len(openings) == 1000
    assert prompt_text(3, 64) == prompt_text(3, 64) and len(prompt_text(3, 64).split()) == 64
    # five characters a word with its space: the simulator counts ceil(chars / 4) + 1
    assert len(prompt_text(5, 1599)) == 1599 * 5 - 1


def test_prompt_words_are_calibrated_on_the_endpoints_count() -> None:
    # the simulator counted 2,000 words as 2,501 tokens; 1,599 words count 2,000
    assert calibrated_words(target_tokens=2000, words=2000, tokens=2501) == 1599
    # a BPE tokenizer counts a word a token, and a BOS token
    assert calibrated_words(target_tokens=2000, words=2000, tokens=2001) == 1999
    # an endpoint that reports no usage leaves the words as they were
    assert calibrated_words(target_tokens=512, words=512, tokens=0) == 512


def test_steady_window_counts_tokens_while_every_client_is_busy() -> None:
    # client A streams 1 token every 0.1 s from t=0 to 3; client B starts at t=1
    def stream(start: float, requests: int) -> list[Sample]:
        out = []
        for r in range(requests):
            t0 = start + r
            arrivals = [Arrival(at=t0 + 0.1 * k, events=1) for k in range(1, 11)]
            out.append(Sample(started=t0, arrivals=arrivals, completion_tokens=10, ended=t0 + 1))
        return out

    workers = [stream(0.0, 3), stream(1.0, 3)]
    # window [1, 3]: both busy, 10 tokens/s each
    assert steady_tokens_per_s(workers) == pytest.approx(20.0, rel=0.06)


def arrivals(*pairs: tuple[float, int]) -> list[Arrival]:
    return [Arrival(at=at, events=events) for at, events in pairs]


def test_tokens_of_one_read_share_the_gap_since_the_read_before() -> None:
    # one token at 0.1 s, three in the read at 0.4 s, one at 0.5 s
    sample = Sample(started=0.0, arrivals=arrivals((0.1, 1), (0.4, 3), (0.5, 1)))
    sample.completion_tokens = 5
    assert sample.ttft_s == pytest.approx(0.1)
    assert sample.itls_s() == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_events_of_several_tokens_count_every_token() -> None:
    # an engine that fell behind sends two tokens an event: 6 tokens in 3 events
    sample = Sample(started=0.0, arrivals=arrivals((0.1, 1), (0.3, 1), (0.5, 1)))
    sample.completion_tokens = 6
    assert sample.itls_s() == pytest.approx([0.1, 0.1, 0.1, 0.1])


def event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


def text_event(text: str) -> bytes:
    choice = {"index": 0, "text": text}
    return event(orjson.dumps({"object": "text_completion", "choices": [choice]}).decode())


def test_a_read_of_several_events_is_one_arrival_and_usage_counts_the_tokens() -> None:
    sample = Sample(started=0.0)
    reader = StreamReader(sample)
    first = text_event(" a")
    reader.feed(first[:10], 0.1)  # half an event: nothing arrived yet
    reader.feed(first[10:] + text_event(""), 0.2)  # an empty text is a token (half a char)
    usage = '{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4}}'
    reader.feed(text_event(" b") + text_event(" c") + event(usage), 0.5)
    assert not reader.done
    reader.feed(event("[DONE]"), 0.6)
    assert reader.done
    assert sample.arrivals == arrivals((0.2, 2), (0.5, 2))
    assert (sample.prompt_tokens, sample.completion_tokens) == (7, 4)
    assert sample.itls_s() == pytest.approx([0.15, 0.15])


def test_an_error_event_in_the_stream_is_an_error_with_the_endpoints_message() -> None:
    reader = StreamReader(Sample(started=0.0))
    refusal = (
        '{"error":{"message":"Token id 31000 is out of vocabulary","type":"BadRequestError",'
        '"param":null,"code":400}}'
    )
    with pytest.raises(MeasureError) as caught:
        reader.feed(event(refusal) + event("[DONE]"), 0.1)
    assert str(caught.value) == "the stream carried an error: Token id 31000 is out of vocabulary"


def test_prediction_scales_with_the_simulator_speed() -> None:
    profile = replica_profile(model="llama-3.1-8b", gpu="h100")
    workload = throughput.Workload(prompt_tokens=512, output_tokens=128)
    real = Prediction(profile=profile, workload=workload).at(8)
    fast = Prediction(profile=profile, workload=workload, speed=10).at(8)
    assert fast.output_tokens_per_s == pytest.approx(10 * real.output_tokens_per_s)
    assert fast.ttft_s == pytest.approx(real.ttft_s / 10)
