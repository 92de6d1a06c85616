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


# a backend's part where prefill and decode run on different engines
BackendRole = Literal["both", "prefill", "decode"]


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
            "where the engine publishes its KV events (vLLM's `--kv-events-config`): with the "
            "pool's `tokenizer` and `routing: prefix`, what the engine really caches scores the "
            "backend ([how](architecture.md#kv-events))"
        ),
    )

    role: BackendRole = Field(
        "both",
        description=(
            "its part where prefill and decode run on different engines: `prefill` computes "
            "prompts for the pool's other backends (the prefill leg; it takes no request of "
            "its own), `decode` and `both` serve requests, given the prompt's KV by a prefill "
            "backend when the pool's `prefill` rule says so "
            "([how](architecture.md#prefill-and-decode))"
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


class AdapterSettings(_Model):
    """A LoRA adapter of the pool's model, asked for by its own name."""

    name: str = Field(
        min_length=1,
        description=(
            "the model name clients send for it, as the engines serve it (vLLM's "
            "`--lora-modules NAME=PATH`)"
        ),
    )
    tenants: list[str] = Field(
        default_factory=list,
        description=(
            "the tenants that may use it; empty: every tenant that may use the pool. Any "
            "other is told the model does not exist"
        ),
    )
    path: str | None = Field(
        None,
        description=(
            "where the engines load it from (vLLM's `lora_path`): with it, a request for the "
            "adapter that no backend serves has it loaded on the least filled backend that "
            "can (`POST /v1/load_lora_adapter`; vLLM needs "
            "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), and where those serving it are full, on "
            "one more with room; without it, such a request is refused"
        ),
    )
    max_backends: int | None = Field(
        None,
        gt=0,
        description=(
            "the most backends the gateway spreads the adapter to when those serving it are "
            "full (counting every backend that serves it, loaded by the gateway or at the "
            "engine's start-up); none: every backend of the pool"
        ),
    )
    degrade_to: str | None = Field(
        None,
        description=(
            "the adapter of the pool's `degrade_to` pool that `degrade` asks for in its "
            "place; none: a request for this adapter is not degraded (the next step takes it)"
        ),
    )


class PrefillSettings(_Model):
    """When a pool with `role: prefill` backends sends a request's prompt to one first, and
    how the decode engine gets its KV ([how](architecture.md#prefill-and-decode))."""

    kv_transfer: Literal["params", "shared"] = Field(
        "params",
        description=(
            "how the engines pass a prompt's KV: `params`, the prefill answer's "
            "`kv_transfer_params` handed to the decode leg (vLLM's NixlConnector, P2pNccl, "
            "Mooncake); `shared`, a store both engines read by the prompt's tokens, nothing "
            "handed on (vLLM's ExampleConnector, LMCache)"
        ),
    )
    min_prompt_tokens: int = Field(
        256,
        ge=0,
        description=(
            "a prompt with fewer tokens than this not already cached on its decode backend "
            "goes to the decode backend alone, which prefills it itself: a short prompt costs "
            "less there than a second leg"
        ),
    )


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
    """How much output a request reserves on admission: the expected output, learned from the
    pool's recent answers (`prior_tokens` until it has `min_samples`)
    ([how](architecture.md#reserving-output))."""

    mode: Literal["learned", "max_tokens"] = Field(
        "learned",
        description=(
            "`learned`: the prompt plus the expected output, a stream's reservation growing with "
            "the tokens relayed; `max_tokens`: the prompt plus `max_tokens`, held to the end "
            "([how](architecture.md#reservation-modes))"
        ),
    )
    quantile: float = Field(
        0.9, gt=0, le=1, description="the quantile of the completion lengths seen in the pool"
    )
    quantile_of: Literal["backend", "answer"] = Field(
        "backend",
        description=(
            "`backend`: the figure that keeps the answers a backend holds at once within "
            "`quantile` together (mean plus z × sd / √n, never more than one answer's own "
            "quantile); `answer`: each answer's own quantile"
        ),
    )
    hold: Literal["peak", "whole"] = Field(
        "peak",
        description=(
            "what a streaming request reserves once the pool has `min_samples` answers: `peak`, "
            "the most it is expected to hold at once, or `whole`, its whole expected answer "
            "([how](architecture.md#what-a-stream-holds))"
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
    adapters: list[AdapterSettings] = Field(
        default_factory=list,
        description=(
            "the LoRA adapters of the pool's model that clients may ask for: a request for "
            "one goes only to a backend whose `/v1/models` lists it"
        ),
    )
    max_loaded_adapters: int | None = Field(
        None,
        gt=0,
        description=(
            "the most adapters the gateway itself keeps loaded on one backend: loading one "
            "more first unloads the least recently used of those it loaded there "
            "(`POST /v1/unload_lora_adapter`), never one the engine was started with nor one "
            "with requests in flight there; none: it never unloads one"
        ),
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
            "admit against the larger of the ledger and what each backend reports holding, and "
            "back its fill off on preemptions or requests waiting inside it. `false`: the ledger "
            "alone ([how](architecture.md#feedback-from-the-backends))"
        ),
    )
    routing: str = Field(
        "prefix",
        description=(
            "the routing profile that picks a request's backend: `prefix`, the one likeliest "
            "to hold the prompt's leading blocks cached, unless that overloads it; "
            "`least_filled`, the one with the most room; or a profile of `routing_profiles` "
            "([how](architecture.md#routing))"
        ),
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "a directory of the served model's Hugging Face tokenizer files: with it, prompts that "
            "may share cached blocks are tokenized as the engine does, so their exact size is "
            "reserved ([how](architecture.md#the-tokenizer))"
        ),
    )
    prefill: PrefillSettings = PrefillSettings()
    continue_streams: int = Field(
        2,
        ge=0,
        le=5,
        description=(
            "how many times a stream whose backend broke off mid-answer goes on on another "
            "backend, so the client sees one unbroken stream. `0`: off, for backends with no "
            "continuation (TGI's Messages API) ([how](architecture.md#continuing-a-stream))"
        ),
    )
    preempt: list[Literal["sheddable", "standard"]] = Field(
        ["sheddable"],
        description=(
            "the classes whose requests in flight a waiter of a higher class may stop to take "
            "their room, each request at most once; a stopped stream goes on where it left "
            "off once room frees. `[]`: never; `critical` is never preempted "
            "([how](architecture.md#preemption))"
        ),
    )
