"""Typed gateway configuration, validated at load time with every error reported at once.

Secrets never live in the file: tenant keys are stored as SHA-256 hashes (or read from an
environment variable and hashed at load), and provider keys, the admin token and the Redis
URL are named by the environment variable that holds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.config_problems import (
    ConfigDocument,
    Problem,
    Problems,
    describe,
    yaml_syntax,
)
from gateway.config_references import reference_problems

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("critical", "standard", "sheddable")
# the overflow policies policies/registry.py builds, by the names a pool's chain uses
PolicyName = Literal["queue", "degrade", "provider", "cache", "batch", "reject"]
# what a pool's backends serve: generation (chat, completions, responses) or embeddings
PoolKind = Literal["chat", "embedding"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Model):
    """Upstream time budgets, in seconds."""

    connect: float = Field(2.0, gt=0, description="opening a connection to the upstream")
    first_token: float = Field(
        30.0,
        gt=0,
        description=(
            "from sending the request to the first byte back (not streamed, that byte is the "
            "answer's head, which vLLM sends once the whole answer is generated: set it above "
            "your longest non-streaming generation)"
        ),
    )
    idle: float = Field(
        30.0, gt=0, description="the longest gap between chunks of a body after its first byte"
    )
    total: float = Field(600.0, gt=0, description="the whole request, all attempts together")


class BackendSettings(_Model):
    """One server of the pool."""

    url: str = Field(description="backend base URL (without `/v1`), `http://` or `https://`")
    served_model: str | None = Field(
        None,
        description=(
            "the name the backend serves (none: the pool's name); swapped in and back out. "
            "Checked against the backend's `GET /v1/models`: a backend that does not list it "
            "stays out of rotation, and `/readyz` and the log name what it serves"
        ),
    )
    capacity: int | Literal["auto"] = Field(
        "auto",
        description=(
            "tokens of KV cache sequences may use, or `auto` to read `vllm:cache_config_info` "
            "(num_gpu_blocks − 1 blocks: vLLM keeps one back) / `sglang:max_total_num_tokens`; "
            "by hand, give vLLM's (num_gpu_blocks − 1) × block_size"
        ),
    )
    block_size: int = Field(
        16,
        ge=1,
        description=(
            "the backend's KV block size in tokens, when `capacity` is set by hand (vLLM's "
            "default on GPUs); `auto` reads it from the metrics"
        ),
    )
    name: str | None = Field(
        None,
        description=(
            "the backend's name in metrics and the shared ledger; unique across pools; "
            "none: `<pool>-<index>`"
        ),
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="tokens", kind=int)


class FairnessSettings(_Model):
    """How a pool's queue weighs the tokens its tenants were served lately
    (policies/queue/service.py): a tenant's attained service in the pool is its prompt tokens
    plus `output_weight` × its completion tokens, halving every `half_life_s`. A request
    counts when the pool admits it, with its prompt and expected output, and is corrected by
    the usage its answer reports, so a tenant whose long streams hold the pool counts from
    their start; a request whose usage never came keeps its charge. In shared mode every
    replica adds its counts to `spillgate:service:{POOL}` and reads the fleet's back, every
    0.2 s off the request path, so all replicas order by the same figures; without Redis each
    keeps its own."""

    output_weight: float = Field(
        4.0,
        ge=1,
        le=1000,
        description=(
            "how many input tokens an output token counts as: an output token costs the "
            "backend a decode step each, a prompt token a share of one prefill"
        ),
    )
    half_life_s: float = Field(
        60.0,
        ge=1,
        le=86_400,
        description=(
            "what a tenant was served halves every this many seconds: long enough that a "
            "flood is remembered through a spike, short enough that a tenant idle a few "
            "minutes is new again"
        ),
    )
    give_way_s: float = Field(
        0.5,
        ge=0,
        le=5,
        description=(
            "in shared mode, each replica publishes the tenants waiting in its queue "
            "(`spillgate:waiting:{POOL}`, every 0.2 s; a replica silent for 0.6 s no longer "
            "counts). When room frees and the turn here is a tenant's with at least twice the "
            "service of a tenant of its class waiting at another replica, or a lower class "
            "than that one's, and that tenant's next request fits now, this replica leaves the "
            "room to that one for at most `give_way_s`, then takes it; an arrival here queues "
            "rather than take that room. `0`: each replica drains in its own order"
        ),
    )


class QueueSettings(_Model):
    """The fair queue: priority class first, strictly; within a class the tenant with the
    least attained service (see `queue.fairness`), the one served least recently among
    equals; within a tenant the earliest deadline, then arrival; the waiter whose turn it is
    is never overtaken by a smaller one. A waiter past its deadline (its wait limit, at most
    its TTFT objective: `x-spillgate-ttft-ms`, else its tenant's `ttft_budget_ms`) moves on
    to the next policy."""

    max_depth: int = Field(
        64,
        ge=0,
        description=(
            "waiters the queue holds; a request past it is refused as a full queue, unless "
            "waiters of a lower class make room (the newest of the lowest class go first)"
        ),
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "a bound on the KV tokens the queue's waiters would reserve, all together (none: "
            "only `max_depth` bounds it); a request that would pass either bound is refused as "
            "a full queue, unless waiters of a lower class make room (the newest of the lowest "
            "class go first)"
        ),
    )
    max_wait_s: float | Literal["auto"] = Field(
        "auto",
        description=(
            "a waiter's wait limit. `auto` waits twice the pool's average answer time (from "
            "admission to release, how long its reservations are held), within 2–30 s, 2 s "
            "until an answer has ended (policies/queue/policy.py): room comes back as answers "
            "end, so a fixed short wait refuses on a slow fleet what it serves a moment later; "
            "a number of seconds fixes it"
        ),
    )
    fairness: FairnessSettings = FairnessSettings()

    @field_validator("max_wait_s", mode="before")
    @classmethod
    def _max_wait_s(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="seconds", kind=int | float)


class CacheSettings(_Model):
    """Exact-match answers per tenant (or a shared `scope`), for the `cache` policy."""

    ttl_s: float = Field(300.0, gt=0, description="seconds an answer is kept")
    max_entries: int = Field(10_000, gt=0, description="answers kept; the oldest go first")
    max_entry_bytes: int = Field(256 * 1024, gt=0, description="the largest answer stored")
    scope: str | None = Field(
        None, description="share entries across tenants under this name; none: per tenant"
    )
    store: Literal["deterministic", "all"] = Field(
        "deterministic",
        description="`deterministic` stores only temperature-0 or seeded requests; `all` any",
    )


class ReservationSettings(_Model):
    """How much output a request reserves on admission (CAPACITY.md, admission): the
    expected output, from the completion lengths (`usage`) of the pool's last 1,024 answers,
    per choice. The tenant's own figures once it has `min_samples` answers, the pool's once
    the pool has; before that, the lengths borrowed from the other replicas (in shared mode
    each replica adds its answers' lengths to the pool's last 1,024 in Redis,
    `spillgate:lengths:{POOL}`, and reads them back, every 2 s off the request path and once
    before its first request) or else from the backends' histograms of the answers they
    generated (`vllm:request_generation_tokens`), so a fresh replica admits from its first
    request as a warm one does; `prior_tokens` when neither has `min_samples`.
    `/admin/status` names the source in `pools[].reservation.source`. A request that is not
    streamed reserves this whole figure (it cannot grow; the backend's reported KV use covers
    a longer answer within a scrape)."""

    mode: Literal["learned", "max_tokens"] = Field(
        "learned",
        description=(
            "`learned`: a request reserves its prompt + the expected output, the smaller of "
            "its `max_tokens` (or the context left, `max_model_len` − prompt, when it names "
            "none) and the learned figure; a stream's reservation then grows block by block "
            "with the tokens relayed (past the limit if need be: it is running) and is "
            "released whole. `max_tokens`: the old static reservation, prompt + `max_tokens` "
            "(or `default_max_tokens`) held to the end, no growth"
        ),
    )
    quantile: float = Field(
        0.9, gt=0, le=1, description="the quantile of the completion lengths seen in the pool"
    )
    quantile_of: Literal["backend", "answer"] = Field(
        "backend",
        description=(
            "`backend`: the share that keeps the answers a backend holds at once within "
            "`quantile` together, the mean plus z × sd / √n for n such sequences in the "
            "smallest backend's room at `target_fill` (never more than one answer's own "
            "quantile); `answer`: each answer's own quantile "
            "(gateway/admission/output_lengths.py)"
        ),
    )
    hold: Literal["peak", "whole"] = Field(
        "peak",
        description=(
            "what a streaming request reserves once the pool has `min_samples` answers "
            "(`quantile_of: backend`): `peak`, the most it is expected to hold at once (it may "
            "end at any token), the highest point over t of (prompt + t) × the share of "
            "answers longer than t, plus its share of the spread (z × sd / √n), which it keeps "
            "on top as it grows past that; `whole`, its whole expected answer"
        ),
    )
    prior_tokens: int = Field(
        512, gt=0, description="the expected output until `min_samples` answers were seen"
    )
    min_samples: int = Field(
        50,
        gt=0,
        description=(
            "answers the pool must have before its lengths are used; a tenant's own figure "
            "once it has this many"
        ),
    )


class PoolSettings(_Model):
    """A model served by a pool of backends, and what happens when they are full."""

    name: str = Field(min_length=1, description="the model name clients send")
    kind: PoolKind = Field(
        "chat",
        description=(
            "what the pool's backends serve: `chat` (chat, completions, responses) or "
            "`embedding` (`/v1/embeddings` only; its `overflow` may not name `degrade` or "
            "`cache`); a pool degrades only to a pool of its kind"
        ),
    )
    backends: list[BackendSettings] = Field(
        min_length=1, description="the pool's servers, at least one"
    )
    target_fill: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "admit while tokens in flight + request ≤ capacity × target fill, counting each "
            "sequence (one per choice, `n`) as prompt + its reserved output (see "
            "`reservation`) rounded up to whole blocks; a request over the target fill but "
            "within the KV cache runs alone on an idle backend"
        ),
    )
    default_max_tokens: int = Field(
        256,
        gt=0,
        description=(
            "output tokens a request that names none is checked against `max_model_len` with, "
            "and charged to its tenant's token bucket; reserved only in "
            "`reservation.mode: max_tokens`"
        ),
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description=(
            "prompt + max_tokens above this gets 400 `context_length_exceeded` (no "
            "`Retry-After`); none: the smallest `max_model_len` the pool's backends report in "
            "`/v1/models` (vLLM does), else 32768"
        ),
    )
    overflow: list[PolicyName] = Field(
        default_factory=lambda: list[PolicyName](["reject"]),
        description=(
            "the policy chain, in order, each policy at most once and none after `reject`: "
            "`queue`, `degrade` (needs `degrade_to`), `provider` (needs `provider`), `cache`, "
            "`batch` (requests that may wait become one-item batches, answered 202), `reject`"
        ),
    )
    timeouts: Timeouts = Field(
        Timeouts(),
        description=(
            "upstream time budgets in seconds, for every request. A timeout before anything "
            "reached the client is tried on another backend and counts towards ejection"
        ),
    )
    queue: QueueSettings = QueueSettings()
    degrade_to: str | None = Field(None, description="the smaller-model pool `degrade` sends to")
    provider: str | None = Field(None, description="the provider `provider` spills to")
    cache: CacheSettings = CacheSettings()
    sheddable_max_fill: float = Field(
        1.0,
        gt=0,
        le=1,
        description="sheddable requests get no room once the pool's fill reaches this",
    )
    capacity_refresh_s: float = Field(
        5.0,
        gt=0,
        description=(
            "how often each backend is probed (`GET /v1/models`, then `/metrics`, or "
            "`/health` when its capacity is set; a backend out of rotation every second), and "
            "each probe's time budget"
        ),
    )
    metrics_stale_s: float = Field(
        15.0, gt=0, description="metrics older than this are stale; stale metrics count as full"
    )
    reservation: ReservationSettings = ReservationSettings()
    feedback: bool = Field(
        True,
        description=(
            "every 0.5 s read each backend's own `vllm:kv_cache_usage_perc`, "
            "`vllm:num_requests_waiting`, `vllm:num_preemptions_total` (SGLang: "
            "`sglang:token_usage`, `sglang:num_queue_reqs`, `sglang:num_retracted_reqs`), "
            "0.4 s budget; admit against the larger of the ledger and what the backend holds "
            "(traffic that bypasses the gateway counts); a preemption, or requests waiting "
            "inside the backend on two reads in a row while its KV cache is at least "
            "`target_fill` full, multiplies the backend's effective fill by 0.8 (down to a "
            "tenth of `target_fill`), which then recovers by 0.01 a second; while the ledger "
            "holds at least half the target, the highest recent ratio of what the backend "
            "holds to what the ledger reserves (starting at 1, coming down by at most 0.03 a "
            "second of such reads) raises the effective fill to `target_fill` ÷ that ratio, at "
            "most 1.1 × `target_fill` and never above 1, and a back-off resets it; a read "
            "older than 3 s is not used (the ledger alone, at `target_fill`). `false`: the "
            "ledger alone"
        ),
    )
    routing: Literal["least_filled", "prefix"] = Field(
        "prefix",
        description=(
            "which backend of the pool a request goes to (gateway/admission/router.py). "
            "`prefix`: the one likeliest to hold the prompt's leading blocks in its prefix "
            "cache (the gateway keeps, per backend, the keys of the prompt blocks it routed "
            "there lately, about as many as its KV cache holds; a block is about `block_size` "
            "tokens of the prompt as sent), ties to the least filled, a prompt seen nowhere to "
            "the less filled of its two homes (the backends its first block ranks highest by "
            "rendezvous hashing, the same on every replica); in shared mode the replicas "
            "publish the blocks their routing adds to their indexes on Redis "
            "(`spillgate:prefix:routed`, a batch every 50 ms, off the request path) and add "
            "each other's, so a prefix one replica placed is known to all; a chat's session "
            "(`x-spillgate-session`, else the body's `user`) returns to the backend its last "
            "turn went to. A backend that taking the request would leave over 1.25 × the "
            "pool's mean fill and over 0.1 above it is passed over, so a hot prefix spreads "
            "over several backends. `least_filled`: the backend with the most room, prompts "
            "unread"
        ),
    )
    continue_streams: int = Field(
        2,
        ge=0,
        le=5,
        description=(
            "how many times a stream whose backend broke off after its first token (killed, "
            "restarted, drained past its grace) goes on on another backend of the pool "
            "(gateway/upstream/resume.py), so the client sees one unbroken stream: the "
            "original request with the text already relayed as the start of the answer (chat: "
            "a final assistant message with `continue_final_message: true`, "
            "`add_generation_prompt: false`; completions: the prompt plus the text), its "
            "`max_tokens` less what was relayed, admitted and reserved like any request within "
            "the request's `timeouts.total`; the continuation's events keep the stream's `id` "
            "and `created`, its role event is dropped, and its usage counts what the client "
            "received once: the text so far as output, one token per relayed event (as vLLM "
            "streams), and as prompt the original's, which the continuing backend's "
            "`POST /tokenize` counts beside the continuation (vLLM's and SGLang's; without it, "
            "the continuation's prompt less the tokens streamed, which is off by as much as "
            "re-tokenizing the text so far differs). Not continued, the stream ends with the "
            "SSE error event as before: `n` > 1 or `best_of`, log probabilities, structured "
            "output (`response_format` other than text, `guided_*`), a tool call or reasoning "
            "under way, `echo`, a completion whose prompt is not one string or has a "
            "`suffix`, the Responses API. `spillgate_stream_continuations_total{result}` and "
            "`spillgate_stream_continuations_refused_total{reason}` count them. `0` turns it "
            "off: set it for backends whose API has no continuation (TGI's Messages API)"
        ),
    )


class ProviderSettings(_Model):
    """An external OpenAI-compatible provider; its key comes from the environment."""

    name: str = Field(min_length=1, description="the name a pool's `provider` key names")
    base_url: str = Field(description="the provider's base URL, `http://` or `https://`")
    api_key_env: str | None = Field(None, description="env variable holding the provider's key")

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        return _http_url(url)

    models: dict[str, str] = Field(
        default_factory=dict, description="pool name → the provider's model name"
    )
    tokens_per_minute: int = Field(
        100_000,
        gt=0,
        description=(
            "the provider's own token budget; with Redis one for the whole fleet (while Redis "
            "is away each process takes its share)"
        ),
    )
    max_concurrency: int = Field(
        16,
        gt=0,
        description=(
            "the provider's concurrency cap; with Redis one for the whole fleet, as leases, "
            "freed within `ledger.lease_ttl_s` when a replica dies (while Redis is away each "
            "process takes its share)"
        ),
    )
    prompt_price_per_m: float = Field(
        0.0,
        ge=0,
        description=(
            "dollars per million prompt tokens, for `spillgate_provider_cost_dollars_total`"
        ),
    )
    completion_price_per_m: float = Field(
        0.0,
        ge=0,
        description=(
            "dollars per million completion tokens, for `spillgate_provider_cost_dollars_total`"
        ),
    )
    timeouts: Timeouts = Field(
        Timeouts(first_token=20.0, total=120.0),
        description="the provider's time budgets in seconds",
    )
    breaker_failures: int = Field(
        3,
        gt=0,
        description=(
            "consecutive failures (any error status but a refusal of one request, 400, 413 or "
            "422; timeouts; answers that are not one) that open the breaker"
        ),
    )
    breaker_cooldown_s: float = Field(
        10.0,
        gt=0,
        description="how long the breaker stays open (a provider's `Retry-After` wins)",
    )


class TenantSettings(_Model):
    """A caller: its key, its limits (token buckets) and what it may use."""

    name: str = Field(min_length=1, description="tenant name (metrics label)")
    key_sha256: str | None = Field(
        None,
        description="the API key's SHA-256 hex; give exactly one of `key_sha256` or `key_env`",
    )
    key_env: str | None = Field(
        None, description="an env variable holding the API key (hashed at load)"
    )
    requests_per_minute: int = Field(600, gt=0, description="the request bucket's refill rate")
    tokens_per_minute: int = Field(1_000_000, gt=0, description="the token bucket's refill rate")
    request_burst: int | None = Field(
        None, gt=0, description="the request bucket's size; none: `requests_per_minute`"
    )
    token_burst: int | None = Field(
        None, gt=0, description="the token bucket's size; none: `tokens_per_minute`"
    )
    priority: Priority = Field(
        "standard",
        description=(
            "`critical`, `standard` or `sheddable`; a request may lower it with "
            "`x-spillgate-priority`"
        ),
    )
    pools: list[str] = Field(
        default_factory=list, description="pools the tenant may use; empty: every pool"
    )
    ttft_budget_ms: float | None = Field(
        None,
        gt=0,
        description=(
            "the tenant's objective for time to first token, for its requests that send no "
            "`x-spillgate-ttft-ms` (see [Objectives](objectives.md)); it also cuts the "
            "queue's wait short"
        ),
    )
    tpot_budget_ms: float | None = Field(
        None,
        gt=0,
        description=(
            "the tenant's objective for the time per output token after the first, for its "
            "requests that send no `x-spillgate-tpot-ms`"
        ),
    )
    batchable: bool = Field(
        False,
        description=(
            "the tenant's requests may wait: where its pool's chain has `batch`, an "
            "overflowing request is accepted as a one-item batch (202), as with "
            "`x-spillgate-batchable: true`"
        ),
    )

    @field_validator("key_sha256")
    @classmethod
    def _sha256(cls, value: str | None) -> str | None:
        if value is not None and not _is_sha256(value):
            raise ValueError("should be 64 lowercase hex digits: the key's SHA-256")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> TenantSettings:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("give exactly one of key_sha256 or key_env")
        return self

    def key_hash(self, environ: dict[str, str]) -> str:
        if self.key_sha256 is not None:
            return self.key_sha256
        assert self.key_env is not None
        return hash_key(environ[self.key_env])


class RedisSettings(_Model):
    """The shared store. With Redis configured the rate limits, the in-flight ledger, the
    response cache, the provider budgets, queue wake-ups and the queues' attained service and
    waiting tenants are shared by every replica and worker."""

    url_env: str = Field(
        "SPILLGATE_REDIS_URL",
        description=(
            "env variable holding the Redis URL (`serve --redis URL` wins); unset: in-process "
            "state, one process"
        ),
    )
    timeout_ms: float = Field(
        250.0,
        gt=0,
        description=(
            "floor of a Redis call's time budget; between it and `timeout_max_ms` the budget "
            "follows the round trips the process sees (their smoothed mean plus four spreads), "
            "so a loaded process waits what its own round trips take. The floor covers a busy "
            "two-core machine's scheduling (a burst's first calls have no waits seen to go "
            "by). A call over its budget counts as a failure; calls made in the same moment "
            "travel in one pipeline, and one that is cut keeps no connection"
        ),
    )
    timeout_max_ms: float = Field(
        1000.0,
        gt=0,
        description=(
            "ceiling of a Redis call's time budget: what a stalled store costs a request "
            "before the breaker opens"
        ),
    )
    cluster: bool = Field(
        False,
        description=(
            "the Redis URL names one node of a Redis Cluster (deploy/README.md says when to "
            "use one)"
        ),
    )


class RateLimitSettings(_Model):
    """The tenants' token buckets, and what they do when Redis fails."""

    failure_mode: Literal["local", "allow", "deny"] = Field(
        "local",
        description=(
            "when a Redis call fails: `local` (this process's own buckets at limit ÷ "
            "(`replicas` × `--workers`)), `allow` (unlimited), or `deny` (503, code "
            "`ratelimit_store_unavailable`, outcome `rejected`, `Retry-After` the breaker's "
            "remaining cooldown; only while the breaker is open: failures before that are "
            "answered from the local share)"
        ),
    )
    replicas: int = Field(
        1,
        gt=0,
        description=(
            "gateway replicas sharing the limits; sizes the `local` share only, Redis mode is "
            "exact whatever the count"
        ),
    )
    failure_threshold: int = Field(
        3,
        gt=0,
        description=(
            "consecutive failed calls before the limiter stops calling Redis, for `cooldown_s`"
        ),
    )
    cooldown_s: float = Field(
        5.0,
        gt=0,
        description=(
            "how long the limiter stays off Redis after `failure_threshold` failures; then one "
            "call probes it and shared limiting resumes by itself (`spillgate_ratelimit_mode`). "
            "Whatever the cooldown, while the limiter is off Redis each process also probes it "
            "every second off the request path (a small write, within the time budget; one "
            "that fails counts no store error), so the mode turns `shared` again within about "
            "a second of Redis taking writes, on a replica with no traffic too"
        ),
    )
    slice_s: float = Field(
        0.5,
        ge=0,
        le=5,
        description=(
            "with Redis: a decision that admits also takes up to this many seconds of the "
            "tenant's refill (at most a quarter of what each bucket holds), and this process "
            "decides the tenant's next requests from that slice without a round trip until it "
            "is spent or lapses, when the rest goes back (gateway/ratelimit/redis_limiter.py); "
            "every slice is debited in Redis first, so limits stay exact across replicas, and "
            "a tight or nearly empty bucket yields none. The cost: other replicas see an "
            "unspent slice as used for at most `slice_s`. `0`: every request asks Redis"
        ),
    )


class LedgerSettings(_Model):
    """The in-flight ledger shared through Redis (when a Redis URL is configured): each
    replica holds one lease per backend, a block of the backend's room that Redis granted it
    (what its requests hold plus a spare, `spare` of the room left), and admits within it
    without a call, asking Redis only when a request does not fit. When Redis refuses a
    request for room other blocks hold spare, the refusal is published: no block gets a spare
    for 5 × `refresh_s`, each gives its spare back at once, and releases are given back (and
    published) as they happen."""

    lease_ttl_s: float = Field(
        10.0,
        gt=0,
        description="a lease's time to live: a dead replica's reservations are freed within it",
    )
    refresh_s: float = Field(
        0.2,
        gt=0,
        description=(
            "how often each block is renewed and sized again to its requests and totals are "
            "read, so other replicas see this one's releases within it; at most a third of "
            "`lease_ttl_s`"
        ),
    )
    spare: float = Field(
        0.125,
        ge=0,
        le=0.5,
        description=(
            "the share of the room left beyond its requests that a replica's block holds, "
            "admitted without a call (gateway/admission/ledger_redis.py); `0`: every "
            "admission and release asks Redis, as exact at the margin as one process"
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> LedgerSettings:
        if self.refresh_s * 3 > self.lease_ttl_s:
            raise ValueError("refresh_s must be at most a third of lease_ttl_s")
        return self


class ServerSettings(_Model):
    """The gateway's listener, the bounds on what clients send, and its upstream connections."""

    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8080, ge=0, le=65535, description="listen port")
    max_body_bytes: int = Field(
        1 << 20,
        gt=0,
        description="larger request bodies get 413 and a closed connection",
    )
    max_header_bytes: int = Field(
        16 * 1024,
        gt=0,
        description=(
            "names and values of all request headers; larger request heads get 431 and a "
            "closed connection"
        ),
    )
    request_read_timeout_s: float = Field(
        30.0, gt=0, description="the whole request body must arrive by then, else 408"
    )
    admin_token_env: str = Field(
        "SPILLGATE_ADMIN_TOKEN", description="env variable holding the admin token"
    )
    upstream_max_connections: int = Field(
        1024,
        gt=0,
        description=(
            "upstream connections in use at once, over all backends and providers (a request "
            "past it waits for one to be given back); an idle connection is kept 4 s for the "
            "next request, under uvicorn's 5 s, after which vLLM and SGLang close it"
        ),
    )
    upstream_max_header_bytes: int = Field(
        60 * 1024,
        gt=0,
        description=(
            "a bound on each upstream answer's head, as Envoy's: bytes of header names and "
            "values, with any informational (1xx) answers before it and its trailers counted "
            "in; an upstream past it or `upstream_max_headers` fails that attempt (as a "
            "protocol error) and its connection is closed (gateway/upstream/http.py)"
        ),
    )
    upstream_max_headers: int = Field(
        100,
        gt=0,
        description="the same bound in header fields, 1xx answers and trailers counted in",
    )


class TracingSettings(_Model):
    """OpenTelemetry spans, exported over OTLP/HTTP (gateway/tracing.py; see
    [Traces](traces.md)); off by default."""

    enabled: bool = Field(
        False,
        description=(
            "OpenTelemetry spans for every completion request, exported over OTLP/HTTP; off, "
            "a request makes one check and no span"
        ),
    )
    otlp_endpoint: str | None = Field(
        None,
        description=(
            "the collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318` "
            "(`/v1/traces` is added); none: `$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is, "
            "else `$OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`, else "
            "`http://localhost:4318/v1/traces`"
        ),
    )
    service_name: str = Field(
        "spillgate",
        min_length=1,
        description=(
            "the `service.name` resource attribute (`$OTEL_RESOURCE_ATTRIBUTES` adds others)"
        ),
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description=(
            "share of traces the gateway starts that are recorded; a client's `traceparent` "
            "decides for its own trace (parent-based)"
        ),
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)


class BatchSettings(_Model):
    """The batch tier (gateway/batch/; see [Batches](batches.md)): OpenAI's files and
    batches API, run on spare room. Files, batches and results live under `dir` or, when a
    Redis URL is configured, in Redis, shared by every replica."""

    dir: str = Field(
        ".spillgate/batch",
        min_length=1,
        description=(
            "where files, batches and results live without Redis (relative to the working "
            "directory, so they survive a restart; give a volume's path in a container)"
        ),
    )
    max_fill: float = Field(
        0.6,
        gt=0,
        le=1,
        description=(
            "batch items run only while their pool's fill, counting the item, stays at or "
            "below this"
        ),
    )
    window_s: float = Field(
        86_400.0,
        gt=0,
        description=(
            'what `completion_window: "24h"` means: a batch not done by then ends `expired`'
        ),
    )
    results_ttl_s: float = Field(
        7 * 86_400.0, gt=0, description="how long output and error files are kept"
    )
    max_files: int = Field(
        100, gt=0, description="per tenant: files held (over: 429 `file_limit_exceeded`)"
    )
    max_file_bytes: int = Field(
        100 * 1024 * 1024,
        gt=0,
        description=(
            "per tenant: bytes per file (over: 429 `file_limit_exceeded`, 413 for one file "
            "over the body limit)"
        ),
    )
    max_total_bytes: int = Field(
        1024 * 1024 * 1024,
        gt=0,
        description="per tenant: bytes in all its files (over: 429 `file_limit_exceeded`)",
    )
    max_queued_tokens: int = Field(
        10_000_000,
        gt=0,
        description=(
            "per tenant: estimated tokens (prompt + max_tokens) of batches not yet ended "
            "(over: 429 `token_limit_exceeded`)"
        ),
    )
    max_items: int = Field(50_000, gt=0, description="lines per file")
    concurrency: int = Field(8, gt=0, description="items one process runs at once")
    poll_s: float = Field(0.2, gt=0, description="how often the runner looks for work")
    claim_ttl_s: float = Field(
        600.0,
        gt=0,
        description=("how long an item a dead process claimed waits before it runs elsewhere"),
    )
    redis_timeout_s: float = Field(
        5.0,
        gt=0,
        description=(
            "with Redis, the time budget of each batch-store call (on connections of its own: "
            "a whole file moves in one call)"
        ),
    )


class Settings(_Model):
    """A gateway's whole configuration, one YAML file."""

    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    ratelimit: RateLimitSettings = RateLimitSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenants: list[TenantSettings] = Field(min_length=1)
    pools: list[PoolSettings] = Field(min_length=1)
    providers: list[ProviderSettings] = Field(default_factory=list)
    tracing: TracingSettings = TracingSettings()
    batch: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _references(self) -> Settings:
        problems = reference_problems(self.model_dump())
        if problems:
            raise Problems(problems)
        return self


class ConfigError(Exception):
    """Every problem of one config file, one line each (file, line, key path, problem)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    settings: Settings
    document: ConfigDocument  # tells a later problem (the environment's) on its line


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _positive_or_auto(value: Any, *, unit: str, kind: Any) -> Any:
    positive = isinstance(value, kind) and not isinstance(value, bool) and value > 0
    if not positive and value != "auto":
        raise ValueError(f"should be a positive number of {unit} or 'auto', not {value!r}")
    return value


def _http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"should start with http:// or https://, not {url!r}")
    return url


def validate(data: Any) -> tuple[Settings | None, list[Problem]]:
    """The settings, or every problem of `data` at once: the references between its parts
    are checked even where some part is malformed."""
    if data is None:
        return None, [Problem(loc=(), message="the file is empty: it needs tenants and pools")]
    try:
        return Settings.model_validate(data), []
    except ValidationError as exc:
        problems = describe(exc.errors(), root=Settings)
        if not any(isinstance(e.get("ctx", {}).get("error"), Problems) for e in exc.errors()):
            problems += reference_problems(data)  # the model's own check never ran
        return None, problems


def parse_settings(data: Any, *, source: str = "<config>") -> Settings:
    return _settings(data, ConfigDocument(name=source))


def _settings(data: Any, document: ConfigDocument, *, also: Sequence[Problem] = ()) -> Settings:
    settings, problems = validate(data)
    if settings is None or also:
        raise ConfigError(document.name, document.lines([*also, *problems]))
    return settings


def load_config(path: str | Path) -> LoadedConfig:
    """The file's settings, or a ConfigError with every problem of the file."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(name, [f"{name}: cannot be read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(name, [f"{name}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        document = ConfigDocument.parse(name, text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, [yaml_syntax(name, exc)]) from None
    settings = _settings(data, document, also=document.repeated_keys())
    return LoadedConfig(settings=settings, document=document)


def load_settings(path: str | Path) -> Settings:
    return load_config(path).settings
