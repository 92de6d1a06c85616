"""The config model's validation: every problem at once, each with its key path, and a
"did you mean" where a name looks misspelt."""

from pathlib import Path
from typing import Any, get_args

import pytest

from gateway.config import ConfigError, PolicyName, hash_key, load_settings, parse_settings
from gateway.config.environment import check_environment, redis_url_problem
from gateway.config.problems import Problem
from policies.registry import registry

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"


def _minimal(**pool: object) -> dict[str, Any]:
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [{"name": "big", "backends": [{"url": "http://127.0.0.1:1"}], **pool}],
    }


def _problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(data, source="gw.yaml")
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def test_minimal_config_gets_sane_defaults() -> None:
    settings = parse_settings(_minimal())
    pool = settings.pools[0]
    assert pool.overflow == ["reject"]
    assert pool.backends[0].capacity == "auto"
    assert 0 < pool.target_fill <= 1


def test_every_error_is_reported_at_once_with_its_key_path() -> None:
    data = _minimal(target_fill=1.5, degrade_to="nowhere")
    data["tenants"] = [{"name": "acme"}, {"name": "b", "key_sha256": "xyz"}]
    assert _problems(data) == [
        "gw.yaml: tenants[0]: give exactly one of key_sha256 or key_env",
        "gw.yaml: tenants[1].key_sha256: should be 64 lowercase hex digits: the key's SHA-256",
        "gw.yaml: pools[0].target_fill: should be less than or equal to 1, not 1.5",
        "gw.yaml: pools[0].degrade_to: no pool named 'nowhere'",
    ]


def test_a_misspelt_policy_is_refused_with_the_name_it_resembles() -> None:
    assert _problems(_minimal(overflow=["queue", "degrad"])) == [
        "gw.yaml: pools[0].overflow[1]: unknown overflow policy 'degrad'; did you mean 'degrade'?"
    ]
    assert _problems(_minimal(overflow=["spill"])) == [
        "gw.yaml: pools[0].overflow[0]: unknown overflow policy 'spill' "
        "(known: queue, degrade, provider, cache, batch, reject)"
    ]


def test_the_config_accepts_exactly_the_policies_the_registry_builds() -> None:
    assert set(get_args(PolicyName)) == set(registry())


def test_a_misspelt_key_is_refused_with_the_key_it_resembles() -> None:
    assert _problems(_minimal(targetfill=0.5)) == [
        "gw.yaml: pools[0].targetfill: unknown key 'targetfill'; did you mean 'target_fill'?"
    ]
    data = _minimal()
    data["server"] = {"prot": 8080, "zzz": 1}
    assert _problems(data) == [
        "gw.yaml: server.prot: unknown key 'prot'; did you mean 'port'?",
        "gw.yaml: server.zzz: unknown key 'zzz' (known: host, port, max_body_bytes, "
        "max_header_bytes, request_read_timeout_s, admin_token_env, upstream_max_connections, "
        "upstream_max_header_bytes, upstream_max_headers, upstream_max_body_bytes, "
        "upstream_max_event_bytes, upstream_max_kept_bytes)",
    ]


def test_references_are_checked_with_the_names_they_resemble() -> None:
    data = _minimal(degrade_to="smal", provider="hostd", overflow=["degrade", "provider"])
    data["pools"].append({"name": "small", "backends": [{"url": "http://127.0.0.1:2"}]})
    data["providers"] = [{"name": "hosted", "base_url": "http://127.0.0.1:3/v1"}]
    data["tenants"][0]["pools"] = ["big", "smalll"]
    data["providers"][0]["models"] = {"bigg": "m"}
    assert _problems(data) == [
        "gw.yaml: pools[0].degrade_to: no pool named 'smal'; did you mean 'small'?",
        "gw.yaml: pools[0].provider: no provider named 'hostd'; did you mean 'hosted'?",
        "gw.yaml: tenants[0].pools[1]: no pool named 'smalll'; did you mean 'small'?",
        "gw.yaml: providers[0].models.bigg: no pool or adapter named 'bigg'; did you mean 'big'?",
    ]


