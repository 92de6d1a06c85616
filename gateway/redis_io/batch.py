"""Script calls one process makes in the same moment travel to Redis together, uncut.

Every script call (the limiter's decisions, the ledger's reserves, releases and refreshes)
is queued; once per event-loop tick the queue goes out as one pipeline of EVALSHAs on one
pooled connection, so 64 concurrent requests cost about one round trip instead of 64
queued ones. At most `max_in_flight` pipelines are on the wire at once; calls made
meanwhile wait for the next one, so a busy process sends fewer, larger pipelines.

A caller waits for its answer on a future, with its own time budget, and its cancellation
never reaches redis-py: each pipeline runs in the batcher's own task, bounded by the
client's socket timeout, so its connection always goes back to the pool however the
caller's wait ends (redis-py leaks the connection when a cancellation lands between taking
it from the pool and its own cleanup). A call whose caller gave up before it was sent is
dropped; one sent already is answered late, to its `on_late` hook, so the caller can undo
what it did in Redis (the limiter refunds a decision nobody used).

`latency` is what callers waited lately for an answer (from submitting a call to its
reply, the pipeline's queueing and the event loop's lag included), the base of the
callers' time budgets.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ConnectionError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.sweep import Sweep

log = logging.getLogger("spillgate.redis")

Arg = str | int | float | bytes
# the least time between two reads of a cluster's slot map after a node did not answer:
# a promoted replica is found within this of the cluster's own failover
SLOT_MAP_MIN_S = 0.2
# what says a cluster node did not answer at all (as against answering with an error)
_UNREACHABLE = (ConnectionError, RedisTimeoutError, TimeoutError, OSError)


@dataclass(frozen=True, slots=True)
class BatchScript:
    """A Lua script known by its SHA1, loaded into Redis when Redis says it lacks it."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


@dataclass(slots=True, eq=False)
class _Call:
    """One queued EVALSHA; with a budget, a Timed the loop's Sweep holds until it is due."""

    batcher: RedisBatcher
    script: BatchScript
    keys: Sequence[str]
    args: Sequence[Arg]
    future: asyncio.Future[Any]
    on_late: Callable[[Any], None] | None
    submitted: float  # event-loop time
    due: float = math.inf
    budget_s: float = 0.0
    until: float = math.inf  # the ceiling: no answer after this is waited for
    sent: float = math.inf  # when its pipeline went out
    rechecks: int = 0
    pass_started: float = 0.0
    fired_late: bool = False

    def on_due(self, now: float) -> None:
        """Out of time: fail the call, unless the store is not the one being slow.

        The reply may have arrived while the loop was busy and wait, unread, behind this
        timer: two loop passes let the pipeline's task read it. When this timer fired late
        or those passes are slow (the loop has more work than it can do: a burst; or the
        process got no CPU), the wait is the loop's, not the store's, and the call waits
        on. A call not sent yet waits behind pipelines that are themselves within their
        budget; a sent one has its budget from when it went out. Never past `until`.
        """
        if self.future.done():
            return
        loop = self.future.get_loop()
        if self.rechecks == 0:
            self.pass_started = time.perf_counter()
            self.fired_late = now - self.due > self.budget_s / 4  # the loop was held up
        if self.rechecks < 2:
            self.rechecks += 1
            loop.call_soon(self.on_due, now)
            return
        self.rechecks = 0
        now = loop.time()
        busy = self.fired_late or time.perf_counter() - self.pass_started > self.budget_s / 8
        later = now + self.budget_s if busy else self.batcher.waiting_on_store(self, now)
        if later is not None and now < self.until:
            self.due = min(later, self.until)
            Sweep.of(loop).track(self)
            return
        self.future.set_exception(TimeoutError("Redis did not answer within the time budget"))


