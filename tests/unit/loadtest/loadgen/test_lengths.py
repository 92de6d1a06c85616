"""`spillgate loadtest` lets answers end by default; --fixed-lengths runs each to max_tokens."""

import argparse

import orjson
import pytest

from loadtest.loadgen import cli as generator
from loadtest.loadgen.client import RequestShape
from loadtest.loadgen.workload import parse_token_ids

BASE = ["--url", "http://gw", "--model", "m", "--profile", "constant", "--rate", "10",
        "--duration", "1", "--seed", "3"]  # fmt: skip


def plans_of(*extra: str) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser()
    generator.add_arguments(parser)
    _, plans = generator.build_plans(parser.parse_args([*BASE, *extra]))
    shape = RequestShape(model="m")
    return [orjson.loads(shape.body(plan)) for plan in plans]


def test_by_default_every_request_asks_a_generous_max_tokens_with_its_own_seed() -> None:
    bodies = plans_of()
    assert {b["max_tokens"] for b in bodies} == {2048}
    assert [b["seed"] for b in bodies] == [3_000_000 + i for i in range(10)]
    assert not any("ignore_eos" in b or "stop_token_ids" in b for b in bodies)


def test_fixed_lengths_draw_max_tokens_and_send_ignore_eos() -> None:
    bodies = plans_of("--fixed-lengths")
    assert all(b["ignore_eos"] is True and "seed" not in b for b in bodies)
    assert all(32 <= b["max_tokens"] <= 256 for b in bodies)  # type: ignore[operator]
    assert len({b["max_tokens"] for b in bodies}) > 1
    # the prompts do not depend on how lengths are chosen
    assert [b["messages"] for b in bodies] == [b["messages"] for b in plans_of()]


def test_output_tokens_draws_the_caps_and_answers_still_end_by_themselves() -> None:
    bodies = plans_of("--output-tokens", "12", "--stop-token-ids", "8-10,12")
    assert {b["max_tokens"] for b in bodies} == {12}
    assert all(b["stop_token_ids"] == [8, 9, 10, 12] and "ignore_eos" not in b for b in bodies)


def test_token_id_lists_are_parsed_in_order_without_repeats() -> None:
    assert parse_token_ids("8-11, 9,30") == (8, 9, 10, 11, 30)
    with pytest.raises(ValueError):
        parse_token_ids("a-3")
