"""The `--html` report in a real headless browser: charts drawn, key figures in the DOM."""

import argparse
import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.loadgen import cli as generator
from loadtest.sim.config import SimConfig
from tests.e2e.browser import dump_dom, needs_chromium, png_facts, screenshot
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet

pytestmark = needs_chromium


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    sims = [SimConfig(model="m", kv_tokens=2000, speed=2.0) for _ in range(2)]
    with run_fleet(
        pools={"big": sims}, pool_options={"big": {"target_fill": 0.5, "overflow": ["reject"]}}
    ) as f:
        yield f


@pytest.fixture(scope="module")
def report(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("report")
    parser = argparse.ArgumentParser()
    generator.add_arguments(parser)
    args = parser.parse_args([
        "--url", fleet.url, "--model", "big", "--key", fleet.keys["acme"],
        "--admin-token", ADMIN_TOKEN, "--profile", "spike", "--rate", "10",
        "--spike-factor", "6", "--spike-start", "0.4", "--spike-duration", "0.8",
        "--duration", "2", "--prompt-tokens", "40", "--output-tokens", "uniform:60:120",
        "--sample-interval", "0.1", "--compare-direct", fleet.backends["big"][0].url,
        "--compare-direct", fleet.backends["big"][1].url, "--no-progress",
        "--json", str(out / "run.json"), "--html", str(out / "report.html"),
    ])  # fmt: skip
    assert generator.run(args) == 0
    return out / "report.html", json.loads((out / "run.json").read_text())


def _text(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', dom)
    assert match, f"no element #{element_id}"
    return html.unescape(match.group(1))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"


def test_report_figures_are_in_the_rendered_dom(report: tuple[Path, dict[str, Any]]) -> None:
    page, data = report
    dom = dump_dom(page.as_uri(), budget_ms=500)
    for i, run in enumerate(data["runs"]):
        s = run["summary"]
        assert _text(dom, f"run{i}-requests") == _fmt(s["requests"])
        assert _text(dom, f"run{i}-ttft-p99") == _fmt(s["all"]["ttft_p99_ms"])
        assert _text(dom, f"run{i}-preemptions") == _fmt(s["preemptions"]["total"])
    gateway = data["runs"][0]["summary"]
    assert {"local", "rejected"} <= set(gateway["outcomes"])
    row = re.search(r'id="run0-row-rejected"><td>rejected</td><td>([^<]*)<', dom)
    assert row and row.group(1) == _fmt(gateway["outcomes"]["rejected"]["count"])
    assert 'id="comparison"' in dom
    # gateway: outcomes, TTFT, tokens in flight (its pool has no queue); direct: all four
    assert dom.count("<svg") == 7
    assert "gateway queue depth per pool: nothing reported" in dom
    assert dom.count("<polygon") >= 2  # stacked outcome areas


def test_report_screenshot_is_not_blank(
    report: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    page, _ = report
    shot = tmp_path / "report.png"
    screenshot(page.as_uri(), shot, size=(1600, 2400), budget_ms=500)
    width, height, variety = png_facts(shot)
    assert (width, height) == (1600, 2400)
    assert variety > 50, "the screenshot looks blank"
