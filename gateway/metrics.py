"""The gateway's Prometheus metrics, one registry per app (names fixed by DESIGN.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "spillgate_requests", "Requests by pool, tenant and outcome",
            ["pool", "tenant", "outcome"], registry=r,
        )  # fmt: skip
        self.inflight_tokens = Gauge(
            "spillgate_inflight_tokens", "Tokens reserved in flight", ["backend"], registry=r
        )
        self.capacity_tokens = Gauge(
            "spillgate_capacity_tokens", "KV-cache capacity in tokens", ["backend"], registry=r
        )
        self.active_sessions = Gauge(
            "spillgate_active_sessions", "Requests in flight", ["backend"], registry=r
        )
        self.backend_healthy = Gauge(
            "spillgate_backend_healthy", "1 while the backend is in rotation", ["backend"],
            registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "spillgate_queue_depth", "Requests waiting for capacity", ["pool"], registry=r
        )
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
            registry=r,
        )  # fmt: skip
        self.pool_fill = Gauge(
            "spillgate_pool_fill_ratio", "Tokens in flight ÷ capacity of the pool", ["pool"],
            registry=r,
        )  # fmt: skip
        self.pool_demand = Gauge(
            "spillgate_pool_demand_tokens_per_second",
            "Observed demand (prompt + completion tokens/s, all outcomes) for the pool",
            ["pool"], registry=r,
        )  # fmt: skip
        self.pool_desired_backends = Gauge(
            "spillgate_pool_desired_backends",
            "Backends needed for the observed demand at the pool's target fill",
            ["pool"], registry=r,
        )  # fmt: skip
        self.provider_cost = Counter(
            "spillgate_provider_cost_dollars", "Spend at external providers", ["provider"],
            registry=r,
        )  # fmt: skip
        self.provider_breaker_open = Gauge(
            "spillgate_provider_breaker_open", "1 while a provider's circuit breaker is open",
            ["provider"], registry=r,
        )  # fmt: skip

    def set_ratelimit_mode(self, mode: str) -> None:
        for name in ("shared", "local", "allow", "deny"):
            self.ratelimit_mode.labels(name).set(1.0 if name == mode else 0.0)
