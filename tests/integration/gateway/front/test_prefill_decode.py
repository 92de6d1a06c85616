"""A pool with a prefill backend and a decode backend: a long prompt is computed on the
prefill backend first (one token, not streamed), then the decode backend serves the answer;
a short one goes to the decode backend alone; a prefill backend that fails or is away is
never the client's failure. Simulated vLLMs behind a gateway, the official `openai` client."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum

KEY = "sk-" + secrets.token_hex(8)
LONG = "the fleet " * 400  # some 800 tokens: split
SHORT = "hi"


@dataclass
class Disaggregated:
    gateway: ServerThread
    prefill: ServerThread
    decode: ServerThread

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=KEY, max_retries=0)

    def decisions(self) -> dict[str, float]:
        return {
            decision: metric_sum(
                self.gateway.url, "spillgate_prefill_decisions_total", decision=decision
            )
            for decision in ("split", "short", "no_room", "failed", "whole")
        }


@contextlib.contextmanager
def disaggregated(**prefill: Any) -> Iterator[Disaggregated]:
    sim = SimConfig(model="big", kv_tokens=16_384, no_delay=True)
    with contextlib.ExitStack() as stack:
        prefiller = stack.enter_context(ServerThread(create_sim_app(sim)))
        decoder = stack.enter_context(ServerThread(create_sim_app(sim)))
        settings = parse_settings(
            {
                "tenants": [tenant("acme", KEY)],
                "pools": [
                    {
                        "name": "big",
                        "backends": [
                            {"url": prefiller.url, "role": "prefill"},
                            {"url": decoder.url, "role": "decode"},
                        ],
                        "prefill": {"kv_transfer": "shared", **prefill},
                    }
                ],
            }
        )
        app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
        gateway = stack.enter_context(ServerThread(app))
        until_both_in_rotation(gateway.url)
        yield Disaggregated(gateway, prefiller, decoder)


def until_both_in_rotation(url: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        backends = admin_status(url)["pools"][0]["backends"]
        if all(b["healthy"] for b in backends):
            return
        assert time.monotonic() < deadline, backends
        time.sleep(0.05)


def generated(url: str) -> float:
    return metric_sum(url, "vllm:generation_tokens_total")


def test_a_long_prompt_is_prefilled_there_and_decoded_here() -> None:
    with disaggregated() as fleet:
        stream = fleet.client().chat.completions.create(
            model="big",
            messages=[{"role": "user", "content": LONG}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 20 and text
        # the prefill backend computed the prompt and generated its one token; the decode
        # backend the answer; the client's usage counts the prompt once
        assert generated(fleet.prefill.url) == 1
        assert generated(fleet.decode.url) == 20
        prompt_there = metric_sum(fleet.prefill.url, "vllm:prompt_tokens_total")
        assert prompt_there == usage.prompt_tokens > 700
        assert fleet.decisions()["split"] == 1
        served = metric_sum(
            fleet.gateway.url, "spillgate_tokens_total", target="big-0", kind="prompt"
        )
        assert served == usage.prompt_tokens
        # the prefill backend holds nothing once its leg is over
        backends = admin_status(fleet.gateway.url)["pools"][0]["backends"]
        assert [(b["role"], b["tokens_in_flight"]) for b in backends] == [
            ("prefill", 0),
            ("decode", 0),
        ]


def test_the_prefill_legs_time_is_told_and_a_whole_answer_is_one_answer() -> None:
    with disaggregated() as fleet:
        raw = fleet.client().chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": LONG}], max_tokens=7
        )
        answer = raw.parse()
        assert "prefill;dur=" in raw.headers["server-timing"]
        assert answer.usage is not None and answer.usage.completion_tokens == 7
        assert raw.headers["x-spillgate-outcome"] == "local"


@pytest.mark.parametrize("min_prompt_tokens", [256, 10_000])
def test_a_short_prompt_goes_to_the_decode_backend_alone(min_prompt_tokens: int) -> None:
    with disaggregated(min_prompt_tokens=min_prompt_tokens) as fleet:
        prompt = SHORT if min_prompt_tokens == 256 else LONG
        fleet.client().completions.create(model="big", prompt=prompt, max_tokens=5)
        assert generated(fleet.prefill.url) == 0
        assert generated(fleet.decode.url) == 5
        assert fleet.decisions()["short"] == 1


def test_a_prefill_backend_that_fails_is_no_failure_of_the_client() -> None:
    with disaggregated() as fleet:
        fleet.prefill.stop()  # the gateway still takes it for up: the leg fails
        answer = fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert fleet.decisions()["failed"] == 1
        # it is out of rotation now: the next request does not try it
        fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        assert fleet.decisions()["no_room"] == 1
        assert generated(fleet.decode.url) == 10
