"""What each scheduled request asks for: tenant, prompt and output lengths, stream or not.

Length distributions are written as `KIND:ARGS`: `fixed:128` (or just `128`),
`uniform:64:512`, `normal:MEAN:SD`, `lognormal:MEDIAN:SIGMA`, `exponential:MEAN`.
Draws are whole tokens, at least 1 and at most the distribution's `cap`.

A prefix-sharing workload gives each tenant a system prompt of its own, the same text in
every request of that tenant, and may hold multi-turn chats whose later turns resend the
earlier ones: what a prefix cache, and routing to it, exist for.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# The simulator (and vLLM's chat template, roughly) counts ceil(chars / 4) per message plus
# 4 per message and 3 per prompt; this is the fixed part for one user message.
MESSAGE_OVERHEAD_TOKENS = 4
PROMPT_OVERHEAD_TOKENS = MESSAGE_OVERHEAD_TOKENS + 3
CHARS_PER_TOKEN = 4
_WORDS = ("lorem", "ipsum", "dolor", "sitam", "conse", "adipi", "elits", "seddo", "eiusm")


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    kind: str
    a: float
    b: float = 0.0
    cap: int = 32_768

    @classmethod
    def parse(cls, spec: str, *, cap: int = 32_768) -> LengthDist:
        kind, _, rest = spec.partition(":")
        if not rest and kind.replace(".", "", 1).isdigit():
            kind, rest = "fixed", kind
        args = [float(x) for x in rest.split(":")] if rest else []
        need = {"fixed": 1, "exponential": 1, "uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in need:
            raise ValueError(f"unknown length distribution {spec!r} (known: {', '.join(need)})")
        if len(args) != need[kind] or any(x < 0 for x in args):
            raise ValueError(f"{spec!r}: {kind} takes {need[kind]} non-negative number(s)")
        return cls(kind=kind, a=args[0], b=args[1] if len(args) > 1 else 0.0, cap=cap)

    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b * self.b / 2)
        return self.a

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(max(self.a, 1e-9)), self.b)
        else:
            value = rng.expovariate(1.0 / max(self.a, 1e-9))
        return max(1, min(self.cap, round(value)))

    def __str__(self) -> str:
        if self.kind in ("fixed", "exponential"):
            return f"{self.kind}:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True, kw_only=True)
class TenantKey:
    name: str
    key: str

    @classmethod
    def parse_all(cls, specs: Sequence[str]) -> list[TenantKey]:
        """`KEY` or `NAME=KEY`, one per tenant; unnamed tenants are t0, t1, ..."""
        out = []
        for i, spec in enumerate(specs):
            name, sep, key = spec.partition("=")
            out.append(cls(name=name, key=key) if sep else cls(name=f"t{i}", key=spec))
        return out


@dataclass(frozen=True, kw_only=True)
class Workload:
    """`max_tokens`, when set, is what every request asks for, and its answer ends where the
    model ends it (realistic lengths); else each asks a draw of `output_tokens`.
    `ignore_eos` makes every answer run to its max_tokens (fixed lengths); `seeded` gives
    request i the seed `seed * 1_000_000 + i`, so two runs get the same answers."""

    model: str
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    tenants: Sequence[TenantKey]
    max_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seeded: bool = False
    stream_fraction: float = 1.0
    repeat_fraction: float = 0.0  # share of requests drawn from a few fixed greedy prompts
    repeat_prompts: int = 4
    prime_repeats: bool = False  # send each fixed request first, so a cache holds its answer
    endpoint: str = "chat"  # chat | completions
    shared_prefix_tokens: int = 0  # each tenant's own system prompt, about; 0: none
    turns: int = 1  # requests per chat; each later turn resends the chat so far


Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True, kw_only=True)
class PlannedRequest:
    index: int
    at_s: float
    tenant: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    repeated: bool  # a fixed greedy prompt another request also sends (cacheable)
    text: str  # the new user message
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    system: str = ""  # the tenant's system prompt, sent first when not empty
    history: tuple[Message, ...] = ()  # the chat's earlier turns, resent in order

    def messages(self) -> list[dict[str, Any]]:
        """The chat as sent: system prompt, earlier turns, then the new user message."""
        head = [("system", self.system)] if self.system else []
        return [
            {"role": role, "content": content}
            for role, content in [*head, *self.history, ("user", self.text)]
        ]

    def prompt(self) -> str:
        """The same, as one completion prompt."""
        return "\n\n".join(m["content"] for m in self.messages())


def prompt_text(tokens: int, *, salt: str) -> str:
    """About `tokens` prompt tokens as the simulator counts them; `salt` makes it unique."""
    return message_text(max(1, tokens - PROMPT_OVERHEAD_TOKENS), salt=salt)


def message_tokens(content: str) -> int:
    """What one chat message costs in the prompt, as the simulator counts it."""
    return -(-len(content) // CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS


def message_text(tokens: int, *, salt: str) -> str:
    """A message body of `tokens` tokens, as the simulator counts them."""
    chars = max(1, tokens) * CHARS_PER_TOKEN
    head = f"[{salt}] "
    words: list[str] = []
    size = len(head)
    i = 0
    while size < chars:
        word = _WORDS[i % len(_WORDS)]
        words.append(word)
        size += len(word) + 1
        i += 1
    return (head + " ".join(words))[:chars]


def system_prompt(tokens: int, *, tenant: str, seed: int) -> str:
    """A tenant's system prompt, `tokens` long as a message: words drawn from a generator
    seeded by the run's seed and the tenant's name, so every request of the tenant (and
    every run with that seed) sends the same text, and no two tenants share a prefix."""
    rng = random.Random(f"system-prompt/{seed}/{tenant}")
    chars = max(1, tokens - MESSAGE_OVERHEAD_TOKENS) * CHARS_PER_TOKEN
    words = [f"[{tenant}]"]
    size = len(words[0])
    while size < chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


def _draw(
    rng: random.Random,
    workload: Workload,
    *,
    index: int,
    salt: str,
    systems: Mapping[str, str],
) -> PlannedRequest:
    prompt = workload.prompt_tokens.draw(rng)
    drawn = workload.output_tokens.draw(rng)  # drawn either way: plans keep their prompts
    tenant = workload.tenants[rng.randrange(len(workload.tenants))].name
    system = systems.get(tenant, "")
    return PlannedRequest(
        index=index,
        at_s=0.0,
        tenant=tenant,
        prompt_tokens=prompt + (message_tokens(system) if system else 0),
        max_tokens=workload.max_tokens or drawn,
        stream=rng.random() < workload.stream_fraction,
        repeated=salt.startswith("repeat"),
        text=prompt_text(prompt, salt=salt),
        ignore_eos=workload.ignore_eos,
        stop_token_ids=workload.stop_token_ids,
        system=system,
    )


@dataclass(kw_only=True)
class _Chats:
    """Each tenant's open chat: a request of the tenant is its next turn until it has had
    `turns`, then the tenant's next request opens a new chat. The answers resent are made
    up (the plan is fixed before anything is sent), `answer_tokens` long each."""

    turns: int
    answer_tokens: int
    seed: int
    open: dict[str, tuple[Message, ...]]

    def next_turn(self, plan: PlannedRequest) -> PlannedRequest:
        history = self.open.pop(plan.tenant, ())
        if len(history) // 2 >= self.turns:
            history = ()
        answer = message_text(
            min(plan.max_tokens, self.answer_tokens), salt=f"answer-{self.seed}-{plan.index}"
        )
        self.open[plan.tenant] = (*history, ("user", plan.text), ("assistant", answer))
        earlier = sum(message_tokens(content) for _, content in history)
        return replace(plan, history=history, prompt_tokens=plan.prompt_tokens + earlier)


def parse_token_ids(spec: str) -> tuple[int, ...]:
    """`8-23` or `8,9,12-15`: token ids, in order, without repeats."""
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{spec!r}: token ids are N or N-M, comma-separated")
        ids += range(int(low), int(high if dash else low) + 1)
    return tuple(dict.fromkeys(ids))


def plan_requests(
    times: Sequence[float], workload: Workload, *, seed: int = 0
) -> list[PlannedRequest]:
    """One request per arrival time. Repeated ones copy one of a few fixed requests whole
    (tenant, prompt, lengths, stream flag), so a response cache can answer them; they are
    never a turn of a chat. A shared prefix and chats take no draws of their own, so the
    same seed plans the same arrivals, tenants and lengths with them or without."""
    rng = random.Random(seed + 1)
    systems = {}
    if workload.shared_prefix_tokens > 0:
        systems = {
            t.name: system_prompt(workload.shared_prefix_tokens, tenant=t.name, seed=seed)
            for t in workload.tenants
        }
    chats = _Chats(
        turns=workload.turns,
        answer_tokens=round(workload.output_tokens.mean()),
        seed=seed,
        open={},
    )
    fixed = [
        _draw(rng, workload, index=-1, salt=f"repeat-{seed}-{i}", systems=systems)
        for i in range(max(1, workload.repeat_prompts))
    ]
    plans = []
    for index, at in enumerate(times):
        if workload.prime_repeats and workload.repeat_fraction > 0 and index < len(fixed):
            plans.append(replace(fixed[index], index=index, at_s=at))
        elif rng.random() < workload.repeat_fraction:
            template = fixed[rng.randrange(len(fixed))]
            plans.append(replace(template, index=index, at_s=at))
        else:
            drawn = _draw(rng, workload, index=index, salt=f"req-{seed}-{index}", systems=systems)
            if workload.turns > 1:
                drawn = chats.next_turn(drawn)
            answer_seed = seed * 1_000_000 + index if workload.seeded else None
            plans.append(replace(drawn, at_s=at, seed=answer_seed))
    return plans
