"""The simulated engine's KV events, in vLLM 0.32's wire format (admission/fleet/kv_events.py
reads them; vllm/distributed/kv_events.py writes them for the real engine).

The block pool (loadtest/sim/blocks.py) tells `EventLog` what its prefix cache names and
forgets; `Publisher` sends what gathered since its last flush as one batch, a flush every few
milliseconds: on a PUB socket three frames (the topic, the batch's sequence number as 8 bytes
big-endian, the msgpack `[ts, events, data_parallel_rank]` whose events are maps tagged by
`type`), and keeps the last `buffer_steps` batches for its replay ROUTER socket, which answers
a start sequence number with each buffered batch from it and an end marker, as vLLM's does.
`drop_every` leaves every Nth batch out of the PUB socket (it stays in the replay buffer): a
subscriber that misses batches, as ZMQ drops them for one that falls behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from loadtest.sim.config import Adapter

log = logging.getLogger("spillgate.sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
FLUSH_S = 0.005


class EventLog:
    """Events of the block pool not yet published, in order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[dict[str, Any]] = []

    def stored(
        self,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        adapter: Adapter | None,
    ) -> None:
        """Blocks cached in a row by one step, as one event (vLLM's `cache_full_blocks`);
        evictions are one event a block, as vLLM's are. An adapter's blocks carry its
        `lora_id`, its `lora_name`, and its name as each block's extra key, as vLLM's do."""
        if adapter is None:
            lora_id, lora_name, extra = None, None, None
        else:
            lora_id, lora_name, extra = adapter.lora_id, adapter.name, [adapter.name]
        self.pending.append(
            {
                "type": "BlockStored",
                "block_hashes": list(block_hashes),
                "parent_block_hash": parent,
                "token_ids": list(token_ids),
                "block_size": self.block_size,
                "lora_id": lora_id,
                "medium": "GPU",
                "lora_name": lora_name,
                "extra_keys": [extra] * len(block_hashes),
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )

    def removed(self, block_hash: int) -> None:
        self.pending.append(
            {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}
        )

    def cleared(self) -> None:
        self.pending.append({"type": "AllBlocksCleared"})


class Publisher:
    """A PUB socket on `port` and a replay ROUTER on `replay_port`, both on `host`."""

    def __init__(
        self,
        log_: EventLog,
        *,
        host: str,
        port: int,
        replay_port: int,
        buffer_steps: int = 10_000,
        drop_every: int = 0,
    ) -> None:
        self._log = log_
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{host}:{port}")
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(f"tcp://{host}:{replay_port}")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._drop_every = drop_every

    def flush(self) -> None:
        """Publish what gathered as one batch, if anything did."""
        events, self._log.pending = self._log.pending, []
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        payload = self._encoder.encode([time.time(), events, 0])
        self._buffer.append((seq, payload))
        if self._drop_every and seq % self._drop_every == self._drop_every - 1:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def run(self) -> None:
        """Flush every FLUSH_S and answer replay requests, until cancelled."""
        replay = asyncio.create_task(self._serve_replay())
        try:
            while True:
                self.flush()
                await asyncio.sleep(FLUSH_S)
        finally:
            replay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replay

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    reply = (client, b"", b"", seq.to_bytes(8, "big"), payload)
                    await self._router.send_multipart(reply)
            await self._router.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._context.term()
