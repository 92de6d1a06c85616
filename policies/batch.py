"""Accept into the batch tier: a request that says it may wait, answered 202 with a batch.

A request may wait when it carries `x-spillgate-batchable: true` or its tenant is
`batchable`. When its pool overflows up to this step, it becomes a one-item batch (run by
the batch runner once the pool has spare room, gateway/batch/runner.py) and the client gets
`202` with the batch object, whose output file will hold the answer. The outcome is
`queued`: the request waits for room, in the batch tier rather than in the pool's queue.
The tenant's bucket is refunded now and charged when the item runs, at its settlement.

A request that may not wait, or a batch the tenant's queued-token limit refuses, passes to
the next step.
"""

from __future__ import annotations

from typing import ClassVar

import orjson

from gateway.config import PoolSettings
from gateway.errors import SpillgateError
from gateway.outcome import Outcome
from gateway.overflow import BatchIntake, OverflowContext, Relayed, Served, Usage
from gateway.request import Endpoint, InferenceRequest
from policies.deps import PolicyDeps

BATCH_TARGET = "batch"  # the `target` a request accepted into the batch tier is served by


class BatchPolicy:
    name: ClassVar[str] = "batch"
    endpoints: ClassVar[frozenset[Endpoint]] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
    serves_elsewhere: ClassVar[bool] = False
    moves_streams: ClassVar[bool] = False

    def __init__(self, batches: BatchIntake | None) -> None:
        self._batches = batches

    @classmethod
    def build(cls, pool: PoolSettings, deps: PolicyDeps) -> BatchPolicy:
        return cls(deps.batches)

    async def decide(self, request: InferenceRequest, exchange: OverflowContext) -> Served | None:
        if not request.batchable or self._batches is None:
            return None
        try:
            batch = await self._batches.create_one(request)
        except SpillgateError:
            return None  # over the tenant's batch limits: the next step decides
        await exchange.send_json(orjson.dumps(batch), status=202, outcome=Outcome.QUEUED)
        # nothing was generated for it yet: the tenant's bucket gets the reservation back
        relayed = Relayed(
            usage=Usage(prompt_tokens=0, completion_tokens=0, known=True),
            first_byte_at=None,
            completed=True,
        )
        return Served(
            outcome=Outcome.QUEUED, target=BATCH_TARGET, pool=request.pool, relayed=relayed
        )