def test_an_adapters_degrade_to_names_an_adapter_of_the_smaller_pool() -> None:
    data = _minimal(degrade_to="small", overflow=["degrade"])
    data["pools"][0]["adapters"] = [
        {"name": "support", "degrade_to": "support-s"},
        {"name": "sql", "degrade_to": "sq-s"},
    ]
    data["pools"].append(
        {
            "name": "small",
            "backends": [{"url": "http://127.0.0.1:2"}],
            "adapters": [{"name": "support-s"}, {"name": "sql-s"}],
        }
    )
    assert _problems(data) == [
        "gw.yaml: pools[0].adapters[1].degrade_to: pool 'small' has no adapter 'sq-s'; "
        "did you mean 'sql-s'?"
    ]
    del data["pools"][1]["adapters"]
    data["pools"][0]["adapters"] = [{"name": "support", "degrade_to": "support-s"}]
    assert _problems(data) == [
        "gw.yaml: pools[0].adapters[0].degrade_to: pool 'small' has no adapter 'support-s': "
        "it declares no adapters"
    ]
    del data["pools"][0]["degrade_to"]
    data["pools"][0]["overflow"] = ["reject"]
    assert _problems(data) == [
        "gw.yaml: pools[0].adapters[0].degrade_to: an adapter degrades only where "
        "pools[0].degrade_to is set"
    ]


def test_references_are_checked_beside_the_fields_that_failed() -> None:
    """The model's own cross-check runs only once every field is valid; the file's
    references are checked all the same."""
    data = _minimal(target_fill=2, provider="ghost")
    assert _problems(data) == [
        "gw.yaml: pools[0].target_fill: should be less than or equal to 1, not 2",
        "gw.yaml: pools[0].provider: no provider named 'ghost': the file has no providers",
    ]


@pytest.mark.parametrize(
    ("pool", "problem"),
    [
        (
            {"overflow": ["degrade", "reject"]},
            "pools[0].overflow[0]: 'degrade' needs pools[0].degrade_to",
        ),
        ({"overflow": ["provider"]}, "pools[0].overflow[0]: 'provider' needs pools[0].provider"),
        (
            {"overflow": ["queue", "queue", "reject"]},
            "pools[0].overflow[1]: 'queue' is in the chain already, at overflow[0]",
        ),
        (
            {"overflow": ["reject", "queue"]},
            "pools[0].overflow[0]: 'reject' refuses every request: the policies after it would "
            "never run",
        ),
        (
            {"backends": [{"url": "127.0.0.1:8000", "capacity": 0}]},
            "pools[0].backends[0].url: should start with http:// or https://, not '127.0.0.1:8000'",
        ),
    ],
)  # fmt: skip
def test_a_chain_or_backend_that_cannot_work_is_refused(pool: dict[str, Any], problem: str) -> None:
    assert _problems(_minimal(**pool))[0] == f"gw.yaml: {problem}"


def test_names_that_must_be_unique_are() -> None:
    data = _minimal()
    data["pools"] += [
        {"name": "big", "backends": [{"url": "http://127.0.0.1:2"}]},
        {"name": "other", "backends": [{"url": "http://127.0.0.1:3", "name": "big-0"}]},
    ]
    data["tenants"].append({"name": "acme", "key_sha256": hash_key("k")})
    data["providers"] = [{"name": "p", "base_url": "http://h/v1"}] * 2
    assert _problems(data) == [
        "gw.yaml: pools[1].name: 'big' is the name of pools[0] already",
        "gw.yaml: providers[1].name: 'p' is the name of providers[0] already",
        "gw.yaml: tenants[1].name: 'acme' is the name of tenants[0] already",
        "gw.yaml: pools[1].backends[0]: backend name 'big-0' is taken by pools[0].backends[0] "
        "already: metrics and the shared ledger tell backends apart by name",
        "gw.yaml: pools[2].backends[0].name: backend name 'big-0' is taken by "
        "pools[0].backends[0] already: metrics and the shared ledger tell backends apart by name",
        "gw.yaml: tenants[1].key_sha256: the key of tenants[0] too: a key names one tenant",
    ]


