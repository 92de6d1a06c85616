"""The gateway's Prometheus metrics, one registry per app.

The names and labels are a contract (gateway/README.md, "Contract", lists them): deploy/'s
alert rules, Grafana dashboard and autoscaling metrics query them, and so do the load
tools, so renaming one breaks those.

With several worker processes (`spillgate serve --workers N`) every value lives in
prometheus-client's multiprocess files under PROMETHEUS_MULTIPROC_DIR and a scrape adds
the workers up: counters and histograms sum; gauges of the fleet as the shared ledger sees
it (in flight, capacity, fill) show the most recent worker's view; gauges of a process's
own state (queue depth, modes, demand) sum over the live workers; a breaker counts as open
when any worker's is. The request path's counts (requests, tokens, TTFT) reach the files
once a second and before every scrape the worker itself answers (RequestTally).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where the workers' values live, when set
PUBLISH_S = 1.0  # how often a worker writes its gauges and counts there
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
# a batch's creation to its completion: seconds (a valley now) to its 24 h window
BATCH_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0)
TTFT_HELD = 1024  # TTFTs a series keeps before observing them (RequestTally)
# signed: a prediction is as often too long as too short
_ERROR_SIDE = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
ERROR_BUCKETS = (*(-x for x in reversed(_ERROR_SIDE)), 0.0, *_ERROR_SIDE)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


FLEET: Final[Literal["livemostrecent"]] = "livemostrecent"  # same in every worker: latest wins
OWN: Final[Literal["livesum"]] = "livesum"  # each worker's own part: added up
_LIVE_GAUGE_FILE = re.compile(r"gauge_live\w+_(\d+)\.db")


class RequestTally:
    """The request path's counts as plain numbers, handed to prometheus-client in bulk.

    A labelled child checks, converts and locks on every inc() and observe(), which costs
    more than the count itself; the request path adds to dicts instead, and `flush` moves
    the sums into the metrics. GatewayMetrics flushes before every scrape it answers and,
    with several workers, every second (another worker's scrape reads this one's files).
    Only for label values drawn from the config (pools, tenants, targets, outcomes).

    Counters take a sum in one inc(); a histogram has no public bulk observe, so the TTFTs
    are kept as they came and observed one by one at the flush, or once a series has
    TTFT_HELD of them, which bounds what a gateway nobody scrapes holds.
    """

    def __init__(self, requests: Counter, tokens: Counter, ttft: Histogram) -> None:
        self._metrics = (requests, tokens, ttft)
        self._requests: dict[tuple[str, str, str], int] = {}
        self._tokens: dict[str, list[int]] = {}  # target → [prompt, completion]
        self._ttft: dict[tuple[str, str], list[float]] = {}

    def request(self, pool: str, tenant: str, outcome: str) -> None:
        key = (pool, tenant, outcome)
        self._requests[key] = self._requests.get(key, 0) + 1

    def tokens(self, target: str, prompt: int, completion: int) -> None:
        counts = self._tokens.get(target)
        if counts is None:
            counts = self._tokens[target] = [0, 0]
        counts[0] += prompt
        counts[1] += completion

    def ttft(self, pool: str, outcome: str, seconds: float) -> None:
        key = (pool, outcome)
        held = self._ttft.get(key)
        if held is None:
            held = self._ttft[key] = []
        held.append(seconds)
        if len(held) >= TTFT_HELD:
            del self._ttft[key]
            _observe_all(self._metrics[2].labels(*key), held)

    def flush(self) -> None:
        requests, tokens, ttft = self._metrics
        pending_requests, self._requests = self._requests, {}
        for request_labels, n in pending_requests.items():
            requests.labels(*request_labels).inc(n)
        pending_tokens, self._tokens = self._tokens, {}
        for target, (prompt, completion) in pending_tokens.items():
            if prompt:
                tokens.labels(target, "prompt").inc(prompt)
            if completion:
                tokens.labels(target, "completion").inc(completion)
        pending_ttft, self._ttft = self._ttft, {}
        for ttft_labels, held in pending_ttft.items():
            _observe_all(ttft.labels(*ttft_labels), held)


def _observe_all(child: Histogram, values: list[float]) -> None:
    observe = child.observe
    for value in values:
        observe(value)


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
        self.backend_kv_usage = Gauge(
            "spillgate_backend_kv_usage_ratio",
            "KV-cache use the backend itself reports, 0..1 (NaN while its scrape is stale)",
            ["backend"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.backend_waiting = Gauge(
            "spillgate_backend_requests_waiting", "Requests the backend reports waiting inside it",
            ["backend"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.effective_fill = Gauge(
            "spillgate_effective_fill_ratio",
            "The fill admission aims at on the backend: target_fill, lowered after a back-off, "
            "raised while the backend holds less than the ledger reserves",
            ["backend"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.prefix_index_hit = Gauge(
            "spillgate_prefix_index_hit_ratio",
            "Share of the prompt blocks routed to the backend that the prefix index expected "
            "it to hold cached (NaN before any)",
            ["backend"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.backend_prefix_hit = Gauge(
            "spillgate_backend_prefix_cache_hit_ratio",
            "Share of prompt tokens the backend itself reports found in its prefix cache "
            "(NaN while unknown)",
            ["backend"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.fill_backoffs = Counter(
            "spillgate_fill_backoffs", "Times a backend's effective fill backed off, by reason",
            ["backend", "reason"], registry=r,
        )  # fmt: skip
        self.adapter_loads = Counter(
            "spillgate_adapter_loads",
            "Loads of a LoRA adapter on a backend, by result (loaded, failed)",
            ["pool", "adapter", "backend", "result"], registry=r,
        )  # fmt: skip
        self.adapter_unloads = Counter(
            "spillgate_adapter_unloads",
            "Unloads of a LoRA adapter the gateway loaded, past max_loaded_adapters, by result "
            "(unloaded, failed)",
            ["pool", "adapter", "backend", "result"], registry=r,
        )  # fmt: skip
        self.adapter_requests = Counter(
            "spillgate_adapter_requests",
            "Requests for a LoRA adapter, by their one outcome",
            ["pool", "adapter", "outcome"], registry=r,
        )  # fmt: skip
        self.adapter_backends = Gauge(
            "spillgate_adapter_backends",
            "Backends that serve a LoRA adapter (serving) and that run it now (active)",
            ["pool", "adapter", "state"], registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "spillgate_queue_depth", "Requests waiting for capacity", ["pool"], registry=r,
            multiprocess_mode=OWN,
        )  # fmt: skip
        self.queue_displaced = Counter(
            "spillgate_queue_displaced",
            "Waiters pushed out of a full queue by an arrival that goes first, by their tenant",
            ["pool", "tenant"], registry=r,
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
        self.prefill_decisions = Counter(
            "spillgate_prefill_decisions",
            "Requests of pools with prefill backends, by whether a prefill backend computed the "
            "prompt (split) or the decode backend alone served it, and why",
            ["pool", "decision"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "spillgate_upstream_errors", "Failed upstream attempts", ["target", "reason"],
            registry=r,
        )  # fmt: skip
        self.usage_corrections = Counter(
            "spillgate_usage_corrections",
            "Answers whose usage the gateway corrected before charging it, by target and "
            "reason (gateway/upstream/usage.py): a count missing, not a number, negative, "
            "zero, or more or less than the request could have used",
            ["target", "reason"], registry=r,
        )  # fmt: skip
        self.streams_not_kept = Counter(
            "spillgate_streams_not_kept",
            "Resumable streams whose answer passed server.upstream_max_kept_bytes: from there "
            "on, a break-off ends them rather than continuing them elsewhere",
            ["target"], registry=r,
        )  # fmt: skip
        self.stream_continuations = Counter(
            "spillgate_stream_continuations",
            "Streams continued on another backend after theirs broke off mid-answer, by "
            "result: succeeded (the stream went on there) or failed (that backend failed too)",
            ["pool", "result"], registry=r,
        )  # fmt: skip
        self.stream_continuations_refused = Counter(
            "spillgate_stream_continuations_refused",
            "Streams cut mid-answer that were not continued, by reason",
            ["pool", "reason"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "spillgate_preemptions",
            "Requests in flight stopped to give their room to a waiter of a higher class, by "
            "what became of them: requeued (stopped before their first byte, served later), "
            "continued (the stream went on on the pool), passed_on (no byte sent, no room "
            "back in time: the rest of the chain took it), ended (an error event)",
            ["pool", "priority", "result"], registry=r,
        )  # fmt: skip
        self.refused_keys = Counter(
            "spillgate_refused_keys", "Requests refused for their API key: missing or incorrect",
            ["reason"], registry=r,
        )  # fmt: skip
        self.ratelimit_store_errors = Counter(
            "spillgate_ratelimit_store_errors", "Rate-limit store calls that failed", registry=r
        )
        self.ratelimit_mode = Gauge(
            "spillgate_ratelimit_mode", "1 for the rate limiter's current mode", ["mode"],
            registry=r, multiprocess_mode=OWN,
        )  # fmt: skip
        self.ratelimit_degraded_tenants = Gauge(
            "spillgate_ratelimit_degraded_tenants",
            "Tenants whose buckets this replica answers without the store (their slot of it "
            "did not answer): by the failure mode, on its own share",
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
        self.batch_queued_tokens = Gauge(
            "spillgate_batch_queued_tokens",
            "Estimated tokens of batch items not yet run, by the pool they will run on",
            ["pool"], registry=r, multiprocess_mode=FLEET,
        )  # fmt: skip
        self.batch_tokens = Counter(
            "spillgate_batch_tokens", "Tokens served to batch items, by kind (prompt|completion)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.batch_completion = Histogram(
            "spillgate_batch_completion_seconds", "From a batch's creation to its completion",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        # requests with a TTFT objective (gateway/slo.py)
        self.slo_requests = Counter(
            "spillgate_slo_requests",
            "Requests with a TTFT objective, by result: met (first token and pace in time), "
            "missed, refused (no tier was predicted to meet it)",
            ["pool", "result"], registry=r,
        )  # fmt: skip
        self.slo_predicted_ttft = Histogram(
            "spillgate_slo_predicted_ttft_seconds",
            "The time to first token predicted for a request at an overflow tier it was "
            "weighed for",
            ["pool", "tier"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.slo_prediction_error = Histogram(
            "spillgate_slo_prediction_error_seconds",
            "Time to first token at the tier that served, less what was predicted for it",
            ["pool", "tier"], buckets=ERROR_BUCKETS, registry=r,
        )  # fmt: skip
        self.slo_passed_over = Counter(
            "spillgate_slo_passed_over",
            "Overflow tiers passed over because they were predicted to miss an objective",
            ["pool", "tier"], registry=r,
        )  # fmt: skip
        # the request path's metrics, counted in bulk
        self.tally = RequestTally(self.requests, self.tokens, self.ttft)

    def set_ratelimit_mode(self, mode: str) -> None:
        for name in ("shared", "local", "allow", "deny"):
            self.ratelimit_mode.labels(name).set(1.0 if name == mode else 0.0)

    def set_ledger_mode(self, mode: str) -> None:
        for name in ("shared", "local"):
            self.ledger_mode.labels(name).set(1.0 if name == mode else 0.0)

    def flush(self) -> None:
        """Bring the request path's counts into the metrics (see RequestTally)."""
        self.tally.flush()

    def render(self) -> bytes:
        """The exposition text: this registry's, or every worker's added up."""
        self.flush()
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        forget_dead_workers(self.multiprocess_dir)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    def close(self) -> None:
        """Take this process's live gauges out of the workers' sums (a clean exit)."""
        self.flush()
        if self.multiprocess_dir is not None:
            mark_process_dead(os.getpid(), self.multiprocess_dir)  # type: ignore[no-untyped-call]


def forget_dead_workers(path: str) -> None:
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
