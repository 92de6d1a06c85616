"""The workload of `spillgate bench kv-events` (loadtest/bench/kv_events.py), and the best
static placement of its tenants, found greedily and scored by replaying the workload through
one LRU cache of blocks a backend, as vLLM's prefix cache evicts.

Tenants of Zipf weights each have a long system prompt; a request is one of them with a
short new user message, its tenant drawn by weight. Their system prompts together are
several times the pool's KV cache, so every cache evicts. A share of the requests (`direct`)
goes straight to a backend, the same one for a tenant, past the gateway: cached there, and
evicting there, without the gateway's routing seeing it.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission.prompt_tokens import PromptTokenizer
from gateway.admission.routing.kv_index import block_keys
from loadtest.bench.tokenize import prose, system_prompt


@dataclass(frozen=True, kw_only=True)
class Plan:
    backends: int = 8
    kv_tokens: int = 16_384  # per backend
    block_size: int = 16  # the engines' (a real vLLM's CPU build: 128)
    tenants: int = 160
    system_tokens: int = 2048  # each tenant's system prompt, about
    user_tokens: int = 32
    zipf: float = 1.0  # tenant k's weight is 1 / k^zipf
    requests: int = 2400
    direct: float = 0.2  # the share sent straight to a backend
    concurrency: int = 24
    max_tokens: int = 8
    speed: float = 1.0  # the simulator's: an 8B model on an H100, in real time
    seed: int = 41


@dataclass(frozen=True, kw_only=True)
class Request:
    tenant: int
    direct: bool
    messages: list[dict[str, str]]


def weights(plan: Plan) -> list[float]:
    return [1 / (k + 1) ** plan.zipf for k in range(plan.tenants)]


def direct_home(tenant: int, backends: int) -> int:
    """Where a tenant's direct traffic goes: its own fixed backend."""
    return zlib.crc32(f"direct {tenant}".encode()) % backends


def sticky_home(tenant: int, backends: int) -> int:
    return zlib.crc32(str(tenant).encode()) % backends


def workload(plan: Plan, tokenizer: PromptTokenizer) -> list[Request]:
    rng = random.Random(plan.seed)
    systems = [
        f"tenant {t} {rng.random():.6f}: " + system_prompt(tokenizer, rng, plan.system_tokens)
        for t in range(plan.tenants)
    ]
    w = weights(plan)
    tenants = rng.choices(range(plan.tenants), weights=w, k=plan.requests)
    return [
        Request(
            tenant=t,
            direct=rng.random() < plan.direct,
            messages=[
                {"role": "system", "content": systems[t]},
                {"role": "user", "content": f"{i}: " + prose(rng, plan.user_tokens // 2)},
            ],
        )
        for i, t in enumerate(tenants)
    ]


class LruBlocks:
    """One engine's prefix cache as blocks, least recently used evicted first."""

    def __init__(self, blocks: int) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._room = blocks

    def serve(self, keys: Sequence[int]) -> int:
        """Blocks of `keys` found cached in a row; all of them cached after."""
        hit = 0
        while hit < len(keys) and keys[hit] in self._blocks:
            hit += 1
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self._room:
            self._blocks.popitem(last=False)
        return hit


def replay(
    plan: Plan, requests: Sequence[Request], keys: Sequence[list[int]], place: Sequence[int]
) -> float:
    """The prefix hit rate (cached tokens ÷ prompt tokens) of `requests`, tenant t's gateway
    traffic on backend place[t] and its direct traffic on its direct home."""
    caches = [LruBlocks(plan.kv_tokens // plan.block_size - 1) for _ in range(plan.backends)]
    hits = queries = 0
    for request, prompt in zip(requests, keys, strict=True):
        b = direct_home(request.tenant, plan.backends) if request.direct else place[request.tenant]
        hits += caches[b].serve(prompt) * plan.block_size
        queries += len(prompt) * plan.block_size + plan.user_tokens // 2
    return hits / queries if queries else 0.0


def greedy(plan: Plan, blocks_per_tenant: int, *, spread_cold: bool) -> list[int]:
    """Tenants by weight onto backends while their prompts fit (a tenant's direct home first:
    one copy serves both), the rest at their direct homes or spread evenly."""
    room = [plan.kv_tokens // plan.block_size - 1] * plan.backends
    # what in-flight requests keep of each cache beside the prefixes
    per_request = -(-(plan.user_tokens + plan.max_tokens + 64) // plan.block_size)
    room = [r - per_request * -(-plan.concurrency // plan.backends) for r in room]
    place = [0] * plan.tenants
    cold = 0
    for t in range(plan.tenants):  # weights fall with t
        home = direct_home(t, plan.backends)
        fits = [b for b in range(plan.backends) if room[b] >= blocks_per_tenant]
        if fits:
            b = home if home in fits else max(fits, key=lambda b: room[b])
            room[b] -= blocks_per_tenant
        elif spread_cold:
            b, cold = cold % plan.backends, cold + 1
        else:
            b = home
        place[t] = b
    return place


def best_static(
    plan: Plan, requests: Sequence[Request], tokenizer: PromptTokenizer
) -> tuple[list[int], float]:
    """The better of the greedy placements, and its hit rate replayed through LRU caches."""
    keys = [block_keys(tokenizer.chat({"messages": r.messages}) or [], plan.block_size)
            for r in requests]  # fmt: skip
    shared = min(len(k) for k in keys) - 1  # about a system prompt's blocks
    placed = [greedy(plan, shared, spread_cold=s) for s in (False, True)]
    scored = [(replay(plan, requests, keys, p), p) for p in placed]
    rate, place = max(scored)
    return place, rate
