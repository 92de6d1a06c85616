"""Each backend's KV events, heard off the request path: vLLM's ZMQ publisher and its replay.

The wire, as vLLM 0.32 publishes it (vllm/distributed/kv_events.py; a capture from a running
engine is tests/fixtures/vllm-0.32-kv-events.bin):

- a PUB socket (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`); each message is three
  frames: the topic, a sequence number (8 bytes, big-endian, from 0 for each publisher
  process), and a msgpack `KVEventBatch`: an array `[ts, events, data_parallel_rank]` whose
  events are maps tagged by `type`: `BlockStored` (`block_hashes`, `parent_block_hash`,
  `token_ids`, `block_size`, `medium`, `lora_name`, `extra_keys` one entry a block,
  `group_idx`, ...), `BlockRemoved` (`block_hashes`, `medium`, `group_idx`),
  `AllBlocksCleared`;
- the replay endpoint, a ROUTER socket: a DEALER sends `(b"", start)` (8 bytes, big-endian)
  and gets `(b"", topic, seq, payload)` for each batch the engine still buffers from `start`
  on (`buffer_steps`, 10,000 by default), then `(b"", b"", -1, b"")`.

Catching up. The view is rebuilt from the replay of all the engine buffers (from 0) when the
subscriber starts and whenever its socket connects again after losing the engine (which may
have restarted with an empty cache), and when a publisher starts its numbers again at 0. A
sequence number past the next one expected means batches were missed (ZMQ drops what a slow
subscriber cannot take): they are replayed, or, when the buffer no longer holds them all,
the view is rebuilt from what it holds. Without a replay endpoint the view is cleared
instead, and learns again from the next batch. Only the engine's own cache counts (medium
`GPU` or none, KV cache group 0): an offloading tier's events name the same hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.admission.routing.kv_index import BackendBlocks, Cleared, Event, Stored
from gateway.clock import Clock
from gateway.config import KvEventsSettings

log = logging.getLogger("spillgate")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_WAIT_S = 2.0  # for each reply of a replay
REPLAY_TOTAL_S = 10.0
POLL_MS = 1000
# ZMTP heartbeats on the SUB socket: an engine gone without closing its connection (its node
# lost, its pod replaced under the same name) stops answering them, the connection is
# dropped, and the view is out of use and rebuilt once the socket connects again, instead
# of staying connected to nothing and quiet. A quiet engine that is there answers them.
HEARTBEAT_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
YIELD_EVERY = 64  # batches applied between yields to the loop during a replay
# after taking what arrived, batches gather this long before the next wakeup: an engine
# publishes one every few milliseconds, and a poll and a receive for each batch of 8
# engines' was 4% of the gateway's CPU (BENCHMARKS.md), for a view fresher by less than
# a prefill takes
GATHER_S = 0.02


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_Batch)


def decode(payload: bytes) -> list[Event]:
    """The events of one batch that concern the engine's own prefix cache, decoded straight
    into the index's events (copying them over one by one cost three times the decoding)."""
    kept = [e for e in _decoder.decode(payload).events if _own_cache(e)]
    for e in kept:
        if isinstance(e, Stored) and (
            e.lora_name is not None or e.lora_id is not None or any(e.extra_keys or ())
        ):
            e.token_ids = ()  # salted, adapted or multimodal: no plain prompt matches them
    return kept


def _own_cache(e: Event) -> bool:
    """Whether `e` is of the engine's own cache (medium GPU, KV cache group 0), not an
    offloading tier's, which names the same hashes."""
    return isinstance(e, Cleared) or (e.medium in (None, "GPU") and e.group_idx in (None, 0))


@dataclass(eq=False)
class EventsView:
    """What the gateway knows of one backend's cache from its events, and how fresh it is."""

    blocks: BackendBlocks = field(default_factory=BackendBlocks)
    seq: int | None = None  # the last batch applied
    last_event_at: float | None = None  # clock.monotonic() of its arrival
    connected: bool = False
    gaps: int = 0  # times batches were missed
    rebuilds: int = 0  # times the view was built again from scratch

    def status(self, now: float) -> dict[str, object]:
        age = None if self.last_event_at is None else round(now - self.last_event_at, 3)
        return {
            "connected": self.connected,
            "last_seq": self.seq,
            "seconds_since_event": age,
            "blocks": len(self.blocks),
            "gaps": self.gaps,
            "rebuilds": self.rebuilds,
        }


