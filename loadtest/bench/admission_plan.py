"""What `spillgate bench admission` sends: its seeded bursts, spike and warm-up, and the
system message its chats open with under `--shared-prompt`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loadtest.bench import admission_fleet as fleet
from loadtest.loadgen.workload import (
    CHARS_PER_TOKEN,
    MESSAGE_OVERHEAD_TOKENS,
    LengthDist,
    PlannedRequest,
    TenantKey,
    Workload,
    message_tokens,
    plan_requests,
)

PROMPT_MIXES = ("shared", "mixed")
# Words of three letters: with their space, four characters, one token as the simulator
# counts text and one token of the real vLLM's tiny byte-level BPE, so a system message
# is about as long on either backend.
_SYSTEM_WORDS = ("the", "for", "and", "not", "def", "any", "use", "may", "all", "key")


def system_text(tokens: int, *, label: str, seed: int) -> str:
    """A system message of about `tokens` tokens (with its chat framing): seeded words after
    `label`, which starts it, so messages of different labels share no block."""
    rng = random.Random(f"bench-admission-system/{seed}/{label}")
    chars = max(1, tokens - MESSAGE_OVERHEAD_TOKENS) * CHARS_PER_TOKEN
    words = [f"{label}:"]
    size = len(words[0])
    while size < chars:
        words.append(rng.choice(_SYSTEM_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


@dataclass(frozen=True, kw_only=True)
class BenchPlan:
    bursts: tuple[int, ...] = (24, 48)
    runs: int = 3
    spike_factor: int = 5  # the spike is this many times the smallest burst
    spike_window_s: float = 1.0  # over which the spike's requests arrive, evenly
    warmup: int = 64  # requests through each pool of the learning arms before measuring
    warmup_rate: float = 4.0  # per second: slow enough that the warm-up neither queues nor spills
    max_tokens: int = 2048
    prompt_tokens: str = "uniform:32:256"  # the user message's
    seed: int = 20
    shared_prompt: int = 0  # tokens of the system message each chat opens with; 0: none
    prompt_mix: str = "shared"  # which requests share it: see `open_chats`

    def workload(self, model: str) -> Workload:
        return Workload(
            model=model,
            prompt_tokens=LengthDist.parse(self.prompt_tokens),
            output_tokens=LengthDist.parse(str(self.max_tokens)),
            tenants=[TenantKey(name=fleet.TENANT, key=fleet.KEY)],
        )

    def burst(self, size: int, run: int, model: str) -> list[PlannedRequest]:
        return self.requests([0.0] * size, model, seed=self.seed + 100 * size + run)

    def spike(self, run: int, model: str) -> list[PlannedRequest]:
        size = self.spike_factor * min(self.bursts)
        times = [self.spike_window_s * i / size for i in range(size)]
        return self.requests(times, model, seed=self.seed + 7 + run)

    def warmup_requests(self, model: str) -> list[PlannedRequest]:
        times = [i / self.warmup_rate for i in range(self.warmup)]
        return self.requests(times, model, seed=self.seed - 1)

    def requests(self, times: Sequence[float], model: str, *, seed: int) -> list[PlannedRequest]:
        return self.open_chats(plan_requests(times, self.workload(model), seed=seed), seed=seed)

    def open_chats(self, plans: Sequence[PlannedRequest], *, seed: int) -> list[PlannedRequest]:
        """`plans` opened by a system message of `shared_prompt` tokens. `shared`: the same
        one in every chat of every run. `mixed`: a third of the chats open with message A, a
        third with B (as long), the rest each with one of their own, placed by `seed`; A and
        B are those of `shared` mode in every run, the others new in each."""
        if self.shared_prompt <= 0:
            return list(plans)
        common = {
            label: system_text(self.shared_prompt, label=label, seed=self.seed)
            for label in ("A", "B")
        }
        labels = ["A"] * len(plans)
        if self.prompt_mix == "mixed":
            third = len(plans) // 3
            labels = ["A"] * third + ["B"] * third + [""] * (len(plans) - 2 * third)
            random.Random(f"bench-admission-mix/{seed}").shuffle(labels)
        opened = []
        for plan, label in zip(plans, labels, strict=True):
            own = f"U{seed}-{plan.index}"
            system = common.get(label) or system_text(self.shared_prompt, label=own, seed=seed)
            prompt = plan.prompt_tokens + message_tokens(system)
            opened.append(replace(plan, system=system, prompt_tokens=prompt))
        return opened
