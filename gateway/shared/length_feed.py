"""The answer lengths of a pool as every replica of a shared-mode gateway saw them, in Redis.

A replica started in the middle of a spike (a deploy, an autoscaler adding one) has seen no
answer of its own, and would reserve the configured prior for each request until it had
`min_samples`. So every `every_s`, off the request path, each replica appends the lengths
its own answers had since its last pass to its pool's list (the last WINDOW kept: a few
KB) and, while its pool lacks answers of its own, reads the list back: one script call
that travels with the process's other Redis calls. A pool without enough answers of its
own reserves by it (gateway/admission/fleet/output_lengths.py). A replica reads it once before
it serves its first request. A pass lost to a slow or absent Redis only leaves the
borrowed lengths as they were.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.admission.fleet.backends import Pool
from gateway.admission.fleet.output_lengths import WINDOW, LengthSource
from gateway.redis_io.batch import BatchScript, RedisBatcher
from gateway.shared.feed import PoolPasses

KEY_PREFIX = "spillgate:lengths:"
# a pool no replica has answered for in a day keeps nothing: its model may have changed
TTL_S = 86_400
# one call per pool: append this replica's new lengths, keep the last WINDOW, and read them
# all back when asked (ARGV[3] = 1): a pool with enough answers of its own only shares
FEED_PASS = BatchScript(
    """
if #ARGV > 3 then
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 4))
  redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
if ARGV[3] == '1' then
  return redis.call('LRANGE', KEYS[1], 0, -1)
end
return {}
"""
)


def key(pool: str) -> str:
    """One key per pool, its own hash slot on a Redis Cluster."""
    return f"{KEY_PREFIX}{{{pool}}}"


class LengthFeed(PoolPasses[Pool]):
    """Shares each learning pool's new answer lengths and, while it lacks answers of its
    own, borrows the fleet's: a feed pass every `every_s`, the first before the first
    request."""

    def __init__(
        self,
        *,
        batcher: RedisBatcher,
        pools: Mapping[str, Pool],
        timeout_s: float,
        every_s: float = 2.0,
    ) -> None:
        self._batch = batcher
        self._timeout_s = timeout_s
        learns = {name: pool for name, pool in pools.items() if pool.outputs.learns()}
        super().__init__(self._pass_pool, learns, every_s=every_s, name="length-feed")

    async def _pass_pool(self, name: str, pool: Pool) -> None:
        new = pool.outputs.unshared()
        learning = pool.outputs.learning()
        if not new and not learning:
            return
        # with the other calls of the moment, in one pipeline (gateway/redis_io/batch.py)
        listed = await self._batch.submit(
            FEED_PASS,
            [key(name)],
            [WINDOW, TTL_S, int(learning), *new],
            budget_s=self._timeout_s,
        )
        if learning:
            pool.outputs.borrow(LengthSource.REPLICAS, _lengths(listed))


def _lengths(raw: list[bytes | str]) -> list[int]:
    """The list's entries that are lengths; anything else written there is skipped."""
    return [int(entry) for entry in raw if entry.isdigit()]
