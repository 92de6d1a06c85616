import pytest

from gateway.config import ConfigError, hash_key, load_settings, parse_settings


def _minimal(**pool: object) -> dict[str, object]:
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [{"name": "big", "backends": [{"url": "http://127.0.0.1:1"}], **pool}],
    }


def test_minimal_config_gets_sane_defaults() -> None:
    settings = parse_settings(_minimal())
    pool = settings.pools[0]
    assert pool.overflow == ["reject"]
    assert pool.backends[0].capacity == "auto"
    assert 0 < pool.target_fill <= 1


def test_every_error_is_reported_at_once_with_its_key_path() -> None:
    data = _minimal(target_fill=1.5, degrade_to="nowhere")
    data["tenants"] = [{"name": "acme"}, {"name": "b", "key_sha256": "xyz"}]
    with pytest.raises(ConfigError) as info:
        parse_settings(data, source="gw.yaml")
    problems = info.value.problems
    joined = "\n".join(problems)
    assert "pools.0.target_fill" in joined
    assert "tenants.0" in joined and "exactly one of key_sha256 or key_env" in joined
    assert "tenants.1" in joined and "64 lowercase hex" in joined
    assert str(info.value).startswith("gw.yaml: invalid config")


def test_cross_references_are_checked(tmp_path: object) -> None:
    data = _minimal(provider="ghost")
    with pytest.raises(ConfigError) as info:
        parse_settings(data)
    assert "no provider named 'ghost'" in str(info.value)


def test_unknown_keys_are_refused() -> None:
    data = _minimal(targetfill=0.5)
    with pytest.raises(ConfigError) as info:
        parse_settings(data)
    assert "pools.0.targetfill" in str(info.value)


def test_example_configs_load() -> None:
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[3] / "deploy" / "examples").glob("*.yaml"))
    assert examples, "deploy/examples holds at least one config"
    for path in examples:
        load_settings(path)