def test_a_capacity_is_a_positive_token_count_or_auto() -> None:
    for bad in ("lots", 0, -5, True, "100"):
        assert _problems(_minimal(backends=[{"url": "http://h", "capacity": bad}])) == [
            "gw.yaml: pools[0].backends[0].capacity: should be a positive number of tokens "
            f"or 'auto', not {bad!r}"
        ]


def test_a_queue_wait_is_a_positive_number_of_seconds_or_auto() -> None:
    assert parse_settings(_minimal()).pools[0].queue.max_wait_s == "auto"
    assert parse_settings(_minimal(queue={"max_wait_s": 0.5})).pools[0].queue.max_wait_s == 0.5
    for bad in ("soon", 0, -1.5, True, "2"):
        assert _problems(_minimal(queue={"max_wait_s": bad})) == [
            "gw.yaml: pools[0].queue.max_wait_s: should be a positive number of seconds "
            f"or 'auto', not {bad!r}"
        ]


def test_the_wrong_shape_says_what_was_expected() -> None:
    assert _problems(None) == [
        "gw.yaml: (top level): the file is empty: it needs tenants and pools"
    ]
    assert _problems(["a"]) == [
        "gw.yaml: (top level): should be a mapping of keys to values, not a list"
    ]
    assert _problems({"tenants": [], "pools": 5}) == [
        "gw.yaml: tenants: List should have at least 1 item after validation, not 0",
        "gw.yaml: pools: should be a list, not 5",
    ]


def test_the_environment_check_names_each_unset_empty_or_shared_secret() -> None:
    data = _minimal()
    data["tenants"] = [
        {"name": "a", "key_env": "A_KEY"},
        {"name": "b", "key_env": "B_KEY"},
        {"name": "c", "key_env": "C_KEY"},
        {"name": "d", "key_env": "D_KEY"},
    ]
    data["providers"] = [{"name": "p", "base_url": "http://h/v1", "api_key_env": "P_KEY"}]
    settings = parse_settings(data)
    environ = {"A_KEY": "sk-1", "B_KEY": " ", "C_KEY": "sk-1"}
    assert check_environment(settings, environ=environ) == [
        Problem(loc=("tenants", 1, "key_env"), message="$B_KEY is empty"),
        Problem(loc=("tenants", 2, "key_env"), message="$C_KEY holds the key of tenants[0] too"),
        Problem(loc=("tenants", 3, "key_env"), message="$D_KEY is not set"),
        Problem(loc=("providers", 0, "api_key_env"), message="$P_KEY is not set"),
    ]
    environ = {"A_KEY": "1", "B_KEY": "2", "C_KEY": "3", "D_KEY": "4", "P_KEY": "5"}
    assert check_environment(settings, environ=environ) == []


def test_a_redis_url_redis_py_cannot_use_is_named_without_repeating_it() -> None:
    assert redis_url_problem("redis://:secret@127.0.0.1:6379/0") is None
    assert redis_url_problem("unix:///run/redis.sock") is None
    assert redis_url_problem("127.0.0.1:6379") == (
        "is not a Redis URL: it should start with redis://, rediss:// or unix://"
    )
    assert redis_url_problem("redis://:secret@host:port") == (
        "is not a valid URL (its port should be a number)"
    )


def test_example_configs_load() -> None:
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert examples, "deploy/examples holds at least one config"
    for path in examples:
        load_settings(path)


def test_reservation_and_feedback_are_known_keys_with_defaults() -> None:
    pool = parse_settings(_minimal()).pools[0]
    assert pool.reservation.model_dump() == {
        "mode": "learned",
        "quantile": 0.9,
        "quantile_of": "backend",
        "hold": "peak",
        "prior_tokens": 512,
        "min_samples": 50,
    }
    assert pool.feedback is True
    static = parse_settings(_minimal(reservation={"mode": "max_tokens"}, feedback=False))
    assert (static.pools[0].reservation.mode, static.pools[0].feedback) == ("max_tokens", False)
    problems = _problems(_minimal(reservation={"mode": "static", "quantile": 1.5, "prior": 9}))
    assert len(problems) == 3
    assert [p.split(": ")[1] for p in problems] == [
        "pools[0].reservation.mode",
        "pools[0].reservation.quantile",
        "pools[0].reservation.prior",
    ]
