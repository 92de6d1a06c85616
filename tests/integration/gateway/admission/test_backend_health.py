"""Backends that are dead, hung or serve another model, seen through real sockets: each
keeps its pool out of rotation with the reason told to clients, /readyz, /admin/status and
the log (once per change), and nothing is reported as a full pool."""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from gateway.app import create_app
from gateway.config import parse_settings
from loadtest.procs import free_port, wait_for_port
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fault import FaultBackend, backend_process, chat, wait_for_process
from tests.support.fleet import ADMIN_TOKEN, Fleet, tenant
from tests.support.harness import ServerThread

KEY = "sk-health-" + secrets.token_hex(8)
MODELS_FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "vllm-0.32-models.json"


@contextlib.contextmanager
def gateway(pools: list[dict[str, Any]]) -> Iterator[Fleet]:
    settings = parse_settings({"tenants": [tenant("acme", KEY)], "pools": pools})
    app = create_app(settings, environ={"SPILLGATE_ADMIN_TOKEN": ADMIN_TOKEN})
    with ServerThread(app) as server:
        yield Fleet(gateway=server, backends={}, settings=settings, keys={"acme": KEY})


def backend_states(fleet: Fleet) -> dict[str, tuple[str, str | None]]:
    return {
        b["name"]: (b["state"], b["down_reason"])
        for pool in fleet.status()["pools"]
        for b in pool["backends"]
    }


def state_lines(caplog: pytest.LogCaptureFixture, backend: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "spillgate.backends" and r.getMessage().startswith(f"backend {backend} ")
    ]


