"""The prompt blocks that requests in flight hold on each backend, counted once.

An engine with prefix caching (vLLM's default) holds a prompt's full blocks once, however
many running requests begin with them: each block has a reference count, and when its last
holder ends it goes to the evictable queue, cached but no longer in use. One application's
system prompt in front of every request is held once per engine, and each request adds only
its own remainder and output. The ledger counts the same way: a request's reservation on a
backend is its whole size less the shared blocks that another holder there already holds.

Which blocks a request shares, worked out once as it is prepared (gateway/front/prepare.py):

- with the prompt's token ids (a pool that tokenizes, gateway/admission/prompt_tokens.py;
  `token_blocks`), its full blocks exactly as the engine keys them, all but a block that
  ends the prompt (the engine computes a prompt's last token again, so a prompt cached
  whole is not wholly shared);
- otherwise from the prompt's bytes, keyed as prefix routing keys them
  (gateway/admission/routing/prefix_index.py; `byte_blocks`): the keyed bytes' share of the
  prompt's bytes, times the prompt's estimated tokens, is what they cover in whole blocks,
  never more than the keys. So the credit is counted as the request's own size is (by the
  pool's learned characters per token), and bytes that are not text (JSON escapes,
  multibyte characters) cover no more tokens than their characters do: a request never
  holds less than its own estimate's remainder. A guess must err towards reserving more,
  never towards admitting past the cache, so a block is given back as margin for where the
  engine's block boundary falls; what that over-counts, the fill calibration may correct
  from what the backend reports (gateway/admission/fleet/fill.py).

A request of several choices (`n`) shares nothing here: each choice is reserved whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from gateway.admission.routing import kv_index, prefix_index
from gateway.request import NO_BLOCKS, SharedBlocks


def byte_blocks(
    keys: Sequence[bytes], *, prompt_bytes: int, prompt_tokens: int, block_size: int
) -> SharedBlocks:
    """The shared blocks of a prompt of `prompt_bytes` bytes and `prompt_tokens` estimated
    tokens, whose byte-keyed blocks of `block_size` are `keys` (prefix_index.block_keys)."""
    if not keys or prompt_bytes <= 0:
        return NO_BLOCKS
    # the estimate's whole blocks in the keyed bytes (a key: CHARS_PER_TOKEN x block_size)
    covered = prompt_tokens * len(keys) * prefix_index.CHARS_PER_TOKEN // prompt_bytes
    count = min(len(keys), covered) - 1  # one block of margin: the boundary is a guess
    return SharedBlocks(tuple(keys[:count]), block_size) if count > 0 else NO_BLOCKS


def token_blocks(
    token_ids: Sequence[int], *, block_size: int, adapter: str | None = None
) -> SharedBlocks:
    """The shared blocks of a prompt of `token_ids`, exactly as the engine keys them (a
    LoRA `adapter`'s apart from the model's and every other adapter's, as the engine's)."""
    exact: Sequence[Hashable] = kv_index.block_keys(token_ids[:-1], block_size)
    if adapter is not None:
        exact = [(adapter, key) for key in exact]
    return SharedBlocks(tuple(exact), block_size) if exact else NO_BLOCKS


class Holders:
    """Per backend, how many requests in flight hold each shared prompt block (the engine's
    reference count)."""

    def __init__(self) -> None:
        self._refs: dict[str, dict[Hashable, int]] = {}

    def cost(self, backend: str, tokens: int, shared: SharedBlocks) -> int:
        """What a reservation of `tokens`, `shared` among them, would add to `backend`'s
        tokens in flight now: the whole, less the shared blocks another holder holds there."""
        if not shared.keys:
            return tokens
        return tokens - shared.tokens + self.new_tokens(backend, shared)

    def new_tokens(self, backend: str, shared: SharedBlocks) -> int:
        """The tokens of `shared` that no request in flight holds on `backend` yet: what a
        new holder of them would allocate there."""
        if not shared.keys:
            return 0
        refs = self._refs.get(backend)
        if not refs:
            return shared.tokens
        return sum(key not in refs for key in shared.keys) * shared.block_tokens

    def hold(self, backend: str, shared: SharedBlocks) -> int:
        """One more holder of `shared` on `backend`; the tokens it newly holds there."""
        if not shared.keys:
            return 0
        refs = self._refs.setdefault(backend, {})
        added = 0
        for key in shared.keys:
            count = refs.get(key, 0)
            added += count == 0
            refs[key] = count + 1
        return added * shared.block_tokens

    def drop(self, backend: str, shared: SharedBlocks) -> int:
        """One holder of `shared` on `backend` fewer; the tokens no holder holds any more."""
        if not shared.keys:
            return 0
        refs = self._refs.get(backend, {})
        freed = 0
        for key in shared.keys:
            count = refs.get(key)
            if count is None:
                continue
            if count > 1:
                refs[key] = count - 1
            else:
                del refs[key]
                freed += 1
        return freed * shared.block_tokens
