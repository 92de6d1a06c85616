"""Prefix routing's pick: the backend likeliest to hold a request's prompt, weighed against
load (the `prefix` scorer of routing/plugins.py; the index is routing/prefix_index.py, or,
for a backend that publishes KV events, what it reports holding: `Held`).

The herding guard passes over a backend that taking the request would leave more than
PREFIX_SKEW times the pool's mean fill and more than PREFIX_SLACK above it, counting on
the backend:

- the tokens this prefix (its prompt's first block, else its session) has in flight there,
  while the backend's fill stays under PREFIX_FLOOR of the target fill: a hot prefix, one
  that alone would put a backend over its share of the pool's load, spreads over the
  backends, but a tenant's prompt stays where it is cached however the other tenants'
  requests fall (each prompt placed on two backends is one more prefill of it);
- every token in flight there, past PREFIX_FLOOR: a well-filled backend's load weighs
  more than a cached prefill, as far as the gateway's own index guesses it. A backend
  whose KV events say it holds most of the prompt is exempt: there the request costs a
  decode slot, while on another it is a whole prefill that evicts others' prompts, and
  the engine's report is no guess.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from gateway.admission.fleet.backends import Backend
from gateway.admission.fleet.kv_events import EventsView
from gateway.admission.ledger.reservations import InFlight
from gateway.admission.routing.kv_index import block_keys
from gateway.admission.routing.prefix_index import PrefixIndex
from gateway.admission.routing.route import Candidate

PREFIX_SKEW = 1.25
PREFIX_SLACK = 0.1
PREFIX_FLOOR = 0.5
Group = bytes | str  # a prompt's first block key, else its session


class Held:
    """How many of a prompt's leading tokens each backend holds in its prefix cache: what
    its KV events report (gateway/admission/routing/kv_index.py) where it publishes them and its
    subscriber is connected, else what the gateway's own index guesses from its routing."""

    def __init__(
        self,
        index: PrefixIndex,
        prefix: Sequence[bytes],
        *,
        events: Mapping[str, EventsView],
        token_ids: Sequence[int],
    ) -> None:
        self.index = index
        self._prefix = prefix
        self._events = events if token_ids else {}
        self._token_ids = token_ids
        self._keys: dict[int, list[int]] = {}  # block size → the prompt's block keys

    def tokens(self, backend: Backend) -> int:
        cached = self.cached(backend)
        if cached is not None:
            return cached
        return self.index.matched(backend.name, self._prefix) * backend.block_size

    def cached(self, backend: Backend) -> int | None:
        """The prompt's leading tokens the backend reports holding (None without a view of
        its events): blocks the engine shares, not allocated again for this request."""
        view = self._events.get(backend.name)
        if view is None or not view.connected:
            return None
        size = view.blocks.block_size or backend.block_size
        return view.blocks.matched(self._keys_of(size)) * size

    def stored_at(self, backend: Backend) -> float | None:
        """When the backend last reported caching the prompt's first block (None: never, or
        no view of its events)."""
        view = self._events.get(backend.name)
        if view is None or not view.connected:
            return None
        keys = self._keys_of(view.blocks.block_size or backend.block_size)
        return view.blocks.stored_at(keys[0]) if keys else None

    def _keys_of(self, size: int) -> list[int]:
        keys = self._keys.get(size)
        if keys is None:
            keys = self._keys[size] = block_keys(self._token_ids, size)
        return keys


def group_of(prefix: Sequence[bytes], session: str | None) -> Group | None:
    """What the prefix guard counts a request under."""
    return prefix[0] if prefix else session


class GroupLoads:
    """What each prefix group holds in flight on each backend, as this process reserved it
    (in shared mode, each replica counts its own: the pool's fill is shared): its requests'
    own tokens, and their shared prompt blocks once. Read from each reservation's one
    record, so a stream is counted at the size it has grown to."""

    def __init__(self) -> None:
        self._members: dict[tuple[str, Group], dict[str, InFlight]] = {}
        self._groups: dict[str, tuple[str, Group]] = {}  # reservation id → (backend, group)

    def held(self, backend: str, group: Group) -> int:
        members = self._members.get((backend, group))
        if not members:
            return 0
        own = shared = 0
        for record in members.values():
            own += record.reservation.own_tokens
            shared = max(shared, record.reservation.shared.tokens)
        return own + shared

    def add(self, record: InFlight, group: Group) -> None:
        rid = record.reservation.id
        where = (record.reservation.backend, group)
        self._members.setdefault(where, {})[rid] = record
        self._groups[rid] = where

    def remove(self, rid: str) -> None:
        where = self._groups.pop(rid, None)
        if where is None:
            return
        members = self._members[where]
        del members[rid]
        if not members:
            del self._members[where]


def by_prefix(
    candidates: Sequence[Candidate],
    *,
    tokens: int,
    prefix: Sequence[bytes],
    session: str | None,
    held: Held,
    loads: GroupLoads,
    target_fill: float,
) -> int:
    """The place in `candidates` (least filled first) of the backend that holds the
    request's session, else of the one likeliest to hold most of its prefix (ties: the
    least filled), among those the herding guard does not pass over. A prefix no backend
    holds goes where a request of it is in flight, else where the engines last reported
    caching it, else to the less filled of its two homes: the backends its first block's
    key ranks highest (rendezvous hashing), so replicas that keep their own indexes send a
    new prefix, and so its later requests, to the same two backends at most, while load
    still picks between them. 0, the least filled, when none of these applies."""
    capacity = sum(c.capacity for c in candidates)
    mean = (sum(c.fill * c.capacity for c in candidates) + tokens) / capacity
    group = group_of(prefix, session)
    mine = [0 if group is None else loads.held(c.backend.name, group) for c in candidates]
    floor = PREFIX_FLOOR * target_fill
    home = held.index.session_backend(session)
    best, most = 0, 0.0
    eligible = []
    for i, c in enumerate(candidates):
        adds = tokens - min(tokens, held.cached(c.backend) or 0)  # what it allocates there
        after = c.fill + adds / c.capacity
        # a backend that reports holding most of the prompt serves it for a decode slot,
        # where another would prefill it and evict others' prompts: its load does not
        # pass it over, only the prefix's own
        loaded = after > floor and _over(after, mean) and 2 * adds > tokens
        if _over((mine[i] + adds) / c.capacity, mean) or loaded:
            continue
        eligible.append(i)
        matched = math.inf if c.backend.name == home else held.tokens(c.backend)
        if matched > most:
            best, most = i, matched
    if not most and prefix and eligible:
        # where a request of the prefix is in flight (its prompt is being prefilled there,
        # cached before the engine tells it: a second copy elsewhere is one more prefill
        # and evicts others'), else where the engines last cached it (kv_index.py), else
        # its two homes, first first: the less filled, the first when equally filled
        pending = [i for i in eligible if mine[i]]
        stored = {
            i: at for i in eligible if (at := held.stored_at(candidates[i].backend)) is not None
        }
        if pending:
            best = max(pending, key=mine.__getitem__)
        elif stored:
            best = max(stored, key=stored.__getitem__)
        else:
            ranks = sorted(eligible, key=lambda i: _weight(prefix[0], candidates[i].backend.name))
            best = min(ranks[::-1][:2], key=lambda i: candidates[i].fill)
    return best


def _over(fill: float, mean: float) -> bool:
    return fill > max(mean * PREFIX_SKEW, mean + PREFIX_SLACK)


def _weight(key: bytes, backend: str) -> bytes:
    """A backend's rendezvous weight for a prefix's first block: the same on every replica."""
    return hashlib.blake2b(key + backend.encode(), digest_size=8).digest()
