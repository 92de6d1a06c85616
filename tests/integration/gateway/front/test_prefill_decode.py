"""A pool with a prefill backend and a decode backend: a long prompt is computed on the
prefill backend first (one token, not streamed), then the decode backend serves the answer;
a short one goes to the decode backend alone; a prefill backend that fails or is away is
never the client's failure. Simulated vLLMs behind a gateway, the official `openai` client."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import RedisProcess, free_port, wait_for_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import KvTransfer, SimConfig
from tests.support.fleet import ADMIN_TOKEN, admin_status, tenant
from tests.support.harness import ServerThread
from tests.support.metrics import metric_sum
from tests.support.traced import Recorder

KEY = "sk-" + secrets.token_hex(8)
LONG = "the fleet " * 400  # some 800 tokens: split
SHORT = "hi"


@dataclass
class Disaggregated:
    gateway: ServerThread
    prefill: str  # the backends' URLs
    decode: str  # the first decode backend's
    decoders: list[str]
    servers: list[ServerThread]  # those the test runs in process, the prefill backend first

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
def disaggregated(
    *,
    sims: tuple[SimConfig, ...] | None = None,
    apps: tuple[Any, ...] = (),
    urls: list[str] | None = None,
    pool: dict[str, Any] | None = None,
    decode_capacity: int | None = None,
    redis_url: str | None = None,
    **prefill: Any,
) -> Iterator[Disaggregated]:
    """A gateway in front of a prefill backend and one or more decode backends (`sims`, in
    that order, or `apps`, then the servers already at `urls`; by default two plain
    simulators, a pool with `kv_transfer: shared`), with `pool`'s settings besides, the
    decode backends' capacity set to `decode_capacity` when given."""
    plain = SimConfig(model="big", kv_tokens=16_384, no_delay=True)
    sims = sims or (plain, plain)
    prefill = {"kv_transfer": "shared", **prefill}
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(ServerThread(app))
            for app in apps or [create_sim_app(sim) for sim in sims]
        ]
        urls = [server.url for server in servers] + (urls or [])
        roles = ["prefill"] + ["decode"] * (len(urls) - 1)
        settings = parse_settings(
            {
                "tenants": [tenant("acme", KEY)],
                "pools": [
                    {
                        "name": "big",
                        "backends": [
                            {"url": url, "role": role}
                            | ({"capacity": decode_capacity} if decode_capacity and i else {})
                            for i, (url, role) in enumerate(zip(urls, roles, strict=True))
                        ],
                        "prefill": prefill,
                        **(pool or {}),
                    }
                ],
            }
        )
        env = {"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}
        app = create_app(settings, environ=env, redis_url=redis_url)
        gateway = stack.enter_context(ServerThread(app))
        until_both_in_rotation(gateway.url)
        yield Disaggregated(gateway, urls[0], urls[1], urls[1:], servers)


def until_both_in_rotation(url: str) -> None:
    """Until every backend of the pool is in rotation."""
    deadline = time.monotonic() + 20
    while True:
        backends = admin_status(url)["pools"][0]["backends"]
        if all(b["healthy"] for b in backends):
            return
        assert time.monotonic() < deadline, backends
        time.sleep(0.05)


def until_nothing_held(url: str) -> None:
    """Until neither backend of the pool holds a token: every leg's reservation given back."""
    deadline = time.monotonic() + 10
    while True:
        backends = admin_status(url)["pools"][0]["backends"]
        held = [(b["role"], b["tokens_in_flight"]) for b in backends]
        if held == [("prefill", 0), ("decode", 0)]:
            return
        assert time.monotonic() < deadline, held
        time.sleep(0.05)


def stream_long_chat(
    fleet: Disaggregated, *, max_tokens: int
) -> tuple[str, CompletionUsage | None]:
    """A streamed chat with the LONG prompt: its text and the usage its last chunk told."""
    stream = fleet.client().chat.completions.create(
        model="big",
        messages=[{"role": "user", "content": LONG}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def generated(url: str) -> float:
    return metric_sum(url, "vllm:generation_tokens_total")


def test_a_long_prompt_is_prefilled_there_and_decoded_here() -> None:
    with disaggregated() as fleet:
        text, usage = stream_long_chat(fleet, max_tokens=20)
        assert usage is not None and usage.completion_tokens == 20 and text
        # the prefill backend computed the prompt and generated its one token; the decode
        # backend the answer; the client's usage counts the prompt once
        assert generated(fleet.prefill) == 1
        assert generated(fleet.decode) == 20
        prompt_there = metric_sum(fleet.prefill, "vllm:prompt_tokens_total")
        assert prompt_there == usage.prompt_tokens > 700
        assert fleet.decisions()["split"] == 1
        served = metric_sum(
            fleet.gateway.url, "spillgate_tokens_total", target="big-0", kind="prompt"
        )
        assert served == usage.prompt_tokens
        # the prefill backend holds nothing once its leg is over, nor the decode backend
        # once the answer is settled
        until_nothing_held(fleet.gateway.url)


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
        assert generated(fleet.prefill) == 0
        assert generated(fleet.decode) == 5
        assert fleet.decisions()["short"] == 1


def test_a_prefill_backend_that_fails_is_no_failure_of_the_client() -> None:
    with disaggregated() as fleet:
        fleet.servers[0].stop()  # the gateway still takes it for up: the leg fails
        answer = fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert fleet.decisions()["failed"] == 1
        # it is out of rotation now: the next long prompt does not try it
        fleet.client().completions.create(model="big", prompt="Another. " + LONG, max_tokens=5)
        assert fleet.decisions()["no_room"] == 1
        assert generated(fleet.decode) == 10


def params_sim(engine: str) -> SimConfig:
    """A simulated vLLM with a NixlConnector-style connector, in real time at 20x."""
    params = KvTransfer.PARAMS
    return SimConfig(
        model="big", kv_tokens=16_384, speed=20.0, kv_transfer=params, engine_id=engine
    )


def by_source(url: str, source: str) -> float:
    return metric_sum(url, "vllm:prompt_tokens_by_source_total", source=source)


def test_the_decode_engine_loads_the_prompt_the_prefill_engine_handed_on() -> None:
    sims = (params_sim("p0"), params_sim("d0"))
    with disaggregated(sims=sims, kv_transfer="params") as fleet:
        _, usage = stream_long_chat(fleet, max_tokens=12)
        assert usage is not None and usage.completion_tokens == 12
        assert fleet.decisions()["split"] == 1
        loaded = by_source(fleet.decode, "external_kv_transfer")
        computed = by_source(fleet.decode, "local_compute")
        assert loaded + computed == usage.prompt_tokens
        assert loaded >= 0.8 * usage.prompt_tokens, (loaded, computed)
        assert by_source(fleet.prefill, "local_compute") == usage.prompt_tokens


def test_prefill_params_that_lead_nowhere_are_no_failure_of_the_client() -> None:
    """A prefill backend whose KV cannot be loaded (here: its handshake route is gone) makes
    the decode engine fail the request and exit, as vLLM's `kv_load_failure_policy: fail`
    does: the decode leg is retried on the other decode backend, which prefills itself, and
    the dead one is out of rotation."""
    prefiller = create_sim_app(params_sim("p0"))

    async def unreachable_kv(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/sim/kv_engine"):
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await prefiller(scope, receive, send)

    with contextlib.ExitStack() as stack:
        decoders = [stack.enter_context(decode_process(f"d{i}")) for i in range(2)]
        with disaggregated(apps=(unreachable_kv,), urls=decoders, kv_transfer="params") as fleet:
            answers = [
                fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
                for _ in range(2)
            ]
            assert [a.usage.completion_tokens for a in answers if a.usage] == [5, 5]
            # the second goes where the first was served, which caches its prompt now
            decisions = fleet.decisions()
            assert (decisions["split"], decisions["short"]) == (1, 1), decisions
            # out of rotation: found by the request that tried it, else by the next probe
            deadline = time.monotonic() + 20
            while True:
                backends = admin_status(fleet.gateway.url)["pools"][0]["backends"]
                healthy = sorted((b["role"], b["healthy"]) for b in backends)
                if healthy == [("decode", False), ("decode", True), ("prefill", True)]:
                    break
                assert time.monotonic() < deadline, healthy
                time.sleep(0.1)
            alive = next(url for url in decoders if url.endswith(str(healthy_port(backends))))
            assert generated(alive) == 10


def healthy_port(backends: list[dict[str, Any]]) -> int:
    (url,) = [b["url"] for b in backends if b["role"] == "decode" and b["healthy"]]
    return int(url.rsplit(":", 1)[1])


@contextlib.contextmanager
def decode_process(engine: str) -> Iterator[str]:
    """A `spillgate sim` decode engine in a process of its own: a failed KV load ends it."""
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", "big",
            "--kv-tokens", "16384", "--speed", "20", "--kv-transfer", "params",
            "--engine-id", engine, "--answer-lengths", "max_tokens"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_request_that_queued_for_its_decode_backend_is_split_once_admitted() -> None:
    """The queue, the class order and the split work together: the decode backend holds one
    request at a time, the second waits in the queue, then goes as a split request too."""
    sims = (
        SimConfig(model="big", kv_tokens=16_384),  # in real time: the first answer lasts
        SimConfig(model="big", kv_tokens=16_384),
    )
    pool = {"overflow": ["queue", "reject"], "reservation": {"mode": "max_tokens"}}
    with disaggregated(sims=sims, pool=pool, decode_capacity=1600) as fleet:
        client = fleet.client()

        def ask(i: int) -> str:
            raw = client.completions.with_raw_response.create(
                model="big", prompt=f"{i} {LONG}", max_tokens=48
            )
            assert raw.parse().usage.completion_tokens == 48  # type: ignore[union-attr]
            return raw.headers["x-spillgate-outcome"]

        with ThreadPoolExecutor(max_workers=2) as pool_of:
            first = pool_of.submit(ask, 1)
            time.sleep(0.1)
            second = pool_of.submit(ask, 2)
            outcomes = sorted([first.result(timeout=30), second.result(timeout=30)])
        assert outcomes == ["local", "queued"]
        assert fleet.decisions()["split"] == 2
        assert generated(fleet.prefill) == 2


def test_with_redis_the_prefill_backends_ledger_is_shared_and_given_back() -> None:
    """In shared mode the prefill backend's room is reserved through the shared ledger as
    every backend's is: a split request is served, and what it held there is given back."""
    with RedisProcess() as redis, disaggregated(redis_url=redis.url) as fleet:
        answer = fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert fleet.decisions()["split"] == 1
        assert metric_sum(fleet.gateway.url, "spillgate_ledger_mode", mode="shared") == 1
        until_nothing_held(fleet.gateway.url)


def test_a_client_that_leaves_during_the_prefill_leg_leaves_nothing_held() -> None:
    slow = SimConfig(model="big", kv_tokens=16_384, speed=0.01)  # a prefill of seconds
    prefill, decode = Recorder(create_sim_app(slow)), Recorder(create_sim_app(slow))
    with disaggregated(apps=(prefill, decode)) as fleet:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{fleet.gateway.url}/v1/completions",
                json={"model": "big", "prompt": LONG, "max_tokens": 5},
                headers={"authorization": f"Bearer {KEY}"},
                timeout=1.0,
            )
        until_nothing_held(fleet.gateway.url)
        # the client left during the prefill leg: the decode engine was never asked
        assert (len(prefill.posts), len(decode.posts)) == (1, 0)


def test_with_one_decode_backend_a_prompt_it_caches_is_not_prefilled_again() -> None:
    """One decode backend leaves routing no choice, but the split still asks what it caches:
    the same long prompt again goes to it alone."""
    with disaggregated() as fleet:
        for _ in range(2):
            fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        decisions = fleet.decisions()
        assert (decisions["split"], decisions["short"]) == (1, 1), decisions
        assert generated(fleet.prefill) == 1


def test_a_prompt_the_engines_refuse_takes_no_prefill_backend_out_of_rotation() -> None:
    """Token ids past the engines' vocabulary: the prefill engine refuses the leg with a 400,
    the decode engine the request, and the client is told so. Were a refusal of what a client
    sent the prefill backend's failure, three such requests would take it out of rotation."""
    sim = SimConfig(model="big", kv_tokens=16_384, no_delay=True, vocab_size=4096)
    with disaggregated(sims=(sim, sim)) as fleet:
        for i in range(4):  # four prompts: the same one again would be cached, not split
            prompt = [4096 + i] * 600
            with pytest.raises(openai.BadRequestError):
                fleet.client().completions.create(model="big", prompt=prompt, max_tokens=5)
        assert fleet.decisions()["failed"] == 4
        fleet.client().completions.create(model="big", prompt=LONG, max_tokens=5)
        assert fleet.decisions()["split"] == 1
