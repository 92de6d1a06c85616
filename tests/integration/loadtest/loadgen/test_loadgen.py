"""`spillgate loadtest` against real servers on loopback: timings, outcomes, samples, reports."""

import argparse
import json
import re
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from loadtest.loadgen import cli as generator
from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet
from tests.support.harness import ServerThread

# an x-axis tick label of a report's chart (its plot area ends 48 px above the bottom)
X_TICKS = re.compile(r'<text x="([\d.]+)" y="288" text-anchor="middle">([^<]*)</text>')


def loadtest(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    generator.add_arguments(parser)
    return generator.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def sim() -> Iterator[ServerThread]:
    config = SimConfig(model="m", kv_tokens=200_000, speed=20.0, max_num_seqs=1024)
    with ServerThread(create_sim_app(config)) as server:
        yield server


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streams_and_plain_requests_are_timed_against_a_backend(
    sim: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str], endpoint: str
) -> None:
    out = tmp_path / "run.json"
    rc = loadtest([
        "--url", sim.url, "--model", "m", "--profile", "constant", "--rate", "40",
        "--duration", "1", "--stream-fraction", "0.5", "--prompt-tokens", "50",
        "--output-tokens", "12", "--backend", sim.url, "--sample-interval", "0.2",
        "--endpoint", endpoint, "--json", str(out), "--no-progress",
        # a send 20 ms late (the default tolerance) is one busy moment of a shared 2-core host
        "--lag-tolerance-ms", "100",
    ])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    run = data["runs"][0]
    requests = run["requests"]
    assert len(requests) == 40
    assert {r["status"] for r in requests} == {200}
    assert {r["outcome"] for r in requests} == {"served"}  # no gateway, no outcome header
    assert all(r["completion_tokens"] == 12 for r in requests)
    if endpoint == "chat":  # a completion prompt has no chat template tokens around it
        assert all(r["prompt_tokens"] == 50 for r in requests)
    streams = [r for r in requests if r["stream"]]
    plain = [r for r in requests if not r["stream"]]
    assert streams and plain
    assert all(r["ttft_s"] > 0 and r["itl_s"] is not None for r in streams)
    assert all(r["ttft_s"] <= r["e2e_s"] for r in requests)
    assert all(r["itl_s"] is None for r in plain)
    summary = run["summary"]
    assert summary["lag"]["kept_schedule"], summary["lag"]
    assert summary["preemptions"]["total"] == 0
    # every prompt differs from its first block on: looked up, never found
    cache = summary["prefix_cache"]
    assert cache["hit_rate"] == 0.0 and cache["hits"] == 0 and cache["queries"] > 0
    assert run["sampled"] == "backends" and run["samples"]
    assert run["samples"][0]["backends"][sim.url]["capacity"] == 200_000
    printed = capsys.readouterr()
    assert "served" in printed.out and "kept its schedule" in printed.out
    assert printed.err == f"wrote {out}\n"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sims = [SimConfig(model="m", kv_tokens=2000, speed=2.0) for _ in range(2)]
    with run_fleet(
        pools={"big": sims},
        # the limits stay at the target fill (the report draws one line for both), so no
        # back-off: a slow machine can leave requests waiting inside the simulators
        pool_options={"big": {"target_fill": 0.5, "overflow": ["reject"], "feedback": False}},
        tenants={
            "acme": {"requests_per_minute": 100_000},
            "beta": {"requests_per_minute": 100_000},
        },
    ) as f:
        yield f


