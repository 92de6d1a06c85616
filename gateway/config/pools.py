"""A pool: the model clients name, its backends, how it admits and routes, and its overflow
chain, with the answer cache and the reservation of output it uses."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from gateway.config.base import (
    PolicyName,
    PoolKind,
    Timeouts,
    _http_url,
    _Model,
    _positive_or_auto,
)
from gateway.config.queue import QueueSettings


class KvEventsSettings(_Model):
    """Where a backend publishes its KV cache's events (vLLM's `--kv-events-config`)."""

    endpoint: str = Field(
        description=(
            "the engine's ZMQ PUB socket, `tcp://HOST:PORT` (vLLM's `endpoint`, which it binds "
            "as `tcp://*:PORT`)"
        ),
    )
    replay: str | None = Field(
        None,
        description=(
            "the engine's replay ROUTER socket, `tcp://HOST:PORT` (vLLM's `replay_endpoint`): "
            "how the gateway learns what the engine cached before it subscribed, and catches "
            "up after missing batches; none: the view starts empty and is cleared after a gap"
        ),
    )
    topic: str = Field("", description="the topic the engine publishes under (vLLM's `topic`)")

    @field_validator("endpoint", "replay")
    @classmethod
    def _tcp(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://")):
            raise ValueError("must be a ZMQ address, tcp://HOST:PORT or ipc://PATH")
        return value


def _backend_url(url: str) -> str:
    """A backend is named by its server's root: the gateway calls `/v1/models`, `/metrics`,
    `/health` and the API beside them. A provider's `base_url` includes `/v1`, so the suffix
    is the natural slip, and with it every call answers 404."""
    stripped = url.rstrip("/")
    if urlsplit(stripped).path.endswith("/v1"):
        root = stripped.removesuffix("/v1")
        raise ValueError(f"drop the `/v1` (the gateway adds the paths it calls): {root!r}")
    return url


class BackendSettings(_Model):
    """One server of the pool."""

    url: str = Field(
        description=(
            "the server's root URL, `http://` or `https://`, without `/v1` (the gateway adds "
            "the paths it calls): `http://vllm-0:8000`"
        )
    )
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
    kv_events: KvEventsSettings | None = Field(
        None,
        description=(
            "the engine's KV events (vLLM: `--kv-events-config '{\"enable_kv_cache_events\": "
            'true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558"}\'`): with the pool\'s `tokenizer` and '
            "`routing: prefix`, the blocks the engine really holds (stored, less evicted, as "
            "it reports them) score the backend instead of the gateway's guess; each process "
            "subscribes itself, nothing of it goes through Redis. `/admin/status` says per "
            "backend which index it uses and how far behind its view is"
        ),
    )

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _backend_url(_http_url(url))

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, value: Any) -> Any:
        return _positive_or_auto(value, unit="tokens", kind=int)


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
            "`vllm:num_requests_running`, `vllm:num_requests_waiting`, "
            "`vllm:num_preemptions_total` (SGLang: `sglang:token_usage`, "
            "`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_retracted_reqs`), "
            "0.4 s budget; admit against the larger of the ledger and what the backend holds "
            "(traffic that bypasses the gateway counts); a preemption, or requests waiting "
            "inside the backend on two reads in a row while its KV cache is at least "
            "`target_fill` full, sets the backend's effective fill to 0.8 × the lower of it "
            "and `target_fill` (down to a tenth of `target_fill`), which then recovers by 0.01 "
            "a second while the backend is busy, and back to `target_fill` at once on the "
            "second read in a row that shows nothing running and nothing waiting (a backend "
            "that reports no running count is never idle); while the ledger holds at least "
            "half the target, the highest recent ratio of what the backend holds to what the "
            "ledger reserves (starting at 1, coming down by at most 0.03 a second of such "
            "reads) raises the effective fill towards `target_fill` ÷ that "
            "ratio, by at most 0.1 × `target_fill` a second of such reads, never past the whole "
            "KV cache, and a back-off resets it; a read older than 3 s is not used (the "
            "ledger alone, at `target_fill`). `false`: the ledger alone"
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
            "pool's mean fill and over 0.1 above it is passed over, counting below half the "
            "target fill only the tokens of the request's own prefix there: a hot prefix "
            "spreads over several backends, a tenant's prompt stays where it is cached "
            "however other tenants' requests fall. `least_filled`: the backend with the most "
            "room, prompts unread"
        ),
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "a directory of the served model's tokenizer files, as Hugging Face lays them out "
            "(`tokenizer.json`, and `tokenizer_config.json` with the chat template, or "
            "`chat_template.jinja`): baked into the gateway's image or mounted from the "
            "volume the engines load the model from. With it, a prompt that may share blocks "
            "with requests in flight (backends that cache prefixes), or is routed by `kv_events`, "
            "is tokenized in process as the engine does it: its exact size is reserved, and "
            "its shared blocks are counted exactly instead of guessed from its bytes with a "
            "block of margin. Without it, backends that publish `kv_events` are scored by the "
            "gateway's own index"
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
