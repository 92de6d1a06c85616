"""How long a simulated answer runs: to its cap, or to a sampled end of sequence.

A real model ends an answer when it samples EOS (or one of the request's
`stop_token_ids`), and `max_tokens` only caps it. The simulator draws that end once, when
the request arrives:

- the model's own EOS: none in `max_tokens` mode (every answer runs to its cap, as random
  weights do); a geometric length (each token stops with probability 1 / mean, the shape
  real vLLM gives) or a lognormal one in the sampled modes; `ignore_eos` turns it off;
- each of `k` stop token ids among a vocabulary of `V` stops a token with probability
  `k / V`, in every mode, as with real random-weight vLLM (16 ids of ~4,096: mean ~256);
- `min_tokens` tokens come before either can end the answer.

An answer that reaches its cap first ends with `length`, else with `stop` (its stop reason,
as vLLM reports it, is the stop id drawn, or none for EOS). A request that continues an
answer (its prompt holds the answer's first `given` words, loadtest/sim/tokens.py) gets the
rest of the answer its first request would have got: the whole is drawn, capped at `given`
+ its `max_tokens`, so an answer cut short and continued with `max_tokens` less the words
given ends where and as it would have ended uncut. A request's
`seed` makes its lengths reproducible (choice `i` of `n` draws from `seed:i`); without one
they come from the replica's own generator (seeded by its config, when given).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_MEAN_TOKENS = 256.0  # real vLLM stopping on 16 of ~4,096 ids: mean 261, p50 168
DEFAULT_SIGMA = 1.0
DEFAULT_VOCAB_SIZE = 32_000  # a Llama-2 vocabulary; --vocab-size sets the real one


class AnswerLengths(StrEnum):
    MAX_TOKENS = "max_tokens"  # no EOS of the model's own: every answer runs to its cap
    GEOMETRIC = "geometric"
    LOGNORMAL = "lognormal"


class Finish(StrEnum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, kw_only=True)
class StopRule:
    """What a request says about ending its answer."""

    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # distinct ids
    min_tokens: int = 0
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class Answer:
    tokens: int
    finish: Finish
    stop_reason: int | None = None  # the stop token id that ended it; None: EOS or length


def geometric(rng: random.Random, p: float) -> int:
    """Tokens up to and including the first that stops, each stopping with probability p."""
    if p >= 1:
        return 1
    u = 1.0 - rng.random()  # (0, 1]: log(u) is finite
    return int(math.log(u) / math.log1p(-p)) + 1


class LengthSampler:
    def __init__(
        self,
        *,
        mode: AnswerLengths,
        mean_tokens: float = DEFAULT_MEAN_TOKENS,
        sigma: float = DEFAULT_SIGMA,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        rng: random.Random | None = None,
    ) -> None:
        if mean_tokens < 1 or sigma <= 0 or vocab_size < 1:
            raise ValueError("mean_tokens must be at least 1; sigma and vocab_size positive")
        self.mode = mode
        self._mean = mean_tokens
        self._sigma = sigma
        self._vocab = vocab_size
        self._rng = rng or random.Random()

    def answer(self, *, cap: int, rule: StopRule, index: int = 0, given: int = 0) -> Answer:
        """What choice `index` generates, at most `cap` tokens, after the `given` tokens of
        its answer the prompt already holds. An end drawn among those (the model would have
        stopped already) ends it at its first token."""
        whole = self._whole(cap=given + cap, rule=rule, index=index)
        if given == 0:
            return whole
        if whole.tokens > given:
            return Answer(
                tokens=whole.tokens - given, finish=whole.finish, stop_reason=whole.stop_reason
            )
        return Answer(tokens=1, finish=Finish.STOP, stop_reason=whole.stop_reason)

    def _whole(self, *, cap: int, rule: StopRule, index: int) -> Answer:
        rng = self._rng if rule.seed is None else random.Random(f"{rule.seed}:{index}")
        eos = None if rule.ignore_eos else self._eos(rng)
        by_id, stop_id = None, None
        if rule.stop_token_ids:
            k = len(rule.stop_token_ids)
            by_id = geometric(rng, min(1.0, k / self._vocab))
            stop_id = rule.stop_token_ids[rng.randrange(k)]
        ends = [n for n in (eos, by_id) if n is not None]
        if not ends or rule.min_tokens + min(ends) >= cap:
            return Answer(tokens=cap, finish=Finish.LENGTH)
        if by_id is not None and (eos is None or by_id < eos):
            return Answer(tokens=rule.min_tokens + by_id, finish=Finish.STOP, stop_reason=stop_id)
        return Answer(tokens=rule.min_tokens + min(ends), finish=Finish.STOP)

    def _eos(self, rng: random.Random) -> int | None:
        if self.mode is AnswerLengths.GEOMETRIC:
            return geometric(rng, 1.0 / self._mean)
        if self.mode is AnswerLengths.LOGNORMAL:
            mu = math.log(self._mean) - self._sigma**2 / 2
            return max(1, round(rng.lognormvariate(mu, self._sigma)))
        return None
