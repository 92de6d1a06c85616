"""Where files, batches and per-item results live: one small Protocol, two stores.

Records are JSON objects filed by kind and key; blobs are bytes (a file's content). An item
is claimed before it runs, so that of several processes (or replicas) sharing a store only
one runs it; a claim is a lease that a process which died while running the item loses
after `ttl_s`, so the item runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.clock import Clock

Record = dict[str, Any]


class BatchStore(Protocol):
    async def save(self, kind: str, key: str, record: Record) -> None: ...
    async def load(self, kind: str, key: str) -> Record | None: ...
    async def keys(self, kind: str) -> list[str]: ...
    async def delete(self, kind: str, key: str) -> None: ...
    async def save_blob(self, key: str, data: bytes) -> None: ...
    async def load_blob(self, key: str) -> bytes | None: ...
    async def delete_blob(self, key: str) -> None: ...
    async def claim(self, key: str, *, ttl_s: float) -> bool:
        """True if this caller now holds `key` (nobody did, or the holder's lease ran out)."""
        ...

    async def unclaim(self, key: str) -> None: ...
    async def close(self) -> None: ...


def _safe(name: str) -> str:
    """Keys are ids the gateway made (letters, digits, '_', '-', '.'); anything else is refused
    so that no key names a path outside the store."""
    if not name or name.startswith(".") or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"not a store key: {name!r}")
    return name


class DirStore:
    """The embedded default: one directory, shared by the processes of one machine.

    A record is written to a temporary file and renamed into place, so a reader (or a
    restart) sees the old record or the new one, never half of one. A claim is a file
    created exclusively (O_EXCL: atomic on a local file system) that holds its deadline, in
    the wall-clock time every process of the machine reads alike.
    """

    def __init__(self, root: str | Path, *, clock: Clock) -> None:
        self._root = Path(root)
        self._clock = clock

    def _path(self, kind: str, key: str) -> Path:
        return self._root / _safe(kind) / _safe(key)

    async def save(self, kind: str, key: str, record: Record) -> None:
        await asyncio.to_thread(self._write, self._path(kind, key), orjson.dumps(record))

    async def load(self, kind: str, key: str) -> Record | None:
        data = await asyncio.to_thread(self._read, self._path(kind, key))
        return None if data is None else dict(orjson.loads(data))

    async def keys(self, kind: str) -> list[str]:
        folder = self._root / _safe(kind)
        names = await asyncio.to_thread(lambda: os.listdir(folder) if folder.is_dir() else [])
        return sorted(n for n in names if not n.startswith("."))

    async def delete(self, kind: str, key: str) -> None:
        await asyncio.to_thread(self._unlink, self._path(kind, key))

    async def save_blob(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._write, self._path("blobs", key), data)

    async def load_blob(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._read, self._path("blobs", key))

    async def delete_blob(self, key: str) -> None:
        await asyncio.to_thread(self._unlink, self._path("blobs", key))

    async def claim(self, key: str, *, ttl_s: float) -> bool:
        path, now = self._path("claims", key), self._clock.wall()
        return await asyncio.to_thread(self._claim, path, deadline=now + ttl_s, now=now)

    async def unclaim(self, key: str) -> None:
        await asyncio.to_thread(self._unlink, self._path("claims", key))

    async def close(self) -> None:
        pass

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}")
        temp.write_bytes(data)
        os.replace(temp, path)

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    @classmethod
    def _claim(cls, path: Path, *, deadline: float, now: float) -> bool:
        path.parent.mkdir(parents=True, exist_ok=True)
        written = str(deadline).encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            held = cls._read(path)
            if held is None or not held.strip() or float(held) > now:
                return False
            # the holder's lease ran out: take the claim over by renaming a fresh one onto
            # it; of two processes doing so at once, the one whose deadline is read back wins
            cls._write(path, written)
            return cls._read(path) == written
        with os.fdopen(fd, "wb") as f:
            f.write(written)
        return True


class RedisStore:
    """Shared mode: every replica sees the same records; a claim is a key set only if absent
    (SET NX) with the lease as its expiry. Keys share one hash tag, so on a Redis Cluster
    they live on one master, and redis-py's cluster client follows that master through a
    failover (a command whose node is gone reads the slot map anew and is tried again)."""

    def __init__(
        self, redis: aioredis.Redis | RedisCluster, *, prefix: str = "spillgate:batch"
    ) -> None:
        self._redis = redis
        self._prefix = "{" + prefix + "}"

    @classmethod
    def connect(cls, url: str, *, timeout_s: float, cluster: bool = False) -> RedisStore:
        """A store on its own connections: a file's content takes longer to move than the
        request path's Redis calls, whose time budget is milliseconds. With `cluster`, the
        node at `url` is one of a Redis Cluster's."""
        client = RedisCluster.from_url if cluster else aioredis.Redis.from_url
        return cls(
            client(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=16
            )
        )

    async def close(self) -> None:
        await self._redis.aclose()

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def save(self, kind: str, key: str, record: Record) -> None:
        await self._redis.hset(self._key("rec", kind), key, orjson.dumps(record))

    async def load(self, kind: str, key: str) -> Record | None:
        data = await self._redis.hget(self._key("rec", kind), key)
        return None if data is None else dict(orjson.loads(data))

    async def keys(self, kind: str) -> list[str]:
        names = await self._redis.hkeys(self._key("rec", kind))
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)

    async def delete(self, kind: str, key: str) -> None:
        await self._redis.hdel(self._key("rec", kind), key)

    async def save_blob(self, key: str, data: bytes) -> None:
        await self._redis.set(self._key("blob", key), data)

    async def load_blob(self, key: str) -> bytes | None:
        data = await self._redis.get(self._key("blob", key))
        return None if data is None else data if isinstance(data, bytes) else data.encode()

    async def delete_blob(self, key: str) -> None:
        await self._redis.delete(self._key("blob", key))

    async def claim(self, key: str, *, ttl_s: float) -> bool:
        done = await self._redis.set(self._key("claim", key), b"1", nx=True, px=int(ttl_s * 1000))
        return bool(done)

    async def unclaim(self, key: str) -> None:
        await self._redis.delete(self._key("claim", key))