def _gateway_run(fleet: Fleet, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "run.json"
    rc = loadtest([
        "--url", fleet.url, "--model", "big", "--key", f"acme={fleet.keys['acme']}",
        "--key", f"beta={fleet.keys['beta']}", "--admin-token", ADMIN_TOKEN,
        "--profile", "spike", "--rate", "10", "--spike-factor", "6", "--spike-start", "0.3",
        "--spike-duration", "0.7", "--duration", "1.5", "--prompt-tokens", "40",
        "--output-tokens", "uniform:60:120", "--sample-interval", "0.1", "--json", str(out),
        "--no-progress", *extra,
    ])  # fmt: skip
    assert rc == 0
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_a_spike_through_the_gateway_records_outcomes_and_fleet_samples(
    fleet: Fleet, tmp_path: Path
) -> None:
    run = _gateway_run(fleet, tmp_path)["runs"][0]
    requests = run["requests"]
    outcomes = {r["outcome"] for r in requests}
    assert outcomes == {"local", "rejected"}
    assert {r["tenant"] for r in requests} == {"acme", "beta"}
    refused = [r for r in requests if r["status"] == 503]
    assert refused and all(int(r["retry_after"]) >= 1 for r in refused)
    assert run["sampled"] == "gateway"
    peaks = run["summary"]["peak_fill"]
    assert set(peaks) == {"big-0", "big-1"}
    # 125 blocks of 16, one kept back: 1,984 tokens, 992 at the 0.5 target fill
    assert all(0 < p["in_flight"] <= p["limit"] == 992 for p in peaks.values()), peaks
    assert "big" in run["samples"][-1]["queue_depth"] or run["samples"][-1]["queue_depth"] == {}
    assert set(run["summary"]["preemptions"]["per_backend"]) == {
        s.url for s in fleet.backends["big"]
    }


def test_a_shared_prefix_workload_reports_the_backends_prefix_cache_hits(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    html = tmp_path / "report.html"
    data = _gateway_run(
        fleet, tmp_path, "--shared-prefix-tokens", "256", "--turns", "3", "--html", str(html)
    )
    requests = data["runs"][0]["requests"]
    assert all(r["prompt_tokens"] >= 256 + 40 for r in requests)
    cache = data["runs"][0]["summary"]["prefix_cache"]
    assert set(cache["per_backend"]) == {s.url for s in fleet.backends["big"]}
    # each tenant's 256-token system prompt (and its chats so far) found cached after its
    # first sight on a backend
    assert cache["hit_rate"] > 0.3, cache
    assert cache["hits"] > 0 and data["config"]["shared_prefix_tokens"] == 256
    printed = capsys.readouterr().out
    percent = f"{cache['hit_rate'] * 100:.1f}"
    assert f"backend prefix cache during the run: hit rate {percent} %" in printed
    assert f'id="run0-prefix-hit">{percent}</div>' in html.read_text()


def test_compare_direct_replays_the_schedule_at_the_backends(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    html = tmp_path / "report.html"
    data = _gateway_run(fleet, tmp_path, "--compare-direct", "auto", "--html", str(html))
    gateway, direct = (r["summary"] for r in data["runs"])
    assert gateway["requests"] == direct["requests"]
    assert [r["at_s"] for r in data["runs"][0]["requests"]] == [
        r["at_s"] for r in data["runs"][1]["requests"]
    ]
    assert direct["outcomes"].keys() == {"served"}  # nothing is refused without a gateway
    assert direct["preemptions"]["total"] is not None
    assert data["runs"][1]["sampled"] == "backends"
    assert data["runs"][1]["summary"]["urls"] == [s.url for s in fleet.backends["big"]]
    captured = capsys.readouterr()
    assert captured.err == f"wrote {tmp_path / 'run.json'}\nwrote {html}\n"
    printed = captured.out
    table = printed[printed.rindex("gateway  ") - 30 :]
    assert "TTFT p99 ms" in table and "preemptions" in table
    page = html.read_text()
    assert 'id="comparison"' in page and "<script" not in page
    # prose and tables, not Python's reprs of dicts, lists and None
    text = " ".join(unescape(re.sub(r"<[^>]+>", " ", page)).split())
    for repr_mark in ("{'", "['", "[]", "{}", "None"):
        assert repr_mark not in text, repr_mark
    assert "compared straight at auto" in text and "Answers: " in text
    # every chart of the report runs on one time axis: the same ticks at the same pixels
    axes = [X_TICKS.findall(svg) for svg in page.split("<svg")[1:]]
    assert len(axes) >= 7 and all(axis == axes[0] for axis in axes), axes
    assert axes[0][0][1] == "0"
    # both backends' limits (1000 tokens), and their capacities, coincide: one line each
    assert page.count(">limit of both</text>") == page.count(">capacity of both</text>") == 1
    assert "its limit" not in page and "its capacity" not in page


def test_a_run_that_mostly_fails_exits_non_zero_and_shows_the_first_error(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    rc = loadtest([
        "--url", fleet.url, "--model", "big", "--key", "sk-not-a-tenant", "--profile",
        "constant", "--rate", "20", "--duration", "0.5", "--prompt-tokens", "20",
        "--output-tokens", "8", "--json", str(out), "--no-progress",
    ])  # fmt: skip
    assert rc == 1
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert (summary["requests"], summary["failed"], summary["statuses"]) == (10, 10, {"401": 10})
    said = "HTTP 401: Incorrect API key provided."
    assert summary["first_error"] == {"index": 0, "at_s": 0.025, "status": 401, "error": said}
    printed = capsys.readouterr()
    line = f"10 of 10 requests failed; the first, at 0.025 s: {said}"
    assert line in printed.out.splitlines()
    assert printed.err.splitlines() == [f"wrote {out}", f"spillgate loadtest: gateway: {line}"]


def test_refusals_are_not_failures_and_a_few_failures_do_not_fail_the_run(
    fleet: Fleet, tmp_path: Path
) -> None:
    # one tenant's key is wrong: a quarter of the requests fail, the run still exits 0
    out = tmp_path / "run.json"
    rc = loadtest([
        "--url", fleet.url, "--model", "big", "--key", f"acme={fleet.keys['acme']}",
        "--key", f"beta={fleet.keys['beta']}", "--key", f"gamma={fleet.keys['acme']}",
        "--key", "nobody=sk-not-a-tenant", "--profile", "constant", "--rate", "20",
        "--duration", "0.4", "--prompt-tokens", "20", "--output-tokens", "8",
        "--json", str(out), "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    failed = summary["outcomes"]["error"]["count"]
    assert summary["failed"] == failed and 0 < failed < summary["requests"] / 2


ENGINE_KEYS = {"samples", "interval_s", "running_max", "running_p50", "waiting_max",
               "kv_usage_peak", "kv_tokens_peak", "reserved_tokens_peak",
               "kv_used_per_reserved", "preemptions", "per_backend"}  # fmt: skip


@pytest.fixture(scope="module")
def realistic() -> Iterator[Fleet]:
    # answers end at a sampled EOS (geometric, mean 256); 2,048 asked of each
    sims = [
        SimConfig(model="m", kv_tokens=16_384, max_model_len=4096, speed=10.0,
                  answer_lengths="geometric")
        for _ in range(2)
    ]  # fmt: skip
    with run_fleet(
        pools={"big": sims},
        pool_options={"big": {"target_fill": 0.9, "overflow": ["queue", "reject"]}},
        tenants={"acme": {"requests_per_minute": 100_000}},
    ) as f:
        yield f


def test_compare_direct_shows_running_concurrency_and_kv_use_side_by_side(
    realistic: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, html = tmp_path / "run.json", tmp_path / "report.html"
    rc = loadtest([
        "--url", realistic.url, "--model", "big", "--key", f"acme={realistic.keys['acme']}",
        "--admin-token", ADMIN_TOKEN, "--compare-direct", "auto", "--profile", "constant",
        "--rate", "24", "--duration", "1", "--prompt-tokens", "100", "--sample-interval", "0.2",
        "--json", str(out), "--html", str(html), "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["max_tokens"] == 2048 and data["config"]["fixed_lengths"] is False
    gateway, direct = data["runs"]
    urls = [s.url for s in realistic.backends["big"]]
    for run in (gateway, direct):
        engine = run["summary"]["engine"]
        assert engine.keys() == ENGINE_KEYS
        assert engine["per_backend"].keys() == set(urls)
        assert all(
            b.keys() == {"running_max", "running_p50", "kv_usage_peak"}
            for b in engine["per_backend"].values()
        )
        assert engine["samples"] >= 3 and engine["interval_s"] == 0.2
        assert engine["running_max"] >= 1 and engine["running_p50"] is not None
        assert 0 < engine["kv_usage_peak"] <= 1
        assert engine["preemptions"] == 0
        over_time = run["engine_series"]
        assert over_time.keys() == {"t", "running", "kv_usage"}
        assert max(over_time["running"]) == engine["running_max"]
        assert len(over_time["t"]) == len(over_time["kv_usage"]) == engine["samples"]
    # what the gateway reserved is known of the run through it only
    ratio = gateway["summary"]["engine"]["kv_used_per_reserved"]
    assert ratio is not None and ratio > 0
    assert direct["summary"]["engine"]["kv_used_per_reserved"] is None
    # seeded requests end at the same token, whichever way they went
    lengths = [[r["completion_tokens"] for r in run["requests"]] for run in data["runs"]]
    assert lengths[0] == lengths[1]
    assert all(0 < n < 2048 for n in lengths[0]) and len(set(lengths[0])) > 5
    printed = capsys.readouterr().out
    table = printed[printed.rindex("gateway  ") - 30 :]
    for row in ("running max", "running p50", "KV use peak %", "KV used / reserved"):
        assert row in table
    assert printed.count("backend engines during the run: running max") == 2
    page = html.read_text()
    assert 'id="run0-running-max"' in page and 'id="run1-kv-peak"' in page
    assert ">running max</td>" in page and ">KV use peak %</td>" in page


def test_fixed_lengths_run_every_answer_to_its_max_tokens(realistic: Fleet, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    rc = loadtest([
        "--url", realistic.url, "--model", "big", "--key", f"acme={realistic.keys['acme']}",
        "--profile", "constant", "--rate", "20", "--duration", "0.5", "--prompt-tokens", "40",
        "--fixed-lengths", "--json", str(out), "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    requests = json.loads(out.read_text())["runs"][0]["requests"]
    assert len(requests) == 10 and {r["status"] for r in requests} == {200}
    assert all(r["completion_tokens"] == r["max_tokens"] for r in requests)
    assert len({r["max_tokens"] for r in requests}) > 1
