"""Backends' roles in a pool that splits prefill and decode over two engines, and the pool's
`prefill` rule."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.admission.fleet.backends import build_pools
from gateway.clock import ManualClock
from gateway.config import ConfigError, hash_key, parse_settings


def _config(*roles: str, **pool: Any) -> dict[str, Any]:
    backends = [{"url": f"http://127.0.0.1:{i + 1}", "role": role} for i, role in enumerate(roles)]
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [{"name": "big", "backends": backends, **pool}],
    }


def _problems(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_settings(data, source="gw.yaml")
    return info.value.problems


def test_backends_serve_both_roles_and_pools_split_by_params_unless_told() -> None:
    pool = parse_settings(_config("both")).pools[0]
    assert pool.backends[0].role == "both"
    assert (pool.prefill.kv_transfer, pool.prefill.min_prompt_tokens) == ("params", 256)


def test_prefill_backends_are_a_group_of_their_own_the_rest_serve() -> None:
    settings = parse_settings(_config("prefill", "decode", "both", "prefill"))
    pool = build_pools(settings.pools, clock=ManualClock())["big"]
    assert [b.name for b in pool.backends] == ["big-1", "big-2"]
    assert [b.name for b in pool.prefillers] == ["big-0", "big-3"]
    assert [b.name for b in pool.members] == ["big-0", "big-1", "big-2", "big-3"]


def test_a_pool_needs_a_backend_that_serves() -> None:
    assert _problems(_config("prefill", "prefill")) == [
        "gw.yaml: pools[0].backends: every backend has `role: prefill`: at least one must "
        "serve requests"
    ]


def test_an_embedding_pool_has_nothing_to_prefill_for() -> None:
    problems = _problems(_config("prefill", "both", kind="embedding"))
    assert problems == [
        "gw.yaml: pools[0].backends: an embedding pool has nothing to decode: no backend may "
        "have `role: prefill`"
    ]


def test_a_role_or_protocol_that_does_not_exist_is_named() -> None:
    assert _problems(_config("prefil", prefill={"kv_transfer": "nixl"})) == [
        "gw.yaml: pools[0].backends[0].role: unknown role 'prefil'; did you mean 'prefill'?",
        "gw.yaml: pools[0].prefill.kv_transfer: unknown kv_transfer 'nixl' (known: params, shared)",
    ]


def test_the_guides_pool_is_a_pool_this_gateway_takes() -> None:
    page = (Path(__file__).resolve().parents[3] / "docs" / "disaggregation.md").read_text()
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    data = yaml.safe_load(block)
    data["tenants"] = [{"name": "acme", "key_sha256": hash_key("k")}]
    pool = parse_settings(data).pools[0]
    assert [b.role for b in pool.backends] == ["prefill", "decode", "decode"]
    assert pool.prefill.kv_transfer == "params"
