"""The adapter table, the LoRA options and what the events and the metric say of adapters."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadtest.sim.cli import add_arguments, sim_config
from loadtest.sim.config import Adapter, LoraLoadFailure, LoraModule, SimConfig
from loadtest.sim.kv_events import EventLog
from loadtest.sim.lora import Adapters
from loadtest.sim.metrics import LoraInfo
from loadtest.sim.protocol import SimRequestError
from loadtest.sim.scheduler import Scheduler, SchedulerLimits, Sequence

REAL = json.loads((Path(__file__).parents[3] / "fixtures" / "vllm-0.32-lora.json").read_text())
A1 = LoraModule(name="a1", path="/loras/a1")
A2 = LoraModule(name="a2", path="/loras/a2")


def table(*, runtime: bool = True) -> Adapters:
    return Adapters(base_model="base", modules=(A1, A2), runtime_updating=runtime)


def test_adapters_take_ids_in_load_order_from_one() -> None:
    adapters = table()
    assert [(a.name, a.lora_id) for a in adapters] == [("a1", 1), ("a2", 2)]
    assert adapters.resolve("a2") == Adapter(name="a2", path="/loras/a2", lora_id=2)
    added = adapters.add("a3", "/loras/a3")
    assert added.lora_id == 3


def test_ids_go_as_on_the_real_server_a_lookup_and_a_failed_load_take_one_each() -> None:
    adapters = table()
    adapters.resolve("nosuch")  # a 404, yet the resolver took an id
    a3 = adapters.add("a3", "/tmp/lora-a3")
    adapters.next_id("a4")  # a load that fails after taking its id
    a5 = adapters.add("a5", "/tmp/lora-a3")
    ids = {event["lora_name"]: event["lora_id"] for event in REAL["kv_events"]["stored"]}
    assert ids == {"a1": 1, None: None, "a3": a3.lora_id, "a5": a5.lora_id} == {
        "a1": 1, None: None, "a3": 4, "a5": 6
    }  # fmt: skip


def test_a_request_for_no_adapter_takes_an_id_only_where_runtime_loading_is_on() -> None:
    # vLLM's resolver lookup takes the next id before it finds nothing
    with_runtime, without = table(), table(runtime=False)
    for adapters in (with_runtime, without):
        assert adapters.resolve("nosuch") is None
    assert with_runtime.add("a3", "/p").lora_id == 4
    assert without.add("a3", "/p").lora_id == 3


def test_a_load_in_place_keeps_the_adapters_id() -> None:
    adapters = table()
    adapters.check_load("a1", "/loras/a1-v2", in_place=True)
    assert adapters.next_id("a1") == 1
    assert adapters.add("a1", "/loras/a1-v2", 1).path == "/loras/a1-v2"


@pytest.mark.parametrize(
    ("name", "path", "message"),
    [
        ("a1", "/p", "The lora adapter 'a1' has already been loaded. If you want to load the "
         "adapter in place, set 'load_inplace' to True."),
        ("base", "/p", "The lora adapter 'base' conflicts with a served base model."),
        ("a3", "", "Both 'lora_name' and 'lora_path' must be provided."),
    ],
)  # fmt: skip
def test_vllms_refusals_of_a_load(name: str, path: str, message: str) -> None:
    with pytest.raises(SimRequestError) as refused:
        table().check_load(name, path, in_place=False)
    assert (refused.value.status, refused.value.error_type) == (400, "InvalidUserInput")
    assert refused.value.message == message


def test_unloading_forgets_the_name_and_a_second_unload_is_a_404() -> None:
    adapters = table()
    adapters.remove("a1")
    assert adapters.resolve("a1") is None and [a.name for a in adapters] == ["a2"]
    with pytest.raises(SimRequestError) as refused:
        adapters.remove("a1")
    assert refused.value.status == 404
    assert refused.value.message == "The lora adapter 'a1' cannot be found."


@pytest.mark.parametrize(
    ("text", "module"),
    [
        ("a1=/loras/a1", LoraModule(name="a1", path="/loras/a1")),
        ("a1", LoraModule(name="a1", path="a1")),
        ('{"name": "a1", "path": "/loras/a1"}', LoraModule(name="a1", path="/loras/a1")),
    ],
)
def test_lora_modules_are_read_as_vllm_writes_them_or_as_a_bare_name(
    text: str, module: LoraModule
) -> None:
    assert LoraModule.parse(text) == module


def parse(*flags: str) -> SimConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return sim_config(parser.parse_args(list(flags)))


def test_the_lora_options_mirror_vllms_with_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    config = parse("--enable-lora", "--lora-modules", "a1=/loras/a1", "a2")
    assert config.lora_modules == (A1, LoraModule(name="a2", path="a2"))
    assert (config.max_loras, config.max_lora_rank) == (1, 16)
    assert not config.allow_runtime_lora_updating and config.fail_lora_loads is None
    assert parse("--enable-lora", "--allow-runtime-lora").allow_runtime_lora_updating
    failing = parse("--enable-lora", "--fail-lora-loads", "not-found", "--max-loras", "4")
    assert failing.fail_lora_loads is LoraLoadFailure.NOT_FOUND and failing.max_loras == 4


def test_vllms_environment_variable_allows_runtime_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert parse("--enable-lora").allow_runtime_lora_updating
    assert not parse().allow_runtime_lora_updating  # set for the host, LoRA off here


@pytest.mark.parametrize(
    "options",
    [
        {"lora_modules": (A1,)},  # without enable_lora
        {"enable_lora": True, "max_loras": 0},
        {"enable_lora": True, "max_lora_rank": 12},  # not a rank vLLM accepts
        {"enable_lora": True, "lora_modules": (A1, A1)},
        {"enable_lora": True, "lora_modules": (LoraModule(name="sim-model", path="/p"),)},
    ],
)
def test_lora_settings_vllm_would_refuse_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**options)  # type: ignore[arg-type]


def test_an_adapters_stored_blocks_carry_its_id_and_name_as_vllms_events_do() -> None:
    log = EventLog(block_size=4)
    adapter = Adapter(name="a1", path="/loras/a1", lora_id=3)
    log.stored([11, 12], None, list(range(8)), adapter)
    log.stored([13], None, list(range(4)), None)
    lora, base = log.pending
    assert (lora["lora_id"], lora["lora_name"], lora["extra_keys"]) == (3, "a1", [["a1"]] * 2)
    assert (base["lora_id"], base["lora_name"], base["extra_keys"]) == (None, None, [None])
    real = REAL["kv_events"]["stored"][0]  # a1's five blocks on the real server
    assert real["lora_name"] == "a1" and real["extra_keys"] == [["a1"]] * 5
    assert set(lora) == set(real) - {"n_token_ids"} | {"token_ids"}


def test_the_lora_metric_keeps_a_series_per_set_of_active_adapters() -> None:
    scheduler: Scheduler[Sequence] = Scheduler(SchedulerLimits(num_blocks=9, max_loras=2))
    ticks = iter(range(1, 10))
    info = LoraInfo(scheduler=scheduler, max_loras=2, clock=lambda: float(next(ticks)))
    (empty,) = info.collect()
    assert empty.samples == []  # HELP and TYPE only, until a step
    for active in ({"a2": 1}, {"a2": 1, "a1": 2}, {}, {"a2": 1}):
        scheduler.active_adapters.clear()
        scheduler.active_adapters.update(active)
        info.observe_step()
    (family,) = info.collect()
    assert [(s.labels["running_lora_adapters"], s.value) for s in family.samples] == [
        ("a2", 4.0),  # the newest time: a set seen again keeps its series
        ("a2,a1", 2.0),
        ("", 3.0),
    ]
    assert all(s.labels["waiting_lora_adapters"] == s.labels["running_lora_adapters"]
               for s in family.samples)  # fmt: skip
    assert {s.labels["max_lora"] for s in family.samples} == {"2"}
