"""The batch tier's config keys, and the local store's records and claims (real files)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.batch.store import DirStore
from gateway.clock import ManualClock
from gateway.config import BatchSettings, ConfigError, hash_key, parse_settings


def _config(**batch: object) -> dict[str, object]:
    return {
        "tenants": [{"name": "acme", "key_sha256": hash_key("k")}],
        "pools": [{"name": "big", "backends": [{"url": "http://127.0.0.1:1"}]}],
        "batch": batch,
    }


def test_the_batch_keys_are_checked_with_the_rest_of_the_file() -> None:
    assert parse_settings(_config()).batch == BatchSettings()
    with pytest.raises(ConfigError) as caught:
        parse_settings(_config(max_fil=0.5, max_fill=1.5), source="gw.yaml")
    assert caught.value.problems == [
        "gw.yaml: batch.max_fill: should be less than or equal to 1, not 1.5",
        "gw.yaml: batch.max_fil: unknown key 'max_fil'; did you mean 'max_fill'?",
    ]


def test_records_blobs_and_keys_survive_a_new_store_on_the_directory(tmp_path: Path) -> None:
    async def run() -> None:
        store = DirStore(tmp_path, clock=ManualClock())
        await store.save("batch", "batch_1", {"status": "in_progress"})
        await store.save_blob("file-1", b'{"a": 1}\n')
        again = DirStore(tmp_path, clock=ManualClock())
        assert await again.load("batch", "batch_1") == {"status": "in_progress"}
        assert await again.load_blob("file-1") == b'{"a": 1}\n'
        assert await again.keys("batch") == ["batch_1"]
        assert await again.load("batch", "batch_2") is None
        await again.delete("batch", "batch_1")
        assert await again.keys("batch") == []
        with pytest.raises(ValueError, match="not a store key"):
            await again.load("batch", "../etc")

    asyncio.run(run())


def test_an_item_is_claimed_once_until_its_lease_runs_out(tmp_path: Path) -> None:
    async def run() -> None:
        clock = ManualClock()  # both processes read the same wall clock
        first, second = DirStore(tmp_path, clock=clock), DirStore(tmp_path, clock=clock)
        assert await first.claim("batch_1.0", ttl_s=60) is True
        assert await second.claim("batch_1.0", ttl_s=60) is False
        await first.unclaim("batch_1.0")
        assert await second.claim("batch_1.0", ttl_s=60) is True
        # a holder that died: its lease has run out, and the claim is taken over once
        assert await second.claim("batch_1.1", ttl_s=60) is True
        clock.advance(59.0)
        assert await first.claim("batch_1.1", ttl_s=60) is False
        clock.advance(2.0)
        assert await first.claim("batch_1.1", ttl_s=60) is True
        assert await second.claim("batch_1.1", ttl_s=60) is False
        assert sorted(os.listdir(tmp_path / "claims")) == ["batch_1.0", "batch_1.1"]

    asyncio.run(run())
