"""The shared-prefix workload of `spillgate bench prefix` (loadtest/bench/prefix.py): tenants
with long system prompts holding chats, and the schedule their turns are sent in."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda",
         "sigma", "omega"]  # fmt: skip
ORDERS = ("random", "rounds")


@dataclass(frozen=True, kw_only=True)
class Plan:
    backends: int = 4
    tenants: int = 64
    system_tokens: int = 4096  # each tenant's system prompt, about
    chats: int = 6  # per tenant
    turns: int = 4  # per chat
    turn_tokens: int = 64  # each user turn and each (made-up) answer, about
    rate: float = 24.0  # requests per second
    max_tokens: int = 16
    kv_tokens: int = 131_072  # per backend
    speed: float = 1.0
    seed: int = 23
    # `random`: each request a random chat's next turn; `rounds`: rounds that hold every
    # tenant once in a shuffled order, each sending its next turn
    order: str = "random"
    concurrency: int = 0  # requests in flight at most, sent as earlier ones end; 0: at `rate`
    schedules: int = 1  # workloads one after another, of seeds `seed`, `seed` + 1, …


@dataclass(frozen=True, kw_only=True)
class Turn:
    at_s: float
    tenant: int
    chat: str
    messages: list[dict[str, str]]


def schedules(plan: Plan) -> list[Plan]:
    """The plan of each schedule the run measures: one seed each."""
    return [replace(plan, seed=plan.seed + k, schedules=1) for k in range(plan.schedules)]


def _text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of words (the simulator counts four characters a token)."""
    words: list[str] = []
    size = 0
    while size < tokens * 4:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)


@dataclass
class Chat:
    tenant: int
    name: str
    turns: list[list[dict[str, str]]]  # each turn's messages, in order


def workload(plan: Plan) -> list[Turn]:
    """Every chat's turns, in order within the chat, evenly spaced at `rate`: chats
    interleaved at random, or in rounds (`order`)."""
    rng = random.Random(plan.seed)
    chats = []
    for t in range(plan.tenants):
        system = {"role": "system", "content": f"tenant {t}: " + _text(rng, plan.system_tokens)}
        for c in range(plan.chats):
            history, turns = [system], []
            for _ in range(plan.turns):
                history = [*history, {"role": "user", "content": _text(rng, plan.turn_tokens)}]
                turns.append(history)
                answer = {"role": "assistant", "content": _text(rng, plan.turn_tokens)}
                history = [*history, answer]
            chats.append(Chat(tenant=t, name=f"{t}-{c}", turns=turns))
    order = _rounds(chats, plan, rng) if plan.order == "rounds" else _random(chats, plan, rng)
    return [
        Turn(at_s=i / plan.rate, tenant=chat.tenant, chat=chat.name, messages=messages)
        for i, (chat, messages) in enumerate(order)
    ]


def _random(
    chats: list[Chat], plan: Plan, rng: random.Random
) -> list[tuple[Chat, list[dict[str, str]]]]:
    order = []
    for _ in range(plan.tenants * plan.chats * plan.turns):
        chat = rng.choice([c for c in chats if c.turns])  # a random chat's next turn
        order.append((chat, chat.turns.pop(0)))
    return order


def _rounds(
    chats: list[Chat], plan: Plan, rng: random.Random
) -> list[tuple[Chat, list[dict[str, str]]]]:
    """A tenant's requests in its rounds: the first turn of each of its chats, then the
    second of each, and so on."""
    mine = [
        [(c, c.turns[n]) for n in range(plan.turns) for c in chats if c.tenant == t]
        for t in range(plan.tenants)
    ]
    order = []
    for r in range(plan.chats * plan.turns):
        order += [mine[t][r] for t in rng.sample(range(plan.tenants), plan.tenants)]
    return order
