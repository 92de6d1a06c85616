"""gateway/README.md's "Contract" names every metric the gateway exposes and every outcome
it answers with, no more: deploy/'s rules and dashboards and the load tools rely on them."""

import re
from pathlib import Path

from gateway.metrics import GatewayMetrics
from gateway.outcome import Outcome

CONTRACT = (Path(__file__).resolve().parents[3] / "gateway" / "README.md").read_text()
CONTRACT = CONTRACT.split("## Contract", 1)[1]


def test_the_contract_lists_every_metric_by_its_exposed_name() -> None:
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in GatewayMetrics().registry.collect()
    }
    rows = [line.split("|")[1] for line in CONTRACT.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`(spillgate_\w+)`", row)}
    assert listed == exposed


def test_the_contract_lists_every_outcome() -> None:
    outcomes = CONTRACT.split("`x-spillgate-outcome`", 1)[1].split("\n- ", 1)[0]
    assert set(re.findall(r"`(\w+)`", outcomes)) - {"outcome"} == {o.value for o in Outcome}
