"""The queues' attained service and waiting tenants, shared by the replicas through Redis
(the queue's side: policies/queue/policy.py and policies/queue/service.py).

Every `every_s`, off the request path, each replica makes one script call per pool, which
travels with the process's other Redis calls (gateway/redis_io/batch.py):

- it adds what its tenants were served since its last pass to the pool's hash
  `spillgate:service:{POOL}` and reads the whole hash back, so every replica orders its
  queue by the fleet's figures. The hash holds each tenant's figure in units that grow
  with Redis's own clock from the hash's stamp (field ""), so adding is one HINCRBYFLOAT
  and nothing decays in place; the stamp moves forward, rescaling every figure and
  dropping those worth nothing, once the growth passes 2^32.
- it writes the tenants waiting in its queue (each with its class and its next request's
  size) under its own field of `spillgate:waiting:{POOL}`, stamped with Redis's time, and
  reads the other replicas' fields not older than `fresh_s`; older ones are deleted (a
  replica that died or lost Redis stops counting within `fresh_s`).

Between passes, a queue whose waiting tenants change (one starts or stops waiting)
announces them at once on the channel `spillgate:waiting` (`announce`, one PUBLISH that
travels with the process's other calls, never awaited by a request), and every replica
hears the others' announcements as they come: a light tenant or a higher class waiting at
one replica holds the room at the others without waiting for the next pass.

A failed or slow pass leaves the queues on this replica's own figures and with no rivals
elsewhere: the local order, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.config import PRIORITIES, Priority
from gateway.overflow import Rival, SharedQueue
from gateway.redis_io.batch import BatchScript, RedisBatcher
from gateway.shared.feed import PoolPasses, Subscriber

log = logging.getLogger("spillgate.queue")

SERVICE_PREFIX = "spillgate:service:"
WAITING_PREFIX = "spillgate:waiting:"
WAITING_TTL_S = 60  # the waiting hash of a pool no replica queues for goes
ANNOUNCEMENTS = "spillgate:waiting"  # the channel: "POOL REPLICA HEADS-JSON"
# KEYS: the pool's waiting hash (where a cluster runs it); ARGV: channel, message
ANNOUNCE = BatchScript("return redis.call('PUBLISH', ARGV[1], ARGV[2])")
# ARGV: half-life, the service hash's TTL, replica id, freshness (s), this replica's
# waiters (JSON, "" for none), then tenant, delta pairs
FEED_PASS = BatchScript(
    """
local h = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local stamp = tonumber(redis.call('HGET', KEYS[1], '') or '')
if stamp == nil or (now - stamp) / h > 32 then
  if stamp ~= nil then
    local scale = 2 ^ (-(now - stamp) / h)
    local all = redis.call('HGETALL', KEYS[1])
    for i = 1, #all, 2 do
      if all[i] ~= '' then
        local v = tonumber(all[i + 1]) * scale
        if v < 0.001 then
          redis.call('HDEL', KEYS[1], all[i])
        else
          redis.call('HSET', KEYS[1], all[i], string.format('%.17g', v))
        end
      end
    end
  end
  stamp = tonumber(string.format('%.6f', now))
  redis.call('HSET', KEYS[1], '', string.format('%.6f', stamp))
end
local growth = 2 ^ ((now - stamp) / h)
for i = 6, #ARGV, 2 do
  local add = string.format('%.17g', tonumber(ARGV[i + 1]) * growth)
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], add)
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
if ARGV[5] == '' then
  redis.call('HDEL', KEYS[2], ARGV[3])
else
  redis.call('HSET', KEYS[2], ARGV[3], string.format('%.6f', now) .. ' ' .. ARGV[5])
  redis.call('EXPIRE', KEYS[2], WAITING_TTL_S)