class Subscriber:
    """One backend's events into its view, until cancelled."""

    def __init__(
        self,
        backend: str,
        settings: KvEventsSettings,
        view: EventsView,
        *,
        context: zmq.asyncio.Context,
        clock: Clock,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.view = view
        self._context = context
        self._clock = clock

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.settings.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll(POLL_MS))
                if monitor in ready:
                    await self._connection(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._drain(sub)
                    await asyncio.sleep(GATHER_S)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        """Every batch the socket holds, in order."""
        while True:
            try:
                _topic, seq, payload = await sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._take(int.from_bytes(seq, "big"), payload)

    async def _connection(self, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.view.connected = False
        elif event["event"] == zmq.EVENT_CONNECTED:
            # first or again (maybe a new engine): what it holds, from its buffer
            self.view.connected = True
            await self._rebuild()

    async def _take(self, seq: int, payload: bytes) -> None:
        view = self.view
        if view.seq is not None and seq <= view.seq:
            if seq == 0 and view.seq > 0:  # a publisher counting again from 0
                await self._rebuild()
            return  # already applied (replayed)
        if view.seq is not None and seq > view.seq + 1:
            view.gaps += 1
            log.info("kv events of %s: missed %d batches", self.backend, seq - view.seq - 1)
            await self._catch_up(view.seq + 1)
            if view.seq is not None and seq <= view.seq:
                return
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("kv events of %s: batch %d unreadable: %s", self.backend, seq, exc)
            events = []
        now = self._clock.monotonic()
        self.view.blocks.apply(events, at=now)
        self.view.seq = seq
        self.view.last_event_at = now

    async def _catch_up(self, start: int) -> None:
        batches = await self._replay(start)
        if batches is not None and batches and batches[0][0] == start:
            await self._apply_all(batches)
        else:
            await self._rebuild()

    async def _rebuild(self) -> None:
        """The view from scratch: the replay of all the engine buffers, else empty."""
        self.view.blocks.clear()
        self.view.seq = None
        self.view.rebuilds += 1
        batches = await self._replay(0)
        if batches:
            await self._apply_all(batches)

    async def _apply_all(self, batches: list[tuple[int, bytes]]) -> None:
        for i, (seq, payload) in enumerate(batches):
            if self.view.seq is None or seq > self.view.seq:
                self._apply(seq, payload)
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the engine still buffers from `start` on, in order (None: no replay
        endpoint, or it did not answer in time)."""
        if self.settings.replay is None:
            return None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.settings.replay)
            async with asyncio.timeout(REPLAY_TOTAL_S):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    if not await dealer.poll(REPLAY_WAIT_S * 1000):
                        raise TimeoutError
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[2] == END_SEQ:
                        return batches
                    batches.append((int.from_bytes(frames[2], "big"), frames[3]))
        except TimeoutError:
            log.info("kv events of %s: no replay from %s", self.backend, self.settings.replay)
            return None
        finally:
            dealer.close(linger=0)


class KvEvents:
    """The subscribers of every backend configured with KV events, one task each: started
    with the app and stopped with it. Each process subscribes on its own."""

    def __init__(
        self, subscriptions: dict[str, tuple[KvEventsSettings, EventsView]], *, clock: Clock
    ) -> None:
        self._subscriptions = subscriptions  # backend → (where, its view)
        self._clock = clock
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if not self._subscriptions:
            return
        self._context = zmq.asyncio.Context()
        for name, (settings, view) in self._subscriptions.items():
            subscriber = Subscriber(name, settings, view, context=self._context, clock=self._clock)
            task = asyncio.create_task(self._keep(subscriber), name=f"kv-events-{name}")
            self._tasks.append(task)

    async def _keep(self, subscriber: Subscriber) -> None:
        """Run a subscriber again a second after it fails: the events are worth waiting for."""
        while True:
            try:
                await subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("kv events of %s: %r; subscribing again", subscriber.backend, exc)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._context is not None:
            self._context.term()
            self._context = None
