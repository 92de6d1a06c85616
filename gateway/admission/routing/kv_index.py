"""The blocks each backend really holds, from its engine's own KV events.

vLLM publishes a `BlockStored` event for every full prompt block it caches and a
`BlockRemoved` when it evicts one (`AllBlocksCleared` when its prefix cache is reset); the
subscriber (gateway/admission/fleet/kv_events.py) hands them here, in order.

Keys. The engine names a block by a hash chained over its parent's: sha256 of a pickle by
default, but xxhash under `--prefix-caching-hash-algo xxhash` with a random per-process seed
unless PYTHONHASHSEED is shared, and cache salts, LoRA names and multimodal inputs mix extra
keys in. Recomputing those hashes would tie the gateway to one engine version and option
set, and would be impossible for a random seed. The events carry each stored block's token
ids and its parent's hash instead, so the index keys a block by its own chain over token ids
(`block_keys`: Python's hash of (parent key, a tuple of the block's ids), 64 bits, the same
function for the events and for a request's prompt) and keeps a map from the engine's hash to that
key, which is what a `BlockRemoved` names. That is exact for any hash algorithm and seed,
and costs one tuple hash a block. A block whose parent the index never saw (stored before
the subscriber caught up, beyond the replay buffer) cannot be keyed: it is remembered so its
removal is understood, but no prompt matches it. Blocks stored with extra keys (a cache
salt, a LoRA adapter, images) are left out: no plain prompt can hit them.

Scoring. A request matches on a backend as many of its leading blocks as the backend holds
in a row: what the engine's prefix cache would reuse. A prompt no backend holds any more
goes best where its first block was cached last (`stored_at`): traffic the gateway does not
route (sent straight to the engine, or by another replica) keeps bringing it there, and a
second copy elsewhere would only evict others' prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

MAX_BLOCKS = 4096  # a prompt's leading blocks that are keyed: past them nothing is chosen
ROOT = 0  # the first block's parent
FIRSTS_REMEMBERED = 16_384  # prompts' first blocks whose last store is remembered


def block_keys(token_ids: Sequence[int], block_size: int, *, parent: int = ROOT) -> list[int]:
    """The key of each full block of `token_ids`, chained from `parent`."""
    ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
    keys: list[int] = []
    whole = min(len(ids) // block_size, MAX_BLOCKS) * block_size
    for start in range(0, whole, block_size):
        parent = hash((parent, ids[start : start + block_size]))
        keys.append(parent)
    return keys


class Stored(msgspec.Struct, tag="BlockStored"):
    """Full blocks the engine cached: their engine hashes, in order, their parent's hash
    (None for a prompt's first block) and their token ids, `block_size` each. A msgspec
    struct in vLLM's wire names, so the subscriber decodes a batch straight into these (the
    fields past `block_size` only say whether the engine's own cache holds them)."""

    block_hashes: Sequence[bytes | int]
    parent: bytes | int | None = msgspec.field(name="parent_block_hash")
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: Sequence[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


Event = Stored | Removed | Cleared


class BackendBlocks:
    """One backend's cached blocks, as its events tell them."""

    def __init__(self) -> None:
        self._key_of: dict[bytes | int, int | None] = {}  # engine hash → our key (None: unkeyed)
        self._held: dict[int, int] = {}  # key → engine blocks holding it
        self.block_size: int | None = None  # learned from the events
        # a prompt's first block → when it was last stored (kept past its eviction)
        self._first_stored: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        """Blocks the engine holds that a prompt can match."""
        return len(self._held)

    def apply(self, events: Iterable[Event], *, at: float = 0.0) -> None:
        """Events of one batch, in order; `at`: when it arrived."""
        for event in events:
            if isinstance(event, Stored):
                self._stored(event, at)
            elif isinstance(event, Removed):
                self._removed(event.block_hashes)
            else:
                self.clear()

    def clear(self) -> None:
        self._key_of.clear()
        self._held.clear()

    def _stored(self, event: Stored, at: float) -> None:
        size = event.block_size
        self.block_size = size
        if event.parent is None:
            parent: int | None = ROOT
        else:
            parent = self._key_of.get(event.parent)
        ids = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            block = tuple(ids[i * size : (i + 1) * size])
            if parent is not None and len(block) == size:
                first = parent == ROOT
                parent = hash((parent, block))
                self._held[parent] = self._held.get(parent, 0) + 1
                if first:
                    self._remember(parent, at)
            else:
                parent = None
            previous = self._key_of.get(engine_hash)
            if previous is not None:  # stored twice: keep one count
                self._drop(previous)
            self._key_of[engine_hash] = parent

    def _removed(self, block_hashes: Iterable[bytes | int]) -> None:
        for engine_hash in block_hashes:
            key = self._key_of.pop(engine_hash, None)
            if key is not None:
                self._drop(key)

    def _drop(self, key: int) -> None:
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def _remember(self, first: int, at: float) -> None:
        self._first_stored[first] = at
        self._first_stored.move_to_end(first)
        if len(self._first_stored) > FIRSTS_REMEMBERED:
            self._first_stored.popitem(last=False)

    def stored_at(self, first: int) -> float | None:
        """When the prompt's first block `first` was last stored here, held or evicted since."""
        return self._first_stored.get(first)

    def matched(self, keys: Sequence[int]) -> int:
        """How many of the leading blocks `keys` the engine holds, in a row."""
        held = self._held
        for n, key in enumerate(keys):
            if key not in held:
                return n
        return len(keys)
