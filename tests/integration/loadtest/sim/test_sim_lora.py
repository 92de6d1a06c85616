"""A replica with LoRA adapters under uvicorn answers as vLLM 0.32 does: the model list, a
request naming an adapter, the load and unload endpoints, `max_loras` slots and the metric.

The expected bodies are vLLM's own, captured from its CPU build in
tests/fixtures/vllm-0.32-lora.json.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission.fleet.metrics_text import samples
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import LoraLoadFailure, LoraModule, SimConfig
from tests.support.harness import ServerThread
from tests.support.metrics import metrics_text

REAL = json.loads((Path(__file__).parents[3] / "fixtures" / "vllm-0.32-lora.json").read_text())
BASE = "tiny"
MODULES = (LoraModule(name="a1", path="/tmp/lora-a1"), LoraModule(name="a2", path="/tmp/lora-a2"))


def lora_sim(**kw: Any) -> ServerThread:
    options: dict[str, Any] = {
        "model": BASE,
        "kv_tokens": 4096,
        "max_model_len": 2048,
        "speed": 200.0,
        "enable_lora": True,
        "lora_modules": MODULES,
        "max_loras": 2,
        "max_lora_rank": 8,
        "allow_runtime_lora_updating": True,
        "lora_load_s": 0.0,
        **kw,
    }
    return ServerThread(create_sim_app(SimConfig(**options)))


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with lora_sim() as server:
        yield server.url


def chat(client: httpx.Client, url: str, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], **kw}
    return client.post(f"{url}/v1/chat/completions", json={"max_tokens": 2, **body})


def without_times(models: dict[str, Any]) -> list[dict[str, Any]]:
    """The cards as compared: what differs between two servers (times, ids) left out."""
    return [
        {k: v for k, v in card.items() if k not in ("created", "permission")}
        for card in models["data"]
    ]


def lora_info(url: str) -> list[tuple[dict[str, str], float]]:
    found = [
        (sample.labels, sample.value)
        for sample in samples(metrics_text(url))
        if sample.name == "vllm:lora_requests_info"
    ]
    return sorted(found, key=lambda pair: pair[1])


def test_the_model_list_shows_each_adapter_with_its_parent_and_path(sim: str) -> None:
    listed = httpx.get(f"{sim}/v1/models").json()
    real = json.loads(REAL["models"]["body"])
    ours, theirs = without_times(listed), without_times(real)
    assert [card["id"] for card in ours] == ["tiny", "a1", "a2"]
    assert [set(card) for card in ours] == [set(card) for card in theirs]
    # the base model's root is its directory on the real server, its name here
    assert ours[1:] == theirs[1:]
    assert listed["data"][1]["permission"][0].keys() == real["data"][1]["permission"][0].keys()


def test_a_request_naming_an_adapter_is_answered_under_its_name(sim: str) -> None:
    with httpx.Client(timeout=10) as client:
        answer = chat(client, sim, "a1")
        text = client.post(f"{sim}/v1/completions", json={"model": "a2", "prompt": "hi"})
        streamed = chat(client, sim, "a1", stream=True)
        body = {"model": "a2", "input": "hi", "max_output_tokens": 2}
        response = client.post(f"{sim}/v1/responses", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == "a1"
    assert response.json()["model"] == "a2"
    assert json.loads(REAL["chat_a1"]["body"])["model"] == "a1"
    assert text.json()["model"] == "a2"
    assert '"model":"a1"' in streamed.text


def test_an_unknown_model_is_vllms_404(sim: str) -> None:
    with httpx.Client(timeout=10) as client:
        answer = chat(client, sim, "nosuch")
    assert answer.status_code == REAL["chat_unknown"]["status"] == 404
    assert answer.json() == json.loads(REAL["chat_unknown"]["body"])


def test_load_and_unload_answer_with_vllms_codes_and_bodies() -> None:
    sent = {
        "load_a3": ("load", {"lora_name": "a3", "lora_path": "/tmp/lora-a3"}),
        "load_a3_again": ("load", {"lora_name": "a3", "lora_path": "/tmp/lora-a3"}),
        "load_base_name": ("load", {"lora_name": BASE, "lora_path": "/tmp/lora-a3"}),
        "load_no_path": ("load", {"lora_name": "a6"}),
        "load_empty_path": ("load", {"lora_name": "a6", "lora_path": ""}),
        "unload_a3": ("unload", {"lora_name": "a3"}),
        "unload_a3_again": ("unload", {"lora_name": "a3"}),
        "unload_no_name": ("unload", {}),
    }
    with lora_sim() as server, httpx.Client(base_url=server.url, timeout=10) as client:
        answers = {}
        for key, (verb, body) in sent.items():
            answers[key] = client.post(f"/v1/{verb}_lora_adapter", json=body)
            if key == "load_empty_path":
                listed = [card["id"] for card in client.get("/v1/models").json()["data"]]
                served = chat(client, server.url, "a3")
        gone = chat(client, server.url, "a3")
    for key, answer in answers.items():
        real = REAL[key]
        assert answer.status_code == real["status"], key
        assert answer.text == real["body"], key
        assert answer.headers.get("content-type") == real["content_type"], key
    assert listed == ["tiny", "a1", "a2", "a3"]
    assert served.json()["model"] == "a3"
    assert gone.status_code == 404
    assert gone.json() == json.loads(REAL["chat_a3_after_unload"]["body"])


@pytest.mark.parametrize(
    ("failure", "path", "real"),
    [
        (LoraLoadFailure.NOT_FOUND, "/tmp/lora-nope", "load_missing_path"),
        (LoraLoadFailure.ERROR, "/tmp/lora-r16", "load_rank_16"),
    ],
)
def test_a_replica_told_to_fail_loads_fails_each_as_vllm_does(
    failure: LoraLoadFailure, path: str, real: str
) -> None:
    name = "a4" if failure is LoraLoadFailure.NOT_FOUND else "a5"
    with lora_sim(fail_lora_loads=failure) as server, httpx.Client(timeout=10) as client:
        body = {"lora_name": name, "lora_path": path}
        answer = client.post(f"{server.url}/v1/load_lora_adapter", json=body)
        listed = client.get(f"{server.url}/v1/models").json()["data"]
    assert [card["id"] for card in listed] == ["tiny", "a1", "a2"]
    assert answer.status_code == REAL[real]["status"]
    assert answer.text == REAL[real]["body"]


@pytest.mark.parametrize(
    ("names", "statuses", "least_s"),
    [
        # the second waits on the name's lock, then finds it taken without loading
        (("a3", "a3"), [200, 400], 0.3),
        # the engine core loads one adapter at a time
        (("a3", "a4"), [200, 200], 0.6),
    ],
)
def test_a_load_takes_its_time_and_a_second_waits_for_it(
    names: tuple[str, str], statuses: list[int], least_s: float
) -> None:
    with lora_sim(lora_load_s=0.3) as server, httpx.Client(timeout=10) as client:
        answers: list[httpx.Response] = []

        def load(name: str) -> None:
            body = {"lora_name": name, "lora_path": f"/tmp/lora-{name}"}
            answers.append(client.post(f"{server.url}/v1/load_lora_adapter", json=body))

        started = time.monotonic()
        threads = [threading.Thread(target=load, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        took = time.monotonic() - started
    assert sorted(a.status_code for a in answers) == statuses
    assert least_s <= took < least_s + 0.3


def generated(url: str) -> float:
    found = samples(metrics_text(url))
    return next(s.value for s in found if s.name == "vllm:generation_tokens_total")


def test_the_requests_in_flight_stall_while_a_load_runs() -> None:
    # real time: a decode step of the built-in 8B takes about 8 ms
    with lora_sim(speed=1.0, lora_load_s=0.4) as server, httpx.Client(timeout=30) as client:
        url = server.url
        body = {"model": "a1", "prompt": "x", "max_tokens": 150, "ignore_eos": True}
        running = threading.Thread(
            target=client.post, args=(f"{url}/v1/completions",), kwargs={"json": body}
        )
        running.start()
        until(lambda: generated(url) > 0)

        def tokens_in(seconds: float) -> float:
            before = generated(url)
            time.sleep(seconds)
            return generated(url) - before

        unloaded = tokens_in(0.15)
        load = {"lora_name": "a3", "lora_path": "/tmp/lora-a3"}
        loading = threading.Thread(
            target=client.post, args=(f"{url}/v1/load_lora_adapter",), kwargs={"json": load}
        )
        loading.start()
        time.sleep(0.1)  # the load has begun
        during = tokens_in(0.15)  # and has not ended
        loading.join()
        running.join()
    assert unloaded >= 10  # about 18 tokens in 0.15 s
    assert during == 0


def test_runtime_loading_is_absent_unless_allowed() -> None:
    with lora_sim(allow_runtime_lora_updating=False) as server, httpx.Client() as client:
        body = {"lora_name": "a3", "lora_path": "/tmp/lora-a3"}
        answer = client.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert answer.status_code == 404


def lora_lines(url: str) -> list[str]:
    return [line for line in metrics_text(url).splitlines() if "lora_requests_info" in line]


def test_the_metric_has_no_series_until_a_step_then_one_per_set_of_adapters() -> None:
    with lora_sim() as server, httpx.Client(timeout=10) as client:
        before = lora_lines(server.url)
        chat(client, server.url, BASE)
        after_base = lora_lines(server.url)
        chat(client, server.url, "a1")
        after_a1 = lora_lines(server.url)
    assert before == REAL["metrics_before_any_request"][-2:]  # HELP and TYPE only

    def series(lines: list[str]) -> list[str]:
        """The series' names and labels, their values (times) left out."""
        return sorted(line.rsplit(" ", 1)[0] for line in lines if line.startswith("vllm:lora"))

    assert series(after_base) == series(REAL["metrics_after_base"])
    assert series(after_a1) == series(REAL["metrics_after_a1"])