def wait_until(check: Any, *, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_dead_backend_is_reported_unavailable_not_full(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    pool = {"name": "p", "backends": [{"url": url, "served_model": "m"}]}
    with gateway([pool]) as fleet, fleet.client() as client:
        response = client.post("/v1/chat/completions", json=chat("hi", model="p"))
        time.sleep(2.5)  # a probe every second while it is down: each finds it dead again
        ready = httpx.get(f"{fleet.url}/readyz", timeout=5)
        status = fleet.status()["pools"][0]
    reason = f"connection refused at {url}"
    assert response.status_code == 503
    assert "retry-after" not in response.headers
    assert response.headers["x-spillgate-outcome"] == "rejected"
    error = response.json()["error"]
    assert error["code"] == "backend_unavailable"
    assert error["message"] == f"No backend of pool 'p' is available: p-0 ({url}): {reason}."
    assert ready.status_code == 503
    assert ready.json()["backends_down"] == {"p-0": reason}
    assert status["state"] == "down" and status["fill_ratio"] is None
    assert status["backends"][0]["state"] == "down"
    assert status["backends"][0]["down_reason"] == reason
    assert status["backends"][0]["healthy"] is False
    assert state_lines(caplog, "p-0") == [f"backend p-0 is down: {reason}"]


def test_a_backend_that_dies_leaves_readiness_at_once_and_returns_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Probes of a live backend come a minute apart here: the failed request alone takes
    it out; once down it is probed every second and comes back on its own."""
    caplog.set_level(logging.INFO)
    sim = SimConfig(model="m", kv_tokens=8192, no_delay=True)
    backend = ServerThread(create_sim_app(sim)).start()
    port = backend.port
    url = f"http://127.0.0.1:{port}"
    pool = {
        "name": "p",
        "capacity_refresh_s": 60,
        "metrics_stale_s": 120,
        "backends": [{"url": url, "served_model": "m"}],
    }
    try:
        with gateway([pool]) as fleet, fleet.client() as client:
            body = chat("hi", model="p", max_tokens=4)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert httpx.get(f"{fleet.url}/readyz", timeout=5).status_code == 200
            backend.stop()
            failed = client.post("/v1/chat/completions", json=body)
            ready = httpx.get(f"{fleet.url}/readyz", timeout=5)
            refused = client.post("/v1/chat/completions", json=body)
            backend = ServerThread(create_sim_app(sim), port=port).start()
            wait_until(lambda: httpx.get(f"{fleet.url}/readyz", timeout=5).status_code == 200)
            served = client.post("/v1/chat/completions", json=body)
    finally:
        backend.stop()
    reason = f"connection refused at {url}"
    # the request that found it dead is told what the next ones are told
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "backend_unavailable"
    assert "retry-after" not in failed.headers
    assert reason in failed.json()["error"]["message"]
    assert ready.status_code == 503 and ready.json()["backends_down"] == {"p-0": reason}
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "backend_unavailable"
    assert served.status_code == 200
    assert state_lines(caplog, "p-0") == [
        f"backend p-0 is down: {reason}",
        f"backend p-0 is up again (was: {reason})",
    ]


def test_a_backend_serving_another_model_keeps_the_pool_out_of_rotation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    sim = SimConfig(model="llama-3-8b", kv_tokens=8192, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        pool = {"name": "p", "backends": [{"url": backend.url, "served_model": "llama3-8b"}]}
        with gateway([pool]) as fleet, fleet.client() as client:
            response = client.post("/v1/chat/completions", json=chat("hi", model="p"))
            ready = httpx.get(f"{fleet.url}/readyz", timeout=5)
            states = backend_states(fleet)
    reason = "it serves 'llama-3-8b', not 'llama3-8b' (check served_model)"
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "backend_unavailable"
    assert reason in response.json()["error"]["message"]
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "not ready",
        "pools_without_capacity": ["p"],
        "backends_down": {"p-0": reason},
    }
    assert states == {"p-0": ("down", reason)}
    assert state_lines(caplog, "p-0") == [f"backend p-0 is down: {reason}"]


def test_a_backend_url_past_the_servers_root_is_down_with_the_404_it_got(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its `/v1/models` answers 404, as every request would: down, saying why, not full."""
    caplog.set_level(logging.INFO)
    sim = SimConfig(model="m", kv_tokens=8192, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        url = f"{backend.url}/openai"
        pool = {"name": "p", "backends": [{"url": url, "served_model": "m"}]}
        with gateway([pool]) as fleet, fleet.client() as client:
            response = client.post("/v1/chat/completions", json=chat("hi", model="p"))
            ready = httpx.get(f"{fleet.url}/readyz", timeout=5)
    reason = (
        f"GET {url}/v1/models answered 404: the url should be the server's root, "
        "where /v1/models is found (without /v1)"
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "backend_unavailable"
    assert response.json()["error"]["message"] == (
        f"No backend of pool 'p' is available: p-0 ({url}): {reason}."
    )
    assert ready.status_code == 503 and ready.json()["backends_down"] == {"p-0": reason}
    assert state_lines(caplog, "p-0") == [f"backend p-0 is down: {reason}"]


def test_the_context_limit_is_the_backends_own_and_models_lists_it() -> None:
    sim = SimConfig(model="m", kv_tokens=8192, max_model_len=2048, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        pools = [
            {"name": "found", "backends": [{"url": backend.url, "served_model": "m"}]},
            {
                "name": "set",
                "max_model_len": 1000,
                "backends": [{"url": backend.url, "served_model": "m"}],
            },
        ]
        with gateway(pools) as fleet, fleet.client() as client:
            models = client.get("/v1/models").json()["data"]
            over = client.post(
                "/v1/chat/completions", json=chat("hi", model="found", max_tokens=2048)
            )
            fits = client.post(
                "/v1/chat/completions", json=chat("hi", model="found", max_tokens=2000)
            )
            over_set = client.post(
                "/v1/chat/completions", json=chat("hi", model="set", max_tokens=1000)
            )
            status = fleet.status()["pools"]
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [
        ("found", "m", 2048),
        ("set", "m", 1000),
    ]
    assert over.status_code == 400 and "retry-after" not in over.headers
    assert over.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in over.json()["error"]["message"]
    assert fits.status_code == 200
    assert over_set.status_code == 400
    assert "maximum context length is 1000 tokens" in over_set.json()["error"]["message"]
    assert [p["max_model_len"] for p in status] == [2048, 1000]
    assert [p["backends"][0]["max_model_len"] for p in status] == [2048, 2048]


def test_the_official_client_sees_the_backends_context_in_models() -> None:
    sim = SimConfig(model="m", kv_tokens=8192, max_model_len=4096, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        pool = {"name": "p", "backends": [{"url": backend.url, "served_model": "m"}]}
        with gateway([pool]) as fleet:
            client = openai.OpenAI(base_url=fleet.url + "/v1", api_key=KEY, max_retries=0)
            model = client.models.list().data[0]
    assert model.id == "p"
    assert model.model_extra == {"root": "m", "parent": None, "max_model_len": 4096}


def test_a_hung_backend_times_out_whole_answers_which_go_elsewhere_until_it_is_ejected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hung backend is tried first (least filled, first listed); each non-streaming
    request waits first_token (0.5 s) for its head, then is served by the other backend.
    The third failure in a row takes the hung one out of rotation."""
    caplog.set_level(logging.INFO)
    faults = FaultBackend()
    sim = SimConfig(model="m", kv_tokens=8192, no_delay=True)
    with ServerThread(faults) as hung, ServerThread(create_sim_app(sim)) as good:
        pool = {
            "name": "p",
            "timeouts": {"first_token": 0.5, "idle": 0.5, "total": 5},
            "backends": [
                {"url": f"{hung.url}/h0", "served_model": "silent", "capacity": 4096},
                {"url": good.url, "served_model": "m", "capacity": 4096},
            ],
        }
        with gateway([pool]) as fleet, fleet.client() as client:
            took = []
            answers = []
            for _ in range(4):
                started = time.monotonic()
                answers.append(client.post("/v1/chat/completions", json=chat("hi", model="p")))
                took.append(time.monotonic() - started)
            states = backend_states(fleet)
    assert [a.status_code for a in answers] == [200, 200, 200, 200]
    assert [a.headers["x-spillgate-outcome"] for a in answers] == ["local"] * 4
    assert faults.arrivals["h0"] == 3  # the fourth went straight to the live backend
    assert all(0.5 <= t < 3.0 for t in took[:3]), took  # first_token, not the 5 s total
    reason = "3 requests in a row failed (last: timeout before the first byte)"
    assert states == {"p-0": ("down", reason), "p-1": ("up", None)}
    assert state_lines(caplog, "p-0") == [f"backend p-0 is down: {reason}"]


def test_the_simulator_lists_its_model_as_vllm_does() -> None:
    real = orjson.loads(MODELS_FIXTURE.read_bytes())["data"][0]  # vLLM 0.32's /v1/models
    sim = SimConfig(model="m", kv_tokens=8192, max_model_len=2048, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        listed = httpx.get(f"{backend.url}/v1/models", timeout=5).json()["data"][0]
    assert listed.keys() == real.keys()
    assert listed["permission"][0].keys() == real["permission"][0].keys()
    assert (listed["id"], listed["root"], listed["max_model_len"]) == ("m", "m", 2048)


def test_probes_and_scrapes_write_no_log_line_each(tmp_path: Path) -> None:
    """Probes every 0.2 s and three scrapes of /metrics in two seconds: the log holds the
    start-up and shutdown lines only."""
    sim = SimConfig(model="m", kv_tokens=8192, no_delay=True)
    with ServerThread(create_sim_app(sim)) as backend:
        config = {
            "tenants": [tenant("acme", KEY)],
            "pools": [
                {
                    "name": "p",
                    "capacity_refresh_s": 0.2,
                    "backends": [{"url": backend.url, "served_model": "m"}],
                }
            ],
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_port(port, timeout=30)
            for _ in range(3):
                scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                assert scrape.status_code == 200
                time.sleep(0.7)
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
    assert [line for line in out.splitlines() if "HTTP" in line or "metrics" in line] == []
    assert "spillgate.backends" not in out  # the backend never changed state


def test_a_whole_answer_whose_body_stalls_is_cut_by_idle_and_served_elsewhere() -> None:
    """The stalling backend sends its head and a first piece at once, then nothing: the
    idle timeout (0.5 s), not the 10 s deadline, ends the wait, and the other backend
    answers, as nothing had reached the client."""
    faults = FaultBackend()
    sim = SimConfig(model="m", kv_tokens=8192, no_delay=True)
    with ServerThread(faults) as stalling, ServerThread(create_sim_app(sim)) as good:
        pool = {
            "name": "p",
            "timeouts": {"first_token": 5, "idle": 0.5, "total": 10},
            "backends": [
                {"url": f"{stalling.url}/st0", "served_model": "stall", "capacity": 4096},
                {"url": good.url, "served_model": "m", "capacity": 4096},
            ],
        }
        with gateway([pool]) as fleet, fleet.client() as client:
            started = time.monotonic()
            answer = client.post("/v1/chat/completions", json=chat("hi", model="p"))
            took = time.monotonic() - started
    assert answer.status_code == 200
    assert answer.json()["object"] == "chat.completion"
    assert faults.arrivals["st0"] == 1
    assert 0.5 <= took < 5.0, took  # idle, not the 10 s deadline


def test_a_queued_request_goes_as_soon_as_its_backend_is_back() -> None:
    """The pool's one backend stops answering (paused) and its probe takes it out of
    rotation; a request queued meanwhile is served at the first probe that finds it back,
    not refused when its wait runs out."""
    with backend_process(model="m", speed=20.0) as (proc, url):
        wait_for_process(proc, url)
        pool = {
            "name": "p",
            "backends": [{"url": url, "served_model": "m"}],
            "overflow": ["queue", "reject"],
            "queue": {"max_wait_s": 10},
            "capacity_refresh_s": 1.0,
        }
        with gateway([pool]) as fleet:
            wait_until(lambda: backend_states(fleet)["p-0"][0] == "up")
            proc.send_signal(signal.SIGSTOP)
            try:
                wait_until(lambda: backend_states(fleet)["p-0"][0] == "down")
                with ThreadPoolExecutor(max_workers=1) as pool_of_one:
                    asked = pool_of_one.submit(
                        httpx.post,
                        f"{fleet.url}/v1/chat/completions",
                        json=chat("hi", model="p"),
                        headers={"authorization": f"Bearer {KEY}"},
                        timeout=30,
                    )
                    time.sleep(0.5)
                    resumed = time.monotonic()
                    proc.send_signal(signal.SIGCONT)
                    response = asked.result()
                    waited = time.monotonic() - resumed
            finally:
                proc.send_signal(signal.SIGCONT)
    assert response.status_code == 200
    assert response.headers["x-spillgate-outcome"] == "queued"
    assert waited < 5  # the next probes, not the queue's 10 s
