"""Which prompt prefixes each backend likely holds in its prefix cache.

vLLM caches a prompt's KV in whole blocks, each known by a hash of its tokens chained to
the hash of the block before, so two prompts share cached blocks exactly as far as their
leading blocks agree. The gateway cannot tokenize, so it approximates: the prompt as sent
(each chat message as its JSON, in order) is cut into blocks of `block_size` x
CHARS_PER_TOKEN bytes, and each block's key is a digest of everything up to its end. A
backend is assumed to hold the blocks of the prompts routed to it lately: a bounded LRU per
backend, about as many blocks as its KV cache holds, updated as requests are routed. It is
a guess (vLLM evicts under its own pressure, and traffic that bypasses the gateway is not
seen), which is why the router weighs it against load (gateway/admission/routing/router.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson

CHARS_PER_TOKEN = 4  # fixed, not the learned estimate: block keys must not move with it
MAX_BLOCKS = 512  # a prompt's leading blocks that are keyed; the rest adds nothing to choose by
MIN_ENTRIES = 1024  # a backend's index holds at least this many blocks
MAX_SESSIONS = 65_536  # sessions remembered per pool, the least recently seen dropped first


def prompt_bytes(body: dict[str, Any]) -> bytes:
    """The prompt as the bytes its prefix is keyed by: a chat's messages in order, each as
    JSON, or a completion's prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return b"".join(orjson.dumps(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    return orjson.dumps(prompt) if prompt is not None else b""


def block_keys(prompt: bytes, *, block_size: int, adapter: str | None = None) -> tuple[bytes, ...]:
    """One key per whole block of the prompt: a digest of the prompt up to the block's end,
    so a key matches only where everything before it matches too. A LoRA adapter's blocks
    are its own (the engine's block hash includes the adapter): its name opens the digest."""
    size = block_size * CHARS_PER_TOKEN
    whole = min(len(prompt) // size, MAX_BLOCKS)
    digest = hashlib.blake2b(digest_size=8)
    if adapter is not None:
        digest.update(adapter.encode() + b"\0")
    keys = []
    for start in range(0, whole * size, size):
        digest.update(prompt[start : start + size])
        keys.append(digest.copy().digest())
    return tuple(keys)


class PrefixIndex:
    """One pool's guess of the blocks each backend holds, where each session last went, and
    how often the guess expected the blocks it routed to be cached."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}  # backend → its blocks, LRU first
        self._sessions: OrderedDict[str, str] = OrderedDict()
        # blocks looked up and found on the backend each request was routed to
        self.queried: dict[str, int] = {}
        self.found: dict[str, int] = {}

    def matched(self, backend: str, keys: Sequence[bytes]) -> int:
        """How many of the leading blocks `keys` the backend likely holds."""
        held = self._held.get(backend)
        if not held or not keys or keys[0] not in held:
            return 0
        # leading blocks are held or not as a run: find its end by bisection
        low, high = 1, len(keys)
        while low < high:
            mid = (low + high + 1) // 2
            if keys[mid - 1] in held:
                low = mid
            else:
                high = mid - 1
        return low

    def hit_rate(self, backend: str) -> float | None:
        """The share of prompt blocks routed to `backend` the index expected it to hold."""
        queried = self.queried.get(backend, 0)
        return self.found.get(backend, 0) / queried if queried else None

    def session_backend(self, session: str | None) -> str | None:
        """The backend the session's last turn went to, if remembered."""
        return None if session is None else self._sessions.get(session)

    def routed(
        self, backend: str, keys: Sequence[bytes], *, session: str | None, blocks: int = 0
    ) -> Sequence[bytes]:
        """A request with prompt blocks `keys` went to `backend`, whose KV cache holds
        `blocks` blocks (0: unknown): from now on it holds them all, most recently used
        last, and the session's next turn looks for it there. Returns the keys the index
        did not expect the backend to hold (what other replicas have yet to hear of)."""
        if session is not None:
            self._sessions[session] = backend
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        found = self.matched(backend, keys)
        self.queried[backend] = self.queried.get(backend, 0) + len(keys)
        self.found[backend] = self.found.get(backend, 0) + found
        self.learn(backend, keys, blocks=blocks)
        return keys[found:]

    def learn(self, backend: str, keys: Sequence[bytes], *, blocks: int = 0) -> None:
        """`backend` holds the blocks `keys` (a leading run of a prompt's blocks, or its
        continuation), most recently used last; counted in no hit rate: another replica
        routed them."""
        held = self._held.setdefault(backend, OrderedDict())
        # last block first, so a prompt's tail is evicted before its head, as vLLM frees a
        # sequence's blocks, and what is held of a prompt stays a leading run
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        bound = max(MIN_ENTRIES, blocks)
        while len(held) > bound:
            held.popitem(last=False)