def newest(url: str) -> tuple[str, float]:
    """The adapters the newest lora_requests_info series names, and the requests waiting."""
    found = samples(metrics_text(url))
    info = max(
        (s for s in found if s.name == "vllm:lora_requests_info"),
        key=lambda s: s.value,
        default=None,
    )
    waiting = next(s.value for s in found if s.name == "vllm:num_requests_waiting")
    return ("-" if info is None else info.labels["running_lora_adapters"]), waiting


def until(done: Callable[[], bool], *, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def newest_once_waiting(url: str, *, within_s: float = 10.0) -> tuple[str, float]:
    """`newest` from the first scrape that finds a request waiting."""
    deadline = time.monotonic() + within_s
    while (found := newest(url))[1] < 1.0:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return found


def test_a_third_adapter_waits_for_a_slot_unseen_by_the_metric_as_in_vllm() -> None:
    # real time, so that a1 and a2 still run when a3 arrives
    with lora_sim(speed=1.0) as server, httpx.Client(timeout=30) as client:
        url = server.url
        loaded = client.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/tmp/lora-a3"}
        )
        assert loaded.status_code == 200
        answered: list[str] = []

        def run(model: str, tokens: int) -> None:
            body = {"model": model, "prompt": "x", "max_tokens": tokens, "ignore_eos": True}
            answered.append(client.post(f"{url}/v1/completions", json=body).json()["model"])

        threads = [threading.Thread(target=run, args=(m, 150)) for m in ("a1", "a2")]
        for thread in threads:
            thread.start()
        # in the order they began: the two threads race to it
        both = ("a1,a2", "a2,a1")
        until(lambda: newest(url)[0] in both)
        threads.append(threading.Thread(target=run, args=("a3", 2)))
        threads[-1].start()
        waited = newest_once_waiting(url)
        for thread in threads:
            thread.join()
        idle = newest(url)
        seen = [labels["running_lora_adapters"] for labels, _ in lora_info(url)]
    # waiting, a3 is in no label: vLLM's front-end hears of a request with its first token
    assert waited[0] in both and waited[1] == 1.0
    assert sorted(answered) == ["a1", "a2", "a3"]
    assert not any(names.count(",") > 1 for names in seen)  # never three at once
    assert any("a3" in names for names in seen)
    assert idle == ("", 0.0)  # idle: the newest series names no adapter