class Latency:
    """A smoothed round-trip time and its spread (TCP's estimator, RFC 6298)."""

    def __init__(self, *, initial_s: float) -> None:
        self.mean_s = initial_s
        self.spread_s = initial_s / 2
        self.samples = 0

    def add(self, seconds: float) -> None:
        if self.samples == 0:
            self.mean_s, self.spread_s = seconds, seconds / 2
        else:
            self.spread_s = 0.75 * self.spread_s + 0.25 * abs(self.mean_s - seconds)
            self.mean_s = 0.875 * self.mean_s + 0.125 * seconds
        self.samples += 1

    def budget_s(self, *, floor_s: float, ceiling_s: float) -> float:
        """How long to wait for an answer: the mean plus four spreads, within the bounds."""
        return min(ceiling_s, max(floor_s, self.mean_s + 4 * self.spread_s))


class RedisBatcher:
    """Coalesces one process's script calls into pipelines; never cancels one in flight."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        *,
        max_in_flight: int = 2,
        max_batch: int = 512,
    ) -> None:
        self._redis = redis
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._pending: list[_Call] = []
        self._scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        self._sent_at: dict[asyncio.Task[None], float] = {}
        self._closed = False
        self.latency = Latency(initial_s=0.001)
        self.pipelines = 0  # sent, for tests and benchmarks
        self.calls = 0
        self.slot_map_reads = 0  # a cluster's, after a redirection or an unreachable node
        self._reading = asyncio.Lock()
        self._map_read_at = -math.inf  # time.monotonic()

    @property
    def connections_busy(self) -> int:
        """Pipelines on the wire, each holding one pooled connection."""
        return len(self._sending)

    def submit(
        self,
        script: BatchScript,
        keys: Sequence[str],
        args: Sequence[Arg],
        *,
        on_late: Callable[[Any], None] | None = None,
        budget_s: float | None = None,
        ceiling_s: float | None = None,
    ) -> asyncio.Future[Any]:
        """Queue one EVALSHA; its future gets the reply, or the RedisError/OSError raised,
        or TimeoutError once `budget_s` has passed with the store to blame (on_due), and
        at the latest after `ceiling_s`.

        Cancelling the future (or its timing out) before the call is sent withdraws it;
        after, the reply goes to `on_late` (and an error nowhere).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:
            future.set_exception(RedisError("the Redis client is closed"))
            return future
        call = _Call(self, script, keys, args, future, on_late, loop.time())
        if budget_s is not None:
            call.budget_s = budget_s
            call.due = call.submitted + budget_s
            call.until = call.submitted + max(budget_s, ceiling_s or budget_s)
            Sweep.of(loop).track(call)
        self._pending.append(call)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def node_of(self, key: str) -> str:
        """The name of the node that holds `key` now: on a single Redis, "" for every key;
        on a cluster, as the slot map last read says (the key itself before one is read)."""
        if not isinstance(self._redis, RedisCluster):
            return ""
        try:
            node = self._redis.get_node_from_key(key)
        except RedisError:
            return key
        return key if node is None else str(node.name)

    def waiting_on_store(self, call: _Call, now: float) -> float | None:
        """When to look again at an unanswered call, or None when the store is to blame."""
        if call.sent <= now:
            later = call.sent + call.budget_s
            return later if later > now else None
        oldest = min(self._sent_at.values(), default=now)
        if now - oldest >= call.budget_s:  # the pipelines it waits behind are overdue
            return None
        return now + call.budget_s

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and len(self._sending) < self._max_in_flight:
            batch = [c for c in self._pending[: self._max_batch] if not c.future.done()]
            del self._pending[: self._max_batch]
            if not batch:
                continue
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._send(batch))
            self._sending.add(task)
            self._sent_at[task] = now = loop.time()
            for call in batch:
                call.sent = now

    async def _send(self, batch: list[_Call]) -> None:
        loop = asyncio.get_running_loop()
        try:
            replies = await self._pipeline(batch)
        except Exception as exc:  # every caller learns the batch failed
            if not isinstance(exc, (RedisError, OSError, TimeoutError)):
                log.exception("a Redis batch failed unexpectedly")
                exc = RedisError(f"the batch failed: {exc!r}")
            for call in batch:
                _settle(call, exc)
        except asyncio.CancelledError:  # closing: the callers learn the store went away
            for call in batch:
                if not call.future.done():
                    call.future.set_exception(RedisError("the Redis client is closing"))
            raise
        else:
            # what the callers waited, queueing and the loop's own lag included
            self.latency.add(loop.time() - batch[0].submitted)
            for call, reply in zip(batch, replies, strict=True):
                _settle(call, reply)
        finally:
            task = asyncio.current_task()
            self._sending.discard(task)
            self._sent_at.pop(task, None)  # type: ignore[arg-type]
            if self._pending and not self._scheduled and not self._closed:
                self._scheduled = True
                loop.call_soon(self._flush)

    async def _pipeline(self, batch: list[_Call]) -> list[Any]:
        self.pipelines += 1
        self.calls += len(batch)
        replies = await self._evalshas(batch)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:  # Redis restarted or flushed its scripts: load them, send those again
            for script in {batch[i].script for i in missing}:
                await self._redis.script_load(script.text)
            again = await self._evalshas([batch[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _evalshas(self, batch: list[_Call]) -> list[Any]:
        if isinstance(self._redis, RedisCluster):
            return await self._on_cluster(batch, moves=1)
        packed = b"".join(map(_packed, batch))
        try:
            return await self._on_one_connection(packed, len(batch))
        except ConnectionError:
            # after a restart or failover every idle pooled connection is closed: send once
            # more on a new one rather than fail the batch (as redis-py's retry_on_error).
            # Decisions and leases carry ids, so a resent one counts once; a settlement
            # (bucket.lua adjust) could count twice only if Redis ran it and then dropped
            # the connection while staying up
            return await self._on_one_connection(packed, len(batch))

    async def _on_one_connection(self, packed: bytes, count: int) -> list[Any]:
        """Write the whole batch at once and read its replies, as redis-py's pipeline does
        but without its per-argument encoding, which cost most of a decision's CPU time.
        A connection that failed mid-way is closed before it goes back to the pool."""
        assert isinstance(self._redis, aioredis.Redis)
        pool = self._redis.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            return await _round_trip(conn, packed, count)
        finally:
            await pool.release(conn)

    async def _on_cluster(self, batch: list[_Call], *, moves: int) -> list[Any]:
        """Each node's share of the batch on one of its connections, all nodes at once.
        Every call's keys share one hash tag, so the first key names its node.

        A call answered MOVED or ASK (a slot changed hands), or whose node could not be
        reached (a connection refused or broken, a round trip out of time: a master that
        died, before or after its replica was promoted), is sent once more after the slot
        map has been read anew from a node that answers, as redis-py's own cluster client
        does for one command. A call whose node is still unreachable then fails alone:
        the other nodes' calls are answered, so one dead master degrades only its slots.
        A call sent twice so counts once where the single-server path's does (decisions
        and leases carry ids: `_evalshas`).
        """
        cluster = self._redis
        assert isinstance(cluster, RedisCluster)
        await cluster.initialize()  # reads the slot map once (a no-op after)
        nodes: dict[Any, list[int]] = {}
        for i, call in enumerate(batch):
            nodes.setdefault(cluster.get_node_from_key(call.keys[0]), []).append(i)
        replies: list[Any] = [None] * len(batch)
        lost: dict[int, tuple[str, bool]] = {}  # call: the node that did not answer, timed out

        async def on_node(node: Any, indices: list[int]) -> None:
            try:
                conn = node.acquire_connection()
                try:
                    packed = b"".join(_packed(batch[i]) for i in indices)
                    got = await _round_trip(conn, packed, len(indices))
                finally:
                    node.release(conn)
            except _UNREACHABLE as exc:
                if isinstance(exc, MaxConnectionsError):
                    raise  # this process is busy, not the node gone
                got = [exc] * len(indices)
                timed_out = isinstance(exc, (TimeoutError, RedisTimeoutError))
                lost.update((i, (node.name, timed_out)) for i in indices)
            for i, reply in zip(indices, got, strict=True):
                replies[i] = reply

        await asyncio.gather(*(on_node(node, indices) for node, indices in nodes.items()))
        moved = [i for i, r in enumerate(replies) if isinstance(r, (MovedError, AskError))]
        if (moved or lost) and moves > 0:
            failed = next((node for node, _ in lost.values()), None)
            await self._read_slot_map(cluster, failed=failed, paced=not moved)
            again = moved + [
                i for i, lost_at in lost.items() if _resend(cluster, batch[i], *lost_at)
            ]
            if again:
                resent = await self._on_cluster([batch[i] for i in again], moves=moves - 1)
                for i, reply in zip(again, resent, strict=True):
                    replies[i] = reply
        return replies

    async def _read_slot_map(
        self, cluster: RedisCluster, *, failed: str | None, paced: bool
    ) -> None:
        """Read the slot map anew, from any node that answers (the one that failed last).

        One read at a time: pipelines that fail meanwhile wait for it and use its map.
        After an unreachable node (`paced`), at most one read per SLOT_MAP_MIN_S: while a
        dead master's replica is not yet promoted every batch for its slots fails, and
        each would otherwise read the map again. A read that reaches no node leaves the
        map as it was; the calls fail with their own errors.
        """
        async with self._reading:
            if paced and time.monotonic() - self._map_read_at < SLOT_MAP_MIN_S:
                return
            try:
                await cluster.nodes_manager.initialize(last_failed_node_name=failed)
            except (RedisError, OSError) as exc:
                log.warning("reading the Redis Cluster slot map failed: %s", exc)
            finally:
                self._map_read_at = time.monotonic()
            self.slot_map_reads += 1

    async def aclose(self) -> None:
        """Stop sending; pipelines on the wire are let finish (they are bounded)."""
        self._closed = True
        for call in self._pending:
            if not call.future.done():
                call.future.set_exception(RedisError("the Redis client is closed"))
        self._pending.clear()
        if self._sending:
            await asyncio.wait(list(self._sending), timeout=5)


def _resend(cluster: RedisCluster, call: _Call, node: str, timed_out: bool) -> bool:
    """Whether a call `node` did not answer may fare better now: its slot is elsewhere in
    the map just read, or the connection failed and a fresh one may reach the node (it
    restarted). A node that let the round trip run out of time is not asked twice."""
    now = cluster.get_node_from_key(call.keys[0])
    return (now is not None and now.name != node) or not timed_out


def _settle(call: _Call, reply: Any) -> None:
    future = call.future
    if call.due != math.inf:
        Sweep.of(future.get_loop()).tracked.discard(call)
    if future.done():  # cancelled, or timed out: nobody is waiting for this reply
        if call.on_late is not None and not isinstance(reply, Exception):
            try:
                call.on_late(reply)
            except Exception:
                log.exception("handling a late Redis reply failed")
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


async def _round_trip(conn: Any, packed: bytes, count: int) -> list[Any]:
    """Send `count` packed commands on `conn` and read their replies, an error reply in
    its place; a connection that failed mid-way is closed (it reconnects on next use)."""
    try:
        await conn.connect()
        await conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        async with asyncio.timeout(conn.socket_timeout):  # one for the batch, not each
            for _ in range(count):
                try:
                    replies.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:  # one script's error; the rest follow
                    replies.append(exc)
        return replies
    except BaseException:
        await conn.disconnect()
        raise


def _packed(call: _Call) -> bytes:
    """One EVALSHA in the Redis protocol (RESP)."""
    words = [call.script.sha.encode(), b"%d" % len(call.keys)]
    words += [_word(a) for a in call.keys]
    words += [_word(a) for a in call.args]
    head = b"*%d\r\n$7\r\nEVALSHA\r\n" % (len(words) + 1)
    return head + b"".join(b"$%d\r\n%b\r\n" % (len(w), w) for w in words)


def _word(value: Arg) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    return repr(value).encode()  # a float, exactly


def forget(future: asyncio.Future[Any]) -> None:
    """Send and forget: a failure is not worth a warning that nobody read it."""
    future.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def batcher_of(redis: RedisBatcher | aioredis.Redis) -> RedisBatcher:
    """The batcher to send through: the one given, or a new one over a bare client."""
    return redis if isinstance(redis, RedisBatcher) else RedisBatcher(redis)