end
local others = {}
local waiting = redis.call('HGETALL', KEYS[2])
for i = 1, #waiting, 2 do
  if waiting[i] ~= ARGV[3] then
    local at, heads = string.match(waiting[i + 1], '^(%S+) (.*)$')
    if at == nil or now - tonumber(at) > tonumber(ARGV[4]) then
      redis.call('HDEL', KEYS[2], waiting[i])
    else
      others[#others + 1] = waiting[i] .. ' ' .. heads
    end
  end
end
return {string.format('%.6f', now), string.format('%.6f', stamp),
        redis.call('HGETALL', KEYS[1]), others}
""".replace("WAITING_TTL_S", str(WAITING_TTL_S))
)


def service_key(pool: str) -> str:
    """One key per pool; the pool's two keys share a hash slot on a Redis Cluster."""
    return f"{SERVICE_PREFIX}{{{pool}}}"


def waiting_key(pool: str) -> str:
    return f"{WAITING_PREFIX}{{{pool}}}"


class ServiceFeed(PoolPasses[SharedQueue]):
    """The queues' side of Redis (QueueFeed, gateway/overflow.py): a feed pass every
    `every_s`."""

    def __init__(
        self,
        *,
        batcher: RedisBatcher,
        timeout_s: float,
        every_s: float = 0.2,
        replica_id: str | None = None,
        redis: aioredis.Redis | RedisCluster | None = None,
    ) -> None:
        """`redis`: where the announcements are heard (none: only the passes')."""
        self._batch = batcher
        self._timeout_s = timeout_s
        self.every_s = every_s
        # a waiter list older than three passes is a replica gone, or cut off from Redis
        self.fresh_s = 3 * every_s
        self.replica_id = replica_id or secrets.token_hex(6)
        self._queues: dict[str, SharedQueue] = {}
        super().__init__(self._pass_pool, self._queues, every_s=every_s, name="service-feed")
        self._announcing: set[asyncio.Task[Any]] = set()
        self._heard = (
            None
            if redis is None
            else Subscriber(
                redis, ANNOUNCEMENTS, deliver=self.heard, timeout_s=timeout_s, name="waiting-feed"
            )
        )

    def register(self, pool: str, queue: SharedQueue) -> None:
        self._queues[pool] = queue

    def announce(self, pool: str, heads: list[tuple[Priority, str, int, int]]) -> None:
        message = f"{pool} {self.replica_id} {orjson.dumps(heads).decode()}"
        call = self._batch.submit(
            ANNOUNCE, [waiting_key(pool)], [ANNOUNCEMENTS, message], budget_s=self._timeout_s
        )
        task = asyncio.ensure_future(call)
        self._announcing.add(task)
        task.add_done_callback(self._announced)

    def _announced(self, task: asyncio.Task[Any]) -> None:
        self._announcing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the next pass tells
            log.debug("an announcement of waiters failed: %r", task.exception())

    def heard(self, data: Any) -> None:
        """One replica's announcement: handed to its pool's queue here."""
        pool, _, rest = _text(data).partition(" ")
        replica, _, heads = rest.partition(" ")
        queue = self._queues.get(pool)
        if queue is not None and replica and replica != self.replica_id:
            queue.rivals_heard(replica, _rivals(replica, heads))

    async def start(self) -> None:
        await super().start()
        if self._heard is not None:
            await self._heard.start()

    async def stop(self) -> None:
        if self._heard is not None:
            await self._heard.stop()
        await super().stop()
        for task in list(self._announcing):
            task.cancel()

    async def _pass_pool(self, pool: str, queue: SharedQueue) -> None:
        service = queue.service
        deltas = service.take_unshared()
        heads = queue.waiting_heads()
        args: list[str | int | float] = [
            service.half_life_s,
            math.ceil(32 * service.half_life_s),
            self.replica_id,
            self.fresh_s,
            orjson.dumps(heads).decode() if heads else "",
        ]
        for tenant, delta in deltas.items():
            args += [tenant, delta]
        try:
            reply = await self._batch.submit(
                FEED_PASS, [service_key(pool), waiting_key(pool)], args, budget_s=self._timeout_s
            )
            fleet, rivals = _parsed(reply, half_life_s=service.half_life_s)
        except BaseException:
            service.keep_sent()
            queue.rivals_seen([])  # unknown now: the local order
            raise
        service.replace_base(fleet)
        queue.rivals_seen(rivals)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parsed(reply: Any, *, half_life_s: float) -> tuple[dict[str, float], list[Rival]]:
    """The fleet's figures as of the reply, and the rivals it names; a malformed entry
    (written by something else) is skipped."""
    now, stamp, flat, others = reply
    decay = 2.0 ** (-(float(_text(now)) - float(_text(stamp))) / half_life_s)
    fleet: dict[str, float] = {}
    for name, value in zip(flat[::2], flat[1::2], strict=True):
        tenant = _text(name)
        if tenant:
            fleet[tenant] = float(_text(value)) * decay
    rivals = []
    for entry in others:
        replica, _, heads = _text(entry).partition(" ")
        rivals += _rivals(replica, heads)
    return fleet, rivals


def _rivals(replica: str, heads: str) -> list[Rival]:
    """The waiters one replica named; a malformed list (written by something else): none."""
    rivals = []
    try:
        for priority, tenant, tokens, sequences in orjson.loads(heads):
            if priority in PRIORITIES:
                rivals.append(Rival(priority, str(tenant), int(tokens), int(sequences), replica))
    except (ValueError, TypeError):
        log.debug("skipped a malformed waiter list: %r", heads)
        return []
    return rivals
