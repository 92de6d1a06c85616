"""The drill's look at the batch tier, for a pool whose chain has the `batch` step.

At the spike's peak a few requests that may wait (`x-spillgate-batchable: true`) are sent
beside the drill's load: some should overflow into the batch tier (202, a batch object).
After the spike, every batch so made should complete once the pool has spare room again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from loadtest.drill.checks import Check

PROBES = 6  # batchable requests sent at the spike's peak
DONE = ("completed", "failed", "expired", "cancelled")


@dataclass(kw_only=True)
class BatchProbe:
    url: str
    key: str
    model: str
    statuses: list[int] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)

    def _client(self) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.key}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30.0)

    async def spike(self, *, after_s: float) -> None:
        """Send the probes `after_s` in (the spike's middle)."""
        await asyncio.sleep(after_s)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "This can wait for a quiet moment."}],
            "max_tokens": 16,
        }
        async with self._client() as client:
            answers = await asyncio.gather(
                *(self._send(client, body) for _ in range(PROBES)), return_exceptions=True
            )
        for answer in answers:
            if isinstance(answer, httpx.Response):
                self.statuses.append(answer.status_code)
                if answer.status_code == 202:
                    self.batches.append(answer.json()["id"])
            else:
                self.statuses.append(0)

    @staticmethod
    async def _send(client: httpx.AsyncClient, body: dict[str, object]) -> httpx.Response:
        headers = {"x-spillgate-batchable": "true"}
        return await client.post("/v1/chat/completions", json=body, headers=headers)

    async def drained(self, *, timeout_s: float) -> dict[str, str]:
        """Each batch's status, once all have ended or `timeout_s` has passed."""
        status = dict.fromkeys(self.batches, "unknown")
        deadline = time.monotonic() + timeout_s
        async with self._client() as client:
            while True:
                for batch_id in status:
                    if status[batch_id] not in DONE:
                        answer = await client.get(f"/v1/batches/{batch_id}")
                        if answer.status_code == 200:
                            status[batch_id] = answer.json()["status"]
                if all(s in DONE for s in status.values()) or time.monotonic() > deadline:
                    return status
                await asyncio.sleep(0.2)

    def checks(self, status: dict[str, str]) -> list[Check]:
        accepted = len(self.batches)
        engaged = Check(
            passed=accepted > 0,
            name="overflow path 'batch' engaged",
            detail=(
                f"{accepted} of {len(self.statuses)} batchable requests at the spike's peak "
                "accepted as batches (202)"
                if accepted
                else f"no batchable request at the spike's peak was accepted as a batch "
                f"(statuses {sorted(self.statuses)}); did the spike reach the batch step?"
            ),
        )
        completed = sum(1 for s in status.values() if s == "completed")
        drained = Check(
            passed=completed == accepted,
            name="batch tier completed after the spike",
            detail=f"{completed} of {accepted} batches completed"
            + ("" if completed == accepted else f" (statuses {sorted(status.values())})"),
        )
        return [engaged, drained]
