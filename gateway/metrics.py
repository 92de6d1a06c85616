"""The gateway's Prometheus metrics, one registry per app (names fixed by DESIGN.md).

With several worker processes (`spillgate serve --workers N`) every value lives in
prometheus-client's multiprocess files under PROMETHEUS_MULTIPROC_DIR and a scrape adds
the workers up: counters and histograms sum; gauges of the fleet as the shared ledger sees
it (in flight, capacity, fill) show the most recent worker's view; gauges of a process's
own state (queue depth, modes, demand) sum over the live workers; a breaker counts as open
when any worker's is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final, Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


FLEET: Final[Literal["livemostrecent"]] = "livemostrecent"  # same in every worker: latest wins
OWN: Final[Literal["livesum"]] = "livesum"  # each worker's own part: added up
_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db")

M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """A metric's labelled children, each looked up once: `labels()` checks and converts its
    arguments and takes a lock on every call, which the request path need not repeat.

    Only for label values drawn from the config (pools, tenants, targets, outcomes), so
    the cache stays as small as the metric itself.
    """

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, *, multiprocess_dir: str | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.multiprocess_dir = multiprocess_dir
        r = self.registry
        self.requests = Counter(
            "spillgate_requests", "Requests by pool, tenant and outcome",
            ["pool", "tenant", "outcome"], registry=r,
        )  # fmt: skip
        self.inflight_tokens = Gauge(
            "spillgate_inflight_tokens", "Tokens reserved in flight", ["backend"], registry=r,
            multiprocess_mode=FLEET,
        )  # fmt: skip
        self.capacity_tokens = Gauge(
            "spillgate_capacity_tokens", "KV-cache capacity in tokens", ["backend"], registry=r,
            multiprocess_mode=FLEET,
        )  # fmt: skip
        self.active_sessions = Gauge(
            "spillgate_active_sessions", "Requests in flight", ["backend"], registry=r,
            multiprocess_mode=FLEET,
        )  # fmt: skip
        self.backend_healthy = Gauge(
            "spillgate_backend_healthy", "1 while the backend is in rotation", ["backend"],
            registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "spillgate_queue_depth", "Requests waiting for capacity", ["pool"], registry=r,
            multiprocess_mode=OWN,
        )  # fmt: skip
        self.ttft = Histogram(
            "spillgate_ttft_seconds", "Time to first token seen by the client",
            ["pool", "outcome"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "spillgate_queue_wait_seconds", "Time a request waited in the queue",
            ["pool", "priority"], buckets=WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "spillgate_tokens", "Tokens served by target (backend or provider) and kind",
            ["target", "kind"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "spillgate_upstream_errors", "Failed upstream attempts", ["target", "reason"],
            registry=r,
        )  # fmt: skip
        self.ratelimit_store_errors = Counter(
            "spillgate_ratelimit_store_errors", "Rate-limit store calls that failed", registry=r
        )
        self.ratelimit_mode = Gauge(
            "spillgate_ratelimit_mode", "1 for the rate limiter's current mode", ["mode"],
            registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.ledger_store_errors = Counter(
            "spillgate_ledger_store_errors", "Shared-ledger store calls that failed", registry=r
        )
        self.ledger_mode = Gauge(
            "spillgate_ledger_mode", "1 for the in-flight ledger's current mode", ["mode"],
            registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.pool_fill = Gauge(
            "spillgate_pool_fill_ratio", "Tokens in flight ÷ capacity of the pool", ["pool"],
            registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.pool_demand = Gauge(
            "spillgate_pool_demand_tokens_per_second",
            "Observed demand (prompt + completion tokens/s, all outcomes) for the pool",
            ["pool"], registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.pool_desired_backends = Gauge(
            "spillgate_pool_desired_backends",
            "Backends needed for the observed demand at the pool's target fill",
            ["pool"], registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.provider_cost = Counter(
            "spillgate_provider_cost_dollars", "Spend at external providers", ["provider"],
            registry=r,
        )  # fmt: skip
        self.provider_breaker_open = Gauge(
            "spillgate_provider_breaker_open", "1 while a provider's circuit breaker is open",
            ["provider"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        # the request path's metrics, by label values
        self.requests_of = Children(self.requests)
        self.ttft_of = Children(self.ttft)
        self.tokens_of = Children(self.tokens)

    def set_ratelimit_mode(self, mode: str) -> None:
        for name in ("shared", "local", "allow", "deny"):
            self.ratelimit_mode.labels(name).set(1.0 if name == mode else 0.0)

    def set_ledger_mode(self, mode: str) -> None:
        for name in ("shared", "local"):
            self.ledger_mode.labels(name).set(1.0 if name == mode else 0.0)

    def render(self) -> bytes:
        """The exposition text: this registry's, or every worker's added up."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        _forget_dead_workers(self.multiprocess_dir)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def close(self) -> None:
        """Take this process's live gauges out of the workers' sums (a clean exit)."""
        if self.multiprocess_dir is not None:
            mark_process_dead(os.getpid(), self.multiprocess_dir)  # type: ignore[no-untyped-call]


def _forget_dead_workers(path: str) -> None:
    """Drop the live gauges of workers that died without a clean exit (kill -9, OOM)."""
    for file in Path(path).glob("gauge_live*.db"):
        match = _LIVE_GAUGE_FILE.fullmatch(file.name)
        if match is not None and not _alive(int(match.group(1))):
            mark_process_dead(int(match.group(1)), path)  # type: ignore[no-untyped-call]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
