"""The cache key: who asked, which pool and what; nothing else, nothing less."""

from __future__ import annotations

from typing import Any

from gateway.config import CacheSettings
from gateway.front.parse import parse_request
from gateway.request import Endpoint
from policies.cache.policy import cache_key, is_deterministic, storable


def request(body: dict[str, Any], *, tenant: str = "a", pool: str = "big") -> Any:
    return parse_request(
        {"model": pool, **body},
        endpoint=Endpoint.CHAT if "messages" in body else Endpoint.COMPLETIONS,
        tenant=tenant,
        pool=pool,
        priority="standard",
        default_max_tokens=64,
        max_model_len=4096,
        chars_per_token=4.0,
    )


HELLO = {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0}


def test_the_same_question_maps_to_one_key_however_it_is_spelled() -> None:
    plain = request({**HELLO, "max_tokens": 64})
    spelled = request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
            "max_completion_tokens": 64,
        }
    )
    defaulted = request(HELLO)  # max_tokens defaults to the pool's 64
    keys = {cache_key(r, scope="tenant:a") for r in (plain, spelled, defaulted)}
    assert len(keys) == 1


def test_tenant_pool_prompt_and_sampling_all_change_the_key() -> None:
    base = cache_key(request(HELLO), scope="tenant:a")
    others = [
        cache_key(request(HELLO), scope="tenant:b"),
        cache_key(request(HELLO, pool="small"), scope="tenant:a"),
        cache_key(
            request({**HELLO, "messages": [{"role": "user", "content": "Hi"}]}), scope="tenant:a"
        ),
        cache_key(request({**HELLO, "max_tokens": 65}), scope="tenant:a"),
        cache_key(request({**HELLO, "seed": 7}), scope="tenant:a"),
        cache_key(request({"prompt": "Hello", "temperature": 0}), scope="tenant:a"),
    ]
    assert base not in others and len(set(others)) == len(others)


def test_only_reproducible_requests_are_stored_by_default() -> None:
    default, everything = CacheSettings(), CacheSettings(store="all")
    sampled = request({"messages": HELLO["messages"], "temperature": 0.7})
    seeded = request({"messages": HELLO["messages"], "temperature": 0.7, "seed": 3})
    unset = request({"messages": HELLO["messages"]})
    assert is_deterministic(request(HELLO)) and is_deterministic(seeded)
    assert not is_deterministic(sampled) and not is_deterministic(unset)
    assert storable(seeded, default) and not storable(sampled, default)
    assert storable(sampled, everything)
    assert not storable(request({**HELLO, "logprobs": True}), everything)
