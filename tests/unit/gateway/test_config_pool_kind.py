"""A pool's kind (`chat` or `embedding`): the overflow steps and degrade targets it allows."""

from typing import Any

import pytest

from gateway.config import ConfigError, hash_key, parse_settings


def _config(*pools: dict[str, Any]) -> dict[str, Any]:
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [{"backends": [{"url": "http://127.0.0.1:1"}], **pool} for pool in pools],
    }


def _problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(data, source="gw.yaml")
    return info.value.problems


def test_a_pool_is_a_chat_pool_unless_it_says_otherwise() -> None:
    settings = parse_settings(_config({"name": "a"}, {"name": "e", "kind": "embedding"}))
    assert [p.kind for p in settings.pools] == ["chat", "embedding"]


def test_an_embedding_pool_may_queue_spill_to_a_provider_and_reject() -> None:
    pool = {"name": "e", "kind": "embedding", "overflow": ["queue", "provider", "reject"]}
    data = _config(pool)
    data["pools"][0]["provider"] = "p"
    data["providers"] = [{"name": "p", "base_url": "http://127.0.0.1:2/v1"}]
    assert parse_settings(data).pools[0].overflow == ["queue", "provider", "reject"]


def test_an_embedding_pool_refuses_degrade_and_cache_with_why() -> None:
    embed = {"name": "e", "kind": "embedding", "overflow": ["cache", "degrade", "reject"]}
    assert _problems(
        _config(embed | {"degrade_to": "e2"}, {"name": "e2", "kind": "embedding"})
    ) == [
        "gw.yaml: pools[0].overflow[0]: 'cache' cannot serve an embedding pool: the response "
        "cache keeps generated text, not vectors",
        "gw.yaml: pools[0].overflow[1]: 'degrade' cannot serve an embedding pool: another "
        "model's vectors do not match this model's",
    ]


def test_a_pool_degrades_only_to_a_pool_of_its_kind() -> None:
    chat = {"name": "a", "overflow": ["degrade", "reject"], "degrade_to": "e"}
    assert _problems(_config(chat, {"name": "e", "kind": "embedding"})) == [
        "gw.yaml: pools[0].degrade_to: 'e' is a pool of kind 'embedding', this one of kind "
        "'chat': a pool degrades only to a pool of its kind"
    ]


def test_an_unknown_kind_is_refused() -> None:
    assert _problems(_config({"name": "a", "kind": "rerank"})) == [
        "gw.yaml: pools[0].kind: unknown kind 'rerank' (known: chat, embedding)"
    ]
