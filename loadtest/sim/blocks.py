"""vLLM's KV block pool with prefix caching, without the GPU: which block holds what.

A full block of prompt tokens is named by a chain hash: its parent block's hash and its own
token ids, so the same tokens after a different prefix are a different block; a LoRA
adapter's blocks also hash its name and path, as vLLM's extra keys do, so they are never the
base model's or another adapter's. A partial block has no hash and is never shared.

Blocks nobody holds wait in one free queue, least recently freed first. A free block keeps
its cached contents until the allocator takes it from the front of the queue; only then is
its hash forgotten. A prefix hit on a free block takes it out of the queue again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from loadtest.sim.config import Adapter

# the first block's parent: any fixed value serves, since one replica only compares its own
ROOT_HASH = 0


def hash_blocks(
    token_ids: Sequence[int], block_size: int, *, adapter: Adapter | None = None
) -> list[int]:
    """The chain hash of each full block of `token_ids`, computed for `adapter` when given.

    Python's tuple hash of ints is the same in every process and fast; a 64-bit collision
    between two prompts a simulated replica sees is not a risk worth sha256's cost.
    """
    hashes: list[int] = []
    parent = ROOT_HASH
    extra = None if adapter is None else adapter.hash_key
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = hash((parent, block)) if extra is None else hash((parent, block, extra))
        hashes.append(parent)
    return hashes


class BlockEvents(Protocol):
    """Told of what the prefix cache names and forgets, as vLLM's KV events tell it."""

    def stored(
        self,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        adapter: Adapter | None,
    ) -> None: ...

    def removed(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


class BlockPool:
    """`num_blocks` blocks, each held by some sequences (a reference count) or free."""

    def __init__(self, num_blocks: int, *, events: BlockEvents | None = None) -> None:
        self.events = events
        # the free queue: allocation takes from the front, release appends at the back
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> the block holding it

    @property
    def num_free(self) -> int:
        """Blocks nobody holds, cached or not: what the allocator may still hand out."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def cached_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """The blocks holding the longest run of `block_hashes` from the first one."""
        blocks: list[int] = []
        cached = self._cached
        for block_hash in block_hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody holds: taking them costs the free queue as much."""
        refs = self._refs
        return sum(1 for block in blocks if refs[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Hold cached blocks for one more sequence, out of the free queue if they were in it."""
        refs, free = self._refs, self._free
        for block in blocks:
            if refs[block] == 0:
                del free[block]
            refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting what they cached."""
        if count > len(self._free):
            raise ValueError(f"{count} blocks asked for, {len(self._free)} free")
        free, refs, hash_of, cached = self._free, self._refs, self._hash_of, self._cached
        blocks: list[int] = []
        for _ in range(count):
            block, _ = free.popitem(last=False)
            block_hash = hash_of[block]
            if block_hash is not None:
                del cached[block_hash]
                hash_of[block] = None
                if self.events is not None:
                    self.events.removed(block_hash)
            refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(
        self,
        blocks: Sequence[int],
        block_hashes: Sequence[int],
        *,
        parent: int | None = None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
        adapter: Adapter | None = None,
    ) -> None:
        """Name freshly computed full blocks by their hashes, so later prompts can hit them;
        `parent` is the hash of the block before the first (None: the prompt's first), and
        `token_ids` the blocks' tokens, `block_size` each, and the `adapter` they were
        computed for, which the events tell.

        A hash another block already holds keeps that block: the copy stays unnamed and is
        freed as plain.
        """
        hash_of, cached = self._hash_of, self._cached
        run: list[int] = []  # blocks named in a row: one event, as vLLM's cache_full_blocks
        start = 0
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block_hash not in cached and hash_of[block] is None:
                cached[block_hash] = block
                hash_of[block] = block_hash
                if not run:
                    start = i
                run.append(block_hash)
            elif run:
                self._stored(run, start, block_hashes, parent, token_ids, block_size, adapter)
                run = []
        if run:
            self._stored(run, start, block_hashes, parent, token_ids, block_size, adapter)

    def _stored(
        self,
        run: list[int],
        start: int,
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        adapter: Adapter | None,
    ) -> None:
        if self.events is None:
            return
        before = parent if start == 0 else block_hashes[start - 1]
        ids = token_ids[start * block_size : (start + len(run)) * block_size]
        self.events.stored(run, before, ids, adapter)

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's `reset_prefix_cache`: only while no sequence
        holds a block (False otherwise, nothing forgotten)."""
        if len(self._free) != len(self._refs):
            return False
        self._cached.clear()
        self._hash_of = [None] * len(self._refs)
        if self.events is not None:
            self.events.cleared()
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one holder from each block; blocks left unheld join the back of the free queue.

        A sequence's last block goes first, as vLLM frees them: a prompt's tail is the part
        least likely to be shared, so it is the first evicted.
        """
        refs, free = self._refs, self._free
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                free[block] = None
