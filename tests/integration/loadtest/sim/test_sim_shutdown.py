"""`spillgate sim` on SIGTERM stops as vLLM 0.32 does (loadtest/sim/shutdown.py): by default
the requests in flight end at once with vLLM's dead-engine error and the server stops
listening; with `--shutdown-timeout N` they run on while new requests are refused with a
500, and the server goes about N seconds later."""

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from loadtest.procs import free_port, wait_for_port
from loadtest.sim.shutdown import ENGINE_DEAD, REFUSED
from tests.support.metrics import metric_sum

MESSAGES = [{"role": "user", "content": "Go on."}]
LONG = 3000  # tokens: a stream that outlives every test here, at real speed
DEAD = {"error": {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None,
                  "code": 500}}  # fmt: skip


@contextmanager
def sim_process(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", "m",
           "--answer-lengths", "max_tokens", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def chat(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}


@contextmanager
def events(http: httpx.Client, max_tokens: int) -> Iterator[Iterator[dict[str, Any] | str]]:
    """A stream's events as they come: each JSON object, and "[DONE]"."""
    with http.stream("POST", "/v1/chat/completions", json=chat(max_tokens, stream=True)) as r:
        assert r.status_code == 200
        yield (
            "[DONE]" if line == "data: [DONE]" else json.loads(line.removeprefix("data: "))
            for line in r.iter_lines()
            if line.startswith("data: ")
        )


def signal_once_running(
    stream: Iterator[dict[str, Any] | str], proc: subprocess.Popen[bytes], url: str, running: int
) -> float:
    """Reads the stream to its first word and waits for `running` requests in the engine,
    then sends SIGTERM; when it was sent."""
    for event in stream:
        if isinstance(event, dict) and event["choices"][0]["delta"].get("content"):
            break
    deadline = time.monotonic() + 10
    while metric_sum(url, "vllm:num_requests_running") < running:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    return time.monotonic()


def exited_within(proc: subprocess.Popen[bytes], seconds: float) -> float:
    started = time.monotonic()
    proc.wait(timeout=seconds)
    return time.monotonic() - started


def test_by_default_requests_in_flight_end_at_once_with_vllms_engine_error() -> None:
    with (
        sim_process() as (proc, url),
        httpx.Client(base_url=url, timeout=30) as http,
        ThreadPoolExecutor(1) as pool,
        events(http, LONG) as stream,
    ):
        whole = pool.submit(httpx.post, f"{url}/v1/chat/completions",
                            json=chat(LONG, stream=False), timeout=30)  # fmt: skip
        signalled = signal_once_running(stream, proc, url, 2)
        rest = list(stream)
        cut_after = time.monotonic() - signalled
        answer = whole.result()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)  # not listening: no 503 either
        gone = exited_within(proc, 10)
    assert cut_after < 1.0 and gone < 5.0
    assert rest[-2:] == [DEAD, "[DONE]"]
    assert all(isinstance(e, str) or e.get("error") or not e["choices"][0]["finish_reason"]
               for e in rest)  # fmt: skip
    assert (answer.status_code, answer.json()["error"]["message"]) == (500, ENGINE_DEAD)


def test_with_a_shutdown_timeout_requests_run_on_and_new_ones_are_refused() -> None:
    with (
        sim_process("--shutdown-timeout", "2") as (proc, url),
        httpx.Client(base_url=url, timeout=30) as http,
        httpx.Client(base_url=url, timeout=30) as other,
        events(http, LONG) as long_stream,
    ):
        with events(other, 120) as stream:
            signalled = signal_once_running(stream, proc, url, 2)
            time.sleep(0.2)
            refused = httpx.post(f"{url}/v1/chat/completions", json=chat(4, stream=False))
            health = httpx.get(f"{url}/health")
            rest = list(stream)
        too_long = list(long_stream)
        ended = time.monotonic() - signalled
        gone = exited_within(proc, 10) + ended
    assert (refused.status_code, refused.json()["error"]) == (
        500,
        {"message": REFUSED, "type": "InternalServerError", "param": None, "code": 500},
    )
    assert health.status_code == 200
    finishes = [
        e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict) and e["choices"]
    ]
    assert (finishes[-1], rest[-1]) == ("length", "[DONE]")  # the short stream ran to its end
    assert too_long[-2:] == [DEAD, "[DONE]"]  # the long one ended at the deadline
    assert 1.8 < ended < 3.0 and gone < 5.0
