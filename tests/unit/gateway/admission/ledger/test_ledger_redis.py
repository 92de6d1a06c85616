"""The shared ledger's pure parts: replies, messages, keys, config, wake-ups, the local share."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.admission.fleet.backends import build_pools
from gateway.admission.ledger.calls import Sized, parse_reply
from gateway.admission.ledger.grants import Seen
from gateway.admission.ledger.reservations import LocalLedger
from gateway.admission.ledger.shared import RedisLedger
from gateway.admission.routing.router import Router
from gateway.clock import ManualClock
from gateway.config import ConfigError, hash_key, parse_settings
from gateway.shared.ledger_feed import parse_message
from gateway.workers import WorkerSpec, workers_problem
from loadtest.procs import free_port


def _settings(**extra: object) -> dict[str, object]:
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [
            {"name": "big", "backends": [{"url": "http://127.0.0.1:1", "capacity": 1000}] * 2},
            {"name": "small", "backends": [{"url": "http://127.0.0.1:2", "capacity": 500}]},
        ],
        **extra,
    }


def _unreachable_ledger(**options: object) -> RedisLedger:
    """A ledger whose Redis refuses every connection: nothing listens on the port."""
    client = aioredis.Redis.from_url(
        f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.2, socket_connect_timeout=0.2
    )
    return RedisLedger(client, backends=["b0"], clock=ManualClock(), **options)  # type: ignore[arg-type]


def test_replies_and_messages_parse_into_totals() -> None:
    sized = parse_reply([b"101", 900, 700, 3, 41, 1600, 0, 1])
    assert sized == Sized("101", 900, Seen(700, 3, 41), 1600, restored=False, wanted=True)
    assert parse_reply(["", 0, 0, 0, 0, 0, 1, 0]) == Sized("", 0, Seen(), 0, True, False)
    message = b"r1 300 50 650 2 42 pool a-0 with spaces"
    assert parse_message(message) == ("r1", 300, 50, "pool a-0 with spaces", Seen(650, 2, 42))
    assert parse_message(b"r1 300 not-a-number 0 0 0 b0") is None
    assert parse_message("too short") is None


def test_a_backends_keys_share_one_cluster_slot() -> None:
    ledger = _unreachable_ledger(key_prefix="sg")
    keys = ledger.keys("big-0")
    assert keys == [
        "sg:ledger:{big-0}:leases",
        "sg:ledger:{big-0}:tokens",
        "sg:ledger:{big-0}:usage",
        "sg:ledger:{big-0}:meta",
    ]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert ledger.channel == "sg:ledger:released"


def test_lease_settings_are_validated() -> None:
    settings = parse_settings(_settings())
    assert (settings.ledger.lease_ttl_s, settings.ledger.refresh_s) == (10.0, 0.2)
    with pytest.raises(ConfigError) as info:
        parse_settings(_settings(ledger={"lease_ttl_s": 0.5, "refresh_s": 0.2}))
    assert "at most a third of lease_ttl_s" in str(info.value)
    assert settings.ledger.spare == 0.125
    assert parse_settings(_settings(ledger={"spare": 0})).ledger.spare == 0
    with pytest.raises(ConfigError) as info:
        parse_settings(_settings(ledger={"spare": 0.6}))
    assert "ledger.spare" in str(info.value)


def test_more_than_one_worker_needs_redis() -> None:
    settings = parse_settings(_settings())
    problem = workers_problem(settings, workers=4, redis_url=None)
    assert problem is not None and "--workers 4 needs Redis" in problem
    assert "$SPILLGATE_REDIS_URL" in problem
    assert workers_problem(settings, workers=4, redis_url="redis://r:6379/0") is None
    assert workers_problem(settings, workers=1, redis_url=None) is None
    spec = WorkerSpec(config="/etc/sg.yaml", redis_url="redis://r/0", workers=4)
    assert WorkerSpec.from_env(spec.to_env()) == spec


def test_releases_elsewhere_wake_that_pools_listeners() -> None:
    settings = parse_settings(_settings())
    clock = ManualClock()
    router = Router(build_pools(settings.pools, clock=clock), ledger=LocalLedger(), clock=clock)
    woken: list[str] = []
    router.on_release(woken.append)
    router.released_elsewhere("small-0", 100)
    router.released_elsewhere("unknown-backend", 100)  # another replica's config: ignored
    assert woken == ["small"]
    router.wake_all()
    assert woken == ["small", "big", "small"]


def test_without_redis_each_process_admits_on_its_share() -> None:
    async def scenario() -> None:
        modes: list[str] = []
        errors: list[None] = []
        ledger = _unreachable_ledger(
            fallback_share=3,
            timeout_s=0.5,
            on_mode_change=modes.append,
            on_store_error=lambda: errors.append(None),
        )
        first = await ledger.reserve("b0", 200, limit=900)  # Redis refuses: the share decides
        second = await ledger.reserve("b0", 100, limit=900)
        third = await ledger.reserve("b0", 1, limit=900)  # 301 > 900 / 3
        assert first is not None and second is not None and third is None
        assert modes == ["shared", "local"]
        assert len(errors) == 1  # no call is made while local
        assert ledger.snapshot() == {"b0": (900, 6)}  # own tokens × 3: the fleet, estimated
        await ledger.release(first)
        assert ledger.tokens_in_flight("b0") == 300
        assert await ledger.refresh() is False
        assert ledger.mode == "local"
        await ledger.close()
        assert ledger.sessions("b0") == 0

    asyncio.run(scenario())
