"""The live progress line: elapsed time, requests sent and done, counts by outcome, lag."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from typing import TextIO

from loadtest.loadgen.client import Result

BAR_WIDTH = 24


class Progress:
    """Counts as the run goes; `run()` redraws one line on `stream` until cancelled."""

    def __init__(
        self, *, total: int, duration_s: float, label: str = "", stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.duration_s = duration_s
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.sent = 0
        self.done = 0
        self.outcomes: Counter[str] = Counter()
        self.max_lag_s = 0.0
        self._t0 = time.perf_counter()

    def on_sent(self, lag_s: float) -> None:
        self.sent += 1
        self.max_lag_s = max(self.max_lag_s, lag_s)

    def on_result(self, result: Result) -> None:
        self.done += 1
        self.outcomes[result.outcome] += 1

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.perf_counter()) - self._t0
        filled = round(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        head = f"{self.label} " if self.label else ""
        return (
            f"{head}[{bar}] {elapsed:5.1f}/{self.duration_s:.0f}s sent {self.sent}/{self.total} "
            f"done {self.done} in flight {self.sent - self.done} | {counts or '-'} "
            f"| max lag {self.max_lag_s * 1000:.0f} ms"
        )

    def draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self.line())
        self.stream.flush()

    async def run(self, interval_s: float = 0.5) -> None:
        self._t0 = time.perf_counter()
        try:
            while True:
                self.draw()
                await asyncio.sleep(interval_s)
        finally:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()
