"""What each backend reports it holds, scraped every SCRAPE_S: the loop's other half; and
the one scrape of each backend's metrics page that every reader of it shares.

The ledger knows what the gateway reserved; the backend knows what it really holds,
including traffic that bypasses the gateway. Admission takes the larger of the two
(admission/routing/router.py), and a backend that preempts sequences or keeps requests waiting
lowers its effective fill (gateway/admission/fleet/fill.py).

vLLM: `vllm:kv_cache_usage_perc` (0..1), `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:num_preemptions_total` (a counter). SGLang:
`sglang:token_usage` (0..1), `sglang:num_running_reqs`, `sglang:num_queue_reqs`, and
`sglang:num_retracted_reqs` (requests it retracted, SGLang's preemption, a gauge: any is
taken as a preemption). Nothing running and nothing waiting is an idle backend, which ends
a back-off; a page without a running count never reads as idle. vLLM's prefix-cache counters
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, in tokens) are read too,
to show beside the prefix index's own guess (admission/routing/prefix_index.py). Engines of one
server (data parallel) are averaged for the usage and added up for the rest.

vLLM with LoRA: `vllm:lora_requests_info{max_lora,running_lora_adapters,...}` is a series per
set of adapters its steps have run, its value the time of the last step that ran that set:
the newest series names the adapters active now (comma-separated, running and waiting
labels alike) and `max_lora` the adapters a step may run at once. An adapter loaded but idle
is in no newer series, and the page has no such series until an adapter has run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from prometheus_client.samples import Sample

from gateway.admission.fleet.fill import FillReason
from gateway.admission.fleet.metrics_text import samples
from gateway.clock import Clock
from gateway.tasks import Periodic

SCRAPE_S = 0.5  # how often each backend's load is read
SCRAPE_TIMEOUT_S = 0.4  # an answer later than this is no answer: the scrape is skipped
STALE_S = 3.0  # a load older than this is not used: admission falls back to the ledger

USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
PREEMPTIONS = ("vllm:num_preemptions_total",)
RETRACTED = ("sglang:num_retracted_reqs",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)  # prompt tokens looked up, a counter
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)  # of them, the tokens found cached
LORA_INFO = "vllm:lora_requests_info"
# the metrics every scrape keeps; a pool's routing plug-ins may ask for more (Backend.signals)
LOAD_SIGNALS = frozenset(
    (*USAGE, *RUNNING, *WAITING, *PREEMPTIONS, *RETRACTED, *PREFIX_QUERIES, *PREFIX_HITS, LORA_INFO)
)


@dataclass(frozen=True, slots=True)
class Signals:
    """The series of one scrape of a backend's metrics that its readers asked for, labels
    and all: the load below is read from them, and routing plug-ins read what they name
    (gateway/admission/routing/plugins.py)."""

    series: Mapping[str, Sequence[Sample]]

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the series called `name` with these label values; None when none."""
        found = [
            s.value
            for s in self.series.get(name, ())
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return sum(found) if found else None


NO_SIGNALS = Signals({})


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportedLoad:
    """One scrape of a backend's own metrics."""

    kv_usage: float  # share of its KV cache in use, 0..1
    waiting: int  # requests waiting inside it
    preemptions: float | None  # its preemption counter, where it has one
    retracted: int = 0  # SGLang's retracted requests
    running: int | None = None  # requests running inside it; None where it does not say
    prefix_queries: float | None = None  # vLLM's prefix-cache counters, where it has them
    prefix_hits: float | None = None
    # LoRA: the adapters its steps run now, and how many a step may run (None: not told)
    active_adapters: frozenset[str] = frozenset()
    max_loras: int | None = None
    signals: Signals = field(default=NO_SIGNALS, compare=False)  # every series the scrape kept

    @property
    def prefix_hit_rate(self) -> float | None:
        """The share of looked-up prompt tokens the backend found in its prefix cache."""
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


def load_from_metrics(text: str, wanted: frozenset[str] = LOAD_SIGNALS) -> ReportedLoad | None:
    """The load a vLLM or SGLang metrics page reports, with the series called one of
    `wanted` kept as its signals; None when it reports no KV use (or none that can be
    read)."""
    series: dict[str, list[Sample]] = {}
    try:
        found = samples(text, wanted)
    except ValueError:
        return None
    for sample in found:
        series.setdefault(sample.name, []).append(sample)
    usage = next((series[n] for n in USAGE if n in series), None)
    if not usage:
        return None

    def total(names: Iterable[str]) -> float | None:
        found = [sum(s.value for s in series[n]) for n in names if n in series]
        return found[0] if found else None

    running = total(RUNNING)
    lora = max(series.get(LORA_INFO, ()), key=lambda s: s.value, default=None)
    return ReportedLoad(
        kv_usage=min(1.0, max(0.0, sum(s.value for s in usage) / len(usage))),
        running=None if running is None else int(running),
        waiting=int(total(WAITING) or 0),
        preemptions=total(PREEMPTIONS),
        retracted=int(total(RETRACTED) or 0),
        prefix_queries=total(PREFIX_QUERIES),
        prefix_hits=total(PREFIX_HITS),
        signals=Signals(series),
        **({} if lora is None else _lora(lora)),
    )


def _lora(newest: Sample) -> dict[str, Any]:
    """What the newest `vllm:lora_requests_info` series says: the adapters active, the slots."""
    names = newest.labels.get("running_lora_adapters", "")
    slots = newest.labels.get("max_lora", "")
    return {
        "active_adapters": frozenset(n for n in names.split(",") if n),
        "max_loras": int(slots) if slots.isdigit() else None,
    }


BackoffListener = Callable[[str, FillReason], None]  # (backend, reason)


class LoadReporting(Protocol):
    """A backend as the load watcher sees it (gateway/admission/fleet/backends.py's Backend)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def signals(self) -> frozenset[str]:
        """The metrics its scrape keeps (LOAD_SIGNALS, and what its routing reads)."""
        ...

    def report(self, load: ReportedLoad, *, now: float, reserved: int = 0) -> FillReason | None:
        """Take a scrape; the reason the effective fill backed off, if it did."""
        ...


class MetricsScrape:
    """Each backend's `GET /metrics`, fetched once for everyone who reads it: its load
    (LoadWatcher, every SCRAPE_S), its KV capacity and its answers' lengths (the probe,
    backends.py's FleetWatcher). A read takes the last page fetched within its `fresh_s`;
    a page that failed (5xx, or no answer) is never kept for another reader, who tries
    for itself within its own time limit."""

    def __init__(self, client: httpx.AsyncClient, *, clock: Clock) -> None:
        self._client = client
        self._clock = clock
        self._pages: dict[str, tuple[float, httpx.Response]] = {}  # url: (when, page)

    async def get(self, url: str, *, timeout_s: float, fresh_s: float) -> httpx.Response:
        """The backend's metrics page; httpx's errors pass through."""
        kept = self._pages.get(url)
        if kept is not None and self._clock.monotonic() - kept[0] < fresh_s:
            return kept[1]
        response = await self._client.get(f"{url}/metrics", timeout=timeout_s)
        if response.status_code < 500:
            self._pages[url] = (self._clock.monotonic(), response)
        return response


class LoadWatcher:
    """Scrapes the load of every backend whose pool has `feedback` on, every SCRAPE_S; each
    scrape is bounded by SCRAPE_TIMEOUT_S, so a slow backend only makes its load stale."""

    def __init__(
        self,
        backends: Sequence[LoadReporting],
        *,
        scrape: MetricsScrape,
        clock: Clock,
        reserved: Callable[[str], int],
        on_backoff: BackoffListener,
    ) -> None:
        """`reserved(backend)`: the tokens the ledger holds on it now."""
        self._backends = list(backends)
        self._reserved = reserved
        self._scrape = scrape
        self._clock = clock
        self._on_backoff = on_backoff
        self._periodic = Periodic(self.scrape_once, every_s=SCRAPE_S, name="load-watcher")

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._read(b) for b in self._backends))

    async def _read(self, backend: LoadReporting) -> None:
        # the ledger's view as the scrape leaves and as it comes back, the larger: a request
        # released meanwhile was still in the backend's figure, one admitted was not yet
        before = self._reserved(backend.name)
        try:
            response = await self._scrape.get(
                backend.url, timeout_s=SCRAPE_TIMEOUT_S, fresh_s=SCRAPE_S / 2
            )
        except httpx.HTTPError:
            return  # the probe (FleetWatcher) says why; the load just goes stale
        if response.status_code != 200:
            return
        load = load_from_metrics(response.text, backend.signals)
        if load is None:
            return
        reserved = max(before, self._reserved(backend.name))
        reason = backend.report(load, now=self._clock.monotonic(), reserved=reserved)
        if reason is not None:
            self._on_backoff(backend.name, reason)

    async def start(self) -> None:
        if self._backends:
            self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
