"""A streaming request's reservation grows with its answer.

A request reserves its prompt and the output it will likely generate (gateway/
output_lengths.py). While it streams, the relay shows every batch of events it passes on
to `Growth.seen`, which counts the tokens generated: vLLM sends one SSE event per token
and choice (a stream's first event, its role, and its last, the usage, are counted too,
which errs on the side of more). When the longest choice passes what is reserved, the
reservation is extended to the next whole block of each choice, over the backend's limit
if need be: the request is running already, and new admissions see the room it took. With
`headroom`, the reservation keeps that many tokens per choice beyond the blocks it holds
(in tokens, not rounded up to a block: the backend allocates only the blocks).
"""

from __future__ import annotations

import re

from gateway.admission.ledger.held import HeldReservation

_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{\s*"index"\s*:\s*(\d+)')


class Growth:
    # one per streaming request
    __slots__ = (
        "_block",
        "_counts",
        "_covered",
        "_headroom",
        "_held",
        "_prompt",
        "_sequences",
    )

    def __init__(
        self,
        *,
        held: HeldReservation,
        prompt_tokens: int,
        sequences: int,
        block_size: int,
        headroom: int = 0,
    ) -> None:
        reservation = held.reservation
        assert reservation is not None
        self._held = held
        self._prompt = prompt_tokens
        self._headroom = headroom
        self._sequences = sequences
        self._block = block_size
        # the tokens of one sequence the reservation covers, and the tokens each choice made
        self._covered = reservation.tokens // sequences
        self._counts = [0] * sequences

    @property
    def generated(self) -> int:
        """The output tokens of the longest choice so far."""
        return max(self._counts)

    def seen(self, out: bytes, events: int | None = None) -> bool:
        """Count the events of `out` (`events` of them, where the relay counted them
        already); whether the reservation must grow now."""
        if self._sequences == 1:
            self._counts[0] += out.count(b"data:") if events is None else events
        else:
            for index in _CHOICE.findall(out):
                i = int(index)
                if i < self._sequences:
                    self._counts[i] += 1
        return self._prompt + max(self._counts) + self._headroom > self._covered

    async def grow(self) -> None:
        """Extend the reservation to cover the longest choice, in whole blocks per choice,
        and the headroom."""
        need = self._prompt + max(self._counts)
        covered = -(-need // self._block) * self._block + self._headroom
        added = (covered - self._covered) * self._sequences
        self._covered = covered
        await self._held.grow(added)
