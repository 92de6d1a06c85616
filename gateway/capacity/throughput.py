"""Sessions to tokens per second and TTFT: the steady state of a continuously batching engine.

The model, for a closed loop of `c` clients, each sending requests of P prompt and O output
tokens, against a replica that holds S such sessions in its KV cache (every block reserved,
a shared prompt's whole blocks once):

- B = min(c, S) sessions run (S capped at vLLM's max_num_seqs); the other c - B wait.
- A running session is on average half way through its output, so the batch's KV holds
  B x (P + O/2) tokens.
- Every engine step decodes one token for each running session, and (in the steady state) a
  session finishes, and a new one is prefilled, every O steps; so one step costs
  T(B) = decode_step(B x (P + O/2)) + (B / O) x prefill(P).
- Output tokens/s = B / T(B); inter-token latency = T(B).
- TTFT = (1 - 1/B) x T(B)/2 + prefill(P) + T(B) for a session that finds a slot: the rest
  of the step in flight (none when it runs alone), then the step that holds its prefill;
  beyond the KV bound, plus the wait for a slot: (c - B) / B x O x T(B), as each slot frees
  once every O steps.

The knee is the largest concurrency whose TTFT is at most KNEE_FACTOR x the TTFT of a single
session: past it, TTFT has more than doubled, from batching cost or from queueing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.capacity.catalog import CapacityError
from gateway.capacity.perf import ReplicaProfile

KNEE_FACTOR = 2.0


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Sessions of P prompt and O output tokens; a share of them (`shared_share`) open with
    the same `shared_prompt_tokens` of their prompt, which vLLM's prefix cache holds once."""

    prompt_tokens: int
    output_tokens: int
    shared_prompt_tokens: int = 0
    shared_share: float = 1.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise CapacityError("prompt and output tokens must each be at least 1")
        if self.shared_prompt_tokens < 0:
            raise CapacityError(
                f"--shared-prompt-tokens must be at least 0, not {self.shared_prompt_tokens}"
            )
        if self.shared_prompt_tokens >= self.prompt_tokens:
            raise CapacityError(
                f"--shared-prompt-tokens ({self.shared_prompt_tokens}) must be less than "
                f"--prompt-tokens ({self.prompt_tokens}): each request has tokens of its own "
                "after the prompt it shares"
            )
        if not 0 <= self.shared_share <= 1:
            raise CapacityError(f"--shared-share must be in [0, 1], not {self.shared_share:g}")

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def mean_kv_tokens(self) -> float:
        return self.prompt_tokens + self.output_tokens / 2


@dataclass(frozen=True, kw_only=True)
class LoadPoint:
    """The predicted steady state at one concurrency."""

    concurrency: int
    running: int
    step_s: float
    output_tokens_per_s: float
    ttft_s: float

    @property
    def itl_s(self) -> float:
        return self.step_s


def kv_bound(profile: ReplicaProfile, workload: Workload) -> int:
    sessions = profile.sessions_at_kv_bound(
        workload.tokens,
        shared_prompt_tokens=workload.shared_prompt_tokens,
        shared_share=workload.shared_share,
    )
    if sessions < 1:
        raise CapacityError(
            f"one session of {workload.tokens} tokens needs "
            f"{profile.blocks_per_session(workload.tokens)} blocks; the KV cache has "
            f"{profile.num_gpu_blocks}"
        )
    return sessions


def running_limit(profile: ReplicaProfile, workload: Workload) -> int:
    """Sessions that run at once: the KV bound, or vLLM's max_num_seqs when that is lower."""
    bound = kv_bound(profile, workload)
    return bound if profile.max_num_seqs is None else min(bound, profile.max_num_seqs)


def step_s(profile: ReplicaProfile, workload: Workload, running: int) -> float:
    cost = profile.step_cost
    decode = cost.decode_step_s(round(running * workload.mean_kv_tokens))
    return decode + running / workload.output_tokens * cost.prefill_s(workload.prompt_tokens)


def decode_only_step_s(profile: ReplicaProfile, workload: Workload, running: int) -> float:
    """A step of an engine that only decodes (a disaggregated decode engine): the batch's
    decode with no prefill in it, the prompts having been computed elsewhere."""
    return profile.step_cost.decode_step_s(round(running * workload.mean_kv_tokens))


def predict(profile: ReplicaProfile, workload: Workload, concurrency: int) -> LoadPoint:
    bound = running_limit(profile, workload)
    running = max(1, min(concurrency, bound))
    step = step_s(profile, workload, running)
    waiting = max(0, concurrency - running)
    wait = waiting / running * workload.output_tokens * step
    in_flight = (1 - 1 / running) * step / 2
    ttft = in_flight + profile.step_cost.prefill_s(workload.prompt_tokens) + step + wait
    return LoadPoint(
        concurrency=concurrency,
        running=running,
        step_s=step,
        output_tokens_per_s=running / step,
        ttft_s=ttft,
    )


def curve(
    profile: ReplicaProfile, workload: Workload, concurrencies: Iterable[int]
) -> list[LoadPoint]:
    return [predict(profile, workload, c) for c in concurrencies]


def knee(profile: ReplicaProfile, workload: Workload, *, factor: float = KNEE_FACTOR) -> int:
    """Largest concurrency with TTFT <= factor x TTFT(1); TTFT rises with concurrency."""
    limit = factor * predict(profile, workload, 1).ttft_s
    high = 2
    while predict(profile, workload, high).ttft_s <= limit:
        high *= 2
    return _most_within(profile, workload, limit_s=limit, low=high // 2, high=high)


def max_sessions_within(profile: ReplicaProfile, workload: Workload, *, ttft_s: float) -> int:
    """Most sessions one replica runs with TTFT within `ttft_s`; 0 when even one misses it."""
    bound = running_limit(profile, workload)
    if predict(profile, workload, 1).ttft_s > ttft_s:
        return 0
    return _most_within(profile, workload, limit_s=ttft_s, low=1, high=bound + 1)


def max_sessions_within_itl(
    profile: ReplicaProfile,
    workload: Workload,
    *,
    itl_s: float,
    step: Callable[[ReplicaProfile, Workload, int], float] = step_s,
) -> int:
    """Most sessions one replica runs with its step, the inter-token latency, within `itl_s`;
    0 when even one misses it. The step grows with the batch, so the bound is found by
    bisection; `step` is the unified engine's by default, `decode_only_step_s` for one that
    only decodes."""
    bound = running_limit(profile, workload)
    if step(profile, workload, 1) > itl_s:
        return 0
    low, high = 1, bound + 1
    while high - low > 1:
        mid = (low + high) // 2
        if step(profile, workload, mid) <= itl_s:
            low = mid
        else:
            high = mid
    return low


def _most_within(
    profile: ReplicaProfile, workload: Workload, *, limit_s: float, low: int, high: int
) -> int:
    """The most sessions whose TTFT is within `limit_s`, by bisection between `low` (within
    it) and `high` (past it): TTFT rises with the sessions running."""
    while high - low > 1:
        mid = (low + high) // 2
        if predict(profile, workload, mid).ttft_s <= limit_s:
            low = mid
        else:
            high = mid
    return low
