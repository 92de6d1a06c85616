"""A stream whose backend dies mid-answer goes on on the other backend of its pool: the
client, the official `openai` client here, sees one unbroken stream, its text continuous,
its id unchanged, its usage counted once. Two simulated vLLMs in processes of their own,
one killed with SIGKILL while it streams; the simulator continues an answer as a
deterministic model does (its word i is always the same)."""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.sim.tokens import FillerText, chat_prompt_tokens, completion_prompt_tokens
from tests.support.fault import backend_process, wait_for_process
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread
from tests.support.matrix import wait_until_up
from tests.support.metrics import metric_sum

MESSAGES = [{"role": "user", "content": "Tell me about the fleet."}]
PROMPT = "The fleet"
MAX_TOKENS = 60
CUT_AFTER = 8  # chunks the client reads before the serving backend is killed


@dataclass
class Pair:
    fleet: Fleet
    procs: list[subprocess.Popen[bytes]]
    urls: list[str]

    def client(self) -> openai.OpenAI:
        key = self.fleet.keys["acme"]
        return openai.OpenAI(base_url=self.fleet.url + "/v1", api_key=key, max_retries=0)

    def kill_the_busy_one(self, *, and_idle: int = 0) -> None:
        """SIGKILL the backend that is generating now (its own metrics say which), and the
        first `and_idle` of the others, which the gateway still takes for up."""
        busy = [metric_sum(url, "vllm:num_requests_running") > 0 for url in self.urls]
        assert busy.count(True) == 1, "one backend should be generating"
        idle = [proc for proc, b in zip(self.procs, busy, strict=True) if not b]
        for proc in [self.procs[busy.index(True)], *idle[:and_idle]]:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def read_killing(self, stream: Iterable[Any], *, and_idle: int = 0) -> list[Any]:
        """The stream's chunks, its backend killed once CUT_AFTER of them have come."""
        chunks = []
        for i, chunk in enumerate(stream):
            chunks.append(chunk)
            if i == CUT_AFTER:
                self.kill_the_busy_one(and_idle=and_idle)
        return chunks

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.fleet.url, name, **labels)


@contextlib.contextmanager
def pair(backends: int = 2, **pool: Any) -> Iterator[Pair]:
    """Simulated backends (two by default, at half real speed) behind a gateway."""
    with contextlib.ExitStack() as stack:
        started = [
            stack.enter_context(backend_process(model="big", speed=0.5)) for _ in range(backends)
        ]
        keys = {"acme": "sk-" + secrets.token_hex(8)}
        settings = parse_settings(
            {
                "tenants": [tenant("acme", keys["acme"])],
                "pools": [
                    {
                        "name": "big",
                        "backends": [{"url": url, "capacity": 8192} for _, url in started],
                        **pool,
                    }
                ],
            }
        )
        gateway = ServerThread(create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN}))
        with gateway:
            for proc, url in started:
                wait_for_process(proc, url)
            fleet = Fleet(gateway=gateway, backends={}, settings=settings, keys=keys)
            for i in range(backends):
                wait_until_up(fleet, f"big-{i}")
            yield Pair(fleet, [proc for proc, _ in started], [url for _, url in started])


def read_chat(p: Pair, *, and_idle: int = 0, **extra: Any) -> tuple[list[Any], str]:
    stream = p.client().chat.completions.create(
        model="big",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    chunks = p.read_killing(stream, and_idle=and_idle)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def test_a_chat_stream_goes_on_on_the_other_backend_whole_and_counted_once() -> None:
    with pair() as p:
        chunks, text = read_chat(p)
        usage = chunks[-1].usage
        assert usage is not None
        assert text == FillerText().text(0, MAX_TOKENS)  # continuous: no word lost or twice
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
        assert {c.id for c in chunks} == {chunks[0].id}
        assert [c.choices[0].delta.role for c in chunks if c.choices].count("assistant") == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert p.metric("spillgate_stream_continuations_total", result="succeeded") == 1
        assert p.metric("spillgate_requests_total", outcome="local") == 1
        time.sleep(0.1)
        assert p.metric("spillgate_inflight_tokens") == 0  # nothing left reserved


def test_a_completion_stream_goes_on_with_its_prompt_and_the_text_so_far() -> None:
    with pair() as p:
        stream = p.client().completions.create(
            model="big",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = p.read_killing(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == FillerText().text(0, MAX_TOKENS)
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == completion_prompt_tokens(PROMPT)


def test_a_stream_that_cannot_be_continued_ends_with_the_error_event() -> None:
    with pair() as p:
        with pytest.raises(openai.APIError, match="mid-stream"):
            read_chat(p, n=2)
        assert p.metric("spillgate_stream_continuations_refused_total", reason="choices") == 1
        assert p.metric("spillgate_stream_continuations_total") == 0


def test_a_pool_that_turns_it_off_ends_the_stream_with_the_error_event() -> None:
    with pair(continue_streams=0) as p:
        with pytest.raises(openai.APIError, match="mid-stream"):
            read_chat(p)
        assert p.metric("spillgate_stream_continuations_refused_total", reason="off") == 1


def test_admin_status_and_a_cut_backend_are_told() -> None:
    with pair() as p:
        read_chat(p)
        status = httpx.get(
            p.fleet.url + "/admin/status",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=5,
        ).json()
        states = {b["name"]: b["state"] for pool in status["pools"] for b in pool["backends"]}
        assert sorted(states.values()) == ["down", "up"]  # the killed one is out of rotation


def test_a_continuation_whose_backend_is_gone_too_goes_on_on_a_third() -> None:
    """The backend the continuation goes to died with the first (the gateway has not
    noticed yet): that try fails before its first byte, and the next backend continues.
    By least fill, the idle backend first in the pool is tried first: the one killed. (Its
    probes come far apart, so that none finds it gone before the continuation does.)"""
    with pair(backends=3, routing="least_filled", capacity_refresh_s=60) as p:
        chunks, text = read_chat(p, and_idle=1)
        assert text == FillerText().text(0, MAX_TOKENS)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert p.metric("spillgate_stream_continuations_total", result="failed") == 1
        assert p.metric("spillgate_stream_continuations_total", result="succeeded") == 1
