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

A waiter of a higher class that does not fit, where this replica runs nothing of a lower
class to stop for it (gateway/front/preemption.py), calls for a preemption on the same
channel (`call_preemption`: at most one call per pool every CALL_GAP_S). Every replica that
runs lower-class work whose room would let the waiter fit claims the call (`SET NX` on
`spillgate:preempt:{POOL}:CALL`, off the request path); the one that claims it first stops
its requests for the waiter, the others leave theirs running.

A failed or slow pass leaves the queues on this replica's own figures and with no rivals
elsewhere: the local order, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from gateway.config import PRIORITIES, Priority
from gateway.overflow import Preempts, Rival, Route, SharedQueue
from gateway.redis_io.batch import BatchScript, RedisBatcher
from gateway.shared.feed import PoolPasses, Subscriber

log = logging.getLogger("spillgate.queue")

SERVICE_PREFIX = "spillgate:service:"
WAITING_PREFIX = "spillgate:waiting:"
WAITING_TTL_S = 60  # the waiting hash of a pool no replica queues for goes
ANNOUNCEMENTS = "spillgate:waiting"  # the channel: "POOL REPLICA HEADS-JSON"
# KEYS: the pool's waiting hash (where a cluster runs it); ARGV: channel, message
ANNOUNCE = BatchScript("return redis.call('PUBLISH', ARGV[1], ARGV[2])")
PREEMPT_PREFIX = "spillgate:preempt:"
CALL_GAP_S = 0.25  # a pool's waiter calls on the others at most this often
CLAIM_TTL_MS = 5000  # a call is answered once: later claims of it find it taken
# KEYS: the call's claim; ARGV: replica id, the claim's TTL (ms) → 1 for the first claim
CLAIM = BatchScript(
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end return 0"
)
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
        # the requests this replica runs that may be stopped for a waiter elsewhere
        self.preempts: Preempts | None = None
        self._called: dict[str, float] = {}  # pool → when a waiter here last called
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
        self._publish(pool, orjson.dumps(heads).decode())

    def call_preemption(self, pool: str, priority: Priority, tokens: int, sequences: int) -> None:
        now = time.monotonic()
        if now - self._called.get(pool, -math.inf) < CALL_GAP_S:
            return
        self._called[pool] = now
        call = secrets.token_hex(6)
        self._publish(pool, orjson.dumps({"preempt": [priority, tokens, sequences, call]}).decode())

    def _publish(self, pool: str, text: str) -> None:
        message = f"{pool} {self.replica_id} {text}"
        self._submit(ANNOUNCE, [waiting_key(pool)], [ANNOUNCEMENTS, message])

    def _submit(self, script: BatchScript, keys: list[str], args: list[str | int]) -> None:
        call = self._batch.submit(script, keys, args, budget_s=self._timeout_s)
        task = asyncio.ensure_future(call)
        self._announcing.add(task)
        task.add_done_callback(self._announced)

    def _announced(self, task: asyncio.Task[Any]) -> None:
        self._announcing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the next pass tells
            log.debug("an announcement of waiters failed: %r", task.exception())

    def heard(self, data: Any) -> None:
        """One replica's announcement, handed to its pool's queue here; or its call for a
        preemption, claimed where this replica could answer it."""
        pool, _, rest = _text(data).partition(" ")
        replica, _, heads = rest.partition(" ")
        queue = self._queues.get(pool)
        if queue is None or not replica or replica == self.replica_id:
            return
        if heads.startswith("{"):
            self._called_on(pool, heads)
        else:
            queue.rivals_heard(replica, _rivals(replica, heads))

    def _called_on(self, pool: str, text: str) -> None:
        try:
            priority, tokens, sequences, call = orjson.loads(text)["preempt"]
            route = Route(pool, int(tokens), int(sequences))
        except (ValueError, TypeError, KeyError):
            log.debug("skipped a malformed preemption call: %r", text)
            return
        preempts = self.preempts
        if priority not in PRIORITIES or preempts is None:
            return
        if preempts.could_make_room(route, priority):
            task = asyncio.ensure_future(self._answer(route, priority, str(call)))
            self._announcing.add(task)
            task.add_done_callback(self._announced)

    async def _answer(self, route: Route, priority: Priority, call: str) -> None:
        """Claim the call; the first replica to claim it stops its requests for it."""
        key = f"{PREEMPT_PREFIX}{{{route.pool}}}:{call}"
        claimed = await self._batch.submit(
            CLAIM, [key], [self.replica_id, CLAIM_TTL_MS], budget_s=self._timeout_s
        )
        if int(claimed) == 1 and self.preempts is not None:
            self.preempts.make_room(route, priority)

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
