"""`spillgate drill` on a pool with the `batch` step: the spike moves requests that may wait
to the batch tier, and those batches complete once the spike has passed."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from loadtest.sim.config import SimConfig
from tests.integration.loadtest.drill.test_drill import drill
from tests.support.fleet import ADMIN_TOKEN, Fleet, run_fleet


@pytest.fixture
def fleet_with_batch_step(tmp_path: Path) -> Iterator[Fleet]:
    big = [SimConfig(model="big-model", kv_tokens=4096) for _ in range(2)]
    with run_fleet(
        pools={"big": big},
        pool_options={
            "big": {
                "overflow": ["queue", "batch", "reject"],
                "queue": {"max_depth": 4, "max_wait_s": 0.2},
            }
        },
        tenants={"acme": {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000}},
        extra={"batch": {"dir": str(tmp_path / "batch"), "poll_s": 0.1}},
    ) as fleet:
        yield fleet


def test_drill_moves_batchable_work_to_the_batch_tier_and_sees_it_complete(
    fleet_with_batch_step: Fleet, tmp_path: Path
) -> None:
    fleet = fleet_with_batch_step
    config = tmp_path / "drill.yaml"
    config.write_text(yaml.safe_dump({
        "url": fleet.url, "key": fleet.keys["acme"], "admin_token": ADMIN_TOKEN, "model": "big",
        "spike_s": 2.5, "drain_timeout_s": 30,
    }))  # fmt: skip
    done = drill("-c", str(config))
    lines = done.stdout.splitlines()
    engaged = next(line for line in lines if "overflow path 'batch'" in line)
    assert engaged.startswith("PASS  overflow path 'batch' engaged: "), done.stdout
    completed = next(line for line in lines if "batch tier completed" in line)
    assert completed.startswith("PASS  batch tier completed after the spike: "), done.stdout
    accepted = int(engaged.split(": ")[1].split(" of ")[0])
    assert completed.endswith(f": {accepted} of {accepted} batches completed")
    assert any(line.startswith("PASS  overflow path 'queue' engaged") for line in lines)
