"""What one simulated vLLM replica is: its served name, KV budget, limits and speed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.capacity.lora import MAX_LORA_RANKS
from gateway.capacity.perf import StepCost
from loadtest.sim.lengths import DEFAULT_MEAN_TOKENS, DEFAULT_SIGMA, AnswerLengths

GIB = 1024**3

# An 8B model in bf16 on one H100 SXM: 16 GB of weights, 128 KiB of KV per token
# (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes), 3.35 TB/s at 60 % and
# ~1000 TFLOPS dense bf16 at 50 %.
DEFAULT_STEP_COST = StepCost(
    weights_bytes_per_rank=16e9,
    kv_bytes_per_token_per_rank=128 * 1024,
    bandwidth_bytes_per_s=3.35e12 * 0.6,
    prefill_flops_per_token=2 * 8e9,
    flops_per_s=1000e12 * 0.5,
)
DEFAULT_GPU_MEMORY_BYTES = 80 * GIB
BUILT_IN_MODEL = "llama-3.1-8b"  # the catalog's name for the built-in replica's model
ACTIVATION_RESERVE_BYTES = 1 * GIB  # what vLLM's profiling run keeps back for activations
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default on smaller GPUs


@dataclass(frozen=True, kw_only=True)
class LoraModule:
    """An adapter served from start-up: vLLM's `--lora-modules NAME=PATH`."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """`NAME=PATH`, vLLM's JSON form `{"name": ..., "path": ...}`, or a bare `NAME`
        (the simulator's shorthand: its path is its name, since nothing is read from it)."""
        if text.startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                raise ValueError(f"a LoRA module needs a name: {text}")
            return cls(name=value["name"], path=str(value.get("path") or value["name"]))
        name, _, path = text.partition("=")
        if not name:
            raise ValueError(f"a LoRA module needs a name: {text!r}")
        return cls(name=name, path=path or name)


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded adapter as the engine knows it: `lora_id` is vLLM's `lora_int_id`, 1, 2, ...
    in the order adapters were loaded. `hash_key` stands for what vLLM adds to each of its
    KV block hashes, its name and path, so its blocks are never the base model's or another
    adapter's; a digest, not `hash()`, keeps it the same in every process."""

    name: str
    path: str
    lora_id: int
    hash_key: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digest = hashlib.blake2b(f"{self.name}\0{self.path}".encode(), digest_size=8).digest()
        object.__setattr__(self, "hash_key", int.from_bytes(digest, "big"))


class KvTransfer(StrEnum):
    """How a replica takes part in disaggregated prefill/decode (loadtest/sim/kv_transfer.py):
    PARAMS as vLLM's NixlConnector, the prefill leg's answer carrying `kv_transfer_params`
    that the decode leg brings; SHARED as its ExampleConnector, prompts' KV kept in a
    folder both engines read, keyed by the prompt's tokens."""

    PARAMS = "params"
    SHARED = "shared"


class KvLoadFailurePolicy(StrEnum):
    """vLLM's `kv_load_failure_policy`: what a KV load that fails does. FAIL (vLLM's
    default) kills the engine; RECOMPUTE computes the prompt locally instead."""

    FAIL = "fail"
    RECOMPUTE = "recompute"


class LoraLoadFailure(StrEnum):
    """How the simulator fails every `/v1/load_lora_adapter`, to test a backend that
    cannot load: NOT_FOUND as vLLM answers a path with no adapter (404), ERROR as it
    answers an adapter the engine refuses, such as a rank above --max-lora-rank (500)."""

    NOT_FOUND = "not-found"
    ERROR = "error"


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated replica.

    The KV budget is `kv_tokens` when given; else the catalog profile of `catalog_model`
    (default: `model`) on `gpu` when `gpu` is given; else the built-in 8B-on-H100 replica
    (80 GiB x gpu_memory_utilization - weights - 1 GiB for activations, in whole blocks).
    The step cost is `step_cost` when given, else the catalog's, else the built-in one.
    `max_model_len` defaults to the catalog's (else 8192), capped at the KV cache size.
    `speed` divides every step's duration (10 runs ten times faster than real time);
    `no_delay` answers at once without the engine, for overhead benchmarks.
    `vocab_size`, when given, refuses prompt token ids at or above it as vLLM does: in a
    200 stream, as an error event (a 400 when not streamed).
    `embedding_dim`, when given, makes the replica an embedding model: it serves
    /v1/embeddings (vectors of that size) and refuses the generating APIs, as vLLM does.
    `flush_interval_s` (real seconds) is the most often a stream's new tokens are written;
    the first token and the end go out at once. Tokens arriving faster are written
    together, one SSE event each, which keeps a socket write per token off busy hosts.
    `answer_lengths`: `max_tokens` (the default here, which tests rely on) runs every
    answer to its cap, and a request without `max_tokens` to `default_max_tokens`;
    `geometric` or `lognormal` (mean `answer_mean_tokens`, `answer_sigma`) end answers at a
    sampled EOS as a real model does, a request without `max_tokens` capped by the room
    left in `max_model_len` as vLLM caps it (see loadtest/sim/lengths.py). `seed` seeds
    the lengths of requests that send no seed of their own.
    `enable_prefix_caching` (on by default, as in vLLM V1) reuses the cached KV blocks of
    a prompt's leading full blocks that an earlier prompt computed (chat and completions
    prompts; see loadtest/sim/blocks.py).
    `shutdown_timeout_s` is vLLM's `--shutdown-timeout`: what SIGTERM does to the requests
    in flight under `spillgate sim` (0, vLLM's default: they end with vLLM's dead-engine
    error; N: they may run N more seconds while new ones are refused; see
    loadtest/sim/shutdown.py).
    `enable_lora` serves LoRA adapters as vLLM does (loadtest/sim/lora.py): `lora_modules`
    from start-up, at most `max_loras` distinct adapters among running requests (vLLM's
    default 1), `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` only with
    `allow_runtime_lora_updating` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); a load takes
    `lora_load_s` real seconds, and fails as `fail_lora_loads` says when it is set. A KV
    cache sized from a GPU (not `kv_tokens`) loses the adapter buffers vLLM allocates for
    `max_loras` slots of `max_lora_rank` (gateway/capacity/lora.py).
    `kv_transfer` makes the replica a prefiller and a decoder of disaggregated serving as
    vLLM's KV connectors do (loadtest/sim/kv_transfer.py): `params` (NixlConnector), or
    `shared` (ExampleConnector, its folder `kv_shared_path`). `engine_id` is the id a
    prefill answer names (default: a random one, as vLLM's); `kv_load_failure_policy`
    says what a failed load does: `fail` kills the engine, `recompute` computes locally.
    """

    model: str = "sim-model"
    kv_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: the catalog profile's with --gpu, else 256
    max_num_batched_tokens: int = 8192
    default_max_tokens: int = 256
    speed: float = 1.0
    no_delay: bool = False
    flush_interval_s: float = 0.05
    step_cost: StepCost | None = None
    gpu: str | None = None
    catalog_model: str | None = None
    tp: int = 1
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    vocab_size: int | None = None
    answer_lengths: AnswerLengths = AnswerLengths.MAX_TOKENS
    answer_mean_tokens: float = DEFAULT_MEAN_TOKENS
    answer_sigma: float = DEFAULT_SIGMA
    seed: int | None = None
    # an embedding model's vector size: it then serves /v1/embeddings only
    embedding_dim: int | None = None
    enable_prefix_caching: bool = True
    shutdown_timeout_s: float = 0.0
    # vLLM's KV events (loadtest/sim/kv_events.py): a PUB socket on this port, the replay
    # ROUTER on the next, on the replica's host; every Nth batch left off the PUB socket
    kv_events_port: int | None = None
    kv_events_drop_every: int = 0
    # a model directory's tokenizer and chat template: prompts tokenized as a real engine's
    tokenizer: str | None = None
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    allow_runtime_lora_updating: bool = False
    lora_load_s: float = 0.05
    fail_lora_loads: LoraLoadFailure | None = None
    kv_transfer: KvTransfer | None = None
    kv_shared_path: str | None = None
    engine_id: str | None = None
    kv_load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.FAIL

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if min(self.block_size, self.max_num_seqs or 1, self.default_max_tokens) < 1:
            raise ValueError("block_size, max_num_seqs and default_max_tokens must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.flush_interval_s < 0 or self.shutdown_timeout_s < 0:
            raise ValueError("flush_interval_s and shutdown_timeout_s cannot be negative")
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ValueError("kv_tokens must hold at least one block")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        # a plain string from a caller becomes the enum, or a ValueError
        object.__setattr__(self, "answer_lengths", AnswerLengths(self.answer_lengths))
        if self.answer_mean_tokens < 1 or self.answer_sigma <= 0:
            raise ValueError("answer_mean_tokens must be at least 1 and answer_sigma positive")
        self._check_lora()
        self._check_kv_transfer()

    def _check_kv_transfer(self) -> None:
        # plain strings from a caller become the enums, or a ValueError
        if self.kv_transfer is not None:
            object.__setattr__(self, "kv_transfer", KvTransfer(self.kv_transfer))
        policy = KvLoadFailurePolicy(self.kv_load_failure_policy)
        object.__setattr__(self, "kv_load_failure_policy", policy)
        if (self.kv_transfer is KvTransfer.SHARED) != (self.kv_shared_path is not None):
            raise ValueError("kv_shared_path goes with kv_transfer 'shared', and only with it")
        if self.kv_transfer is not None and self.no_delay:
            raise ValueError("kv_transfer needs the engine: it cannot go with no_delay")

    def _check_lora(self) -> None:
        if self.fail_lora_loads is not None:
            object.__setattr__(self, "fail_lora_loads", LoraLoadFailure(self.fail_lora_loads))
        if not self.enable_lora:
            if self.lora_modules or self.allow_runtime_lora_updating or self.fail_lora_loads:
                raise ValueError("LoRA modules and loading need enable_lora")
            return
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}")
        if self.lora_load_s < 0:
            raise ValueError("lora_load_s cannot be negative")
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("each LoRA module needs its own name")
        if self.model in names:
            raise ValueError(f"The lora adapter '{self.model}' conflicts with a served base model.")


@dataclass(frozen=True, kw_only=True)
class ResolvedSim:
    """The numbers the engine runs on, after the catalog and defaults are applied."""

    num_blocks: int
    block_size: int
    max_model_len: int
    step_cost: StepCost
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


def _default_num_blocks(config: SimConfig, cost: StepCost) -> int:
    free = (
        DEFAULT_GPU_MEMORY_BYTES * config.gpu_memory_utilization
        - cost.weights_bytes_per_rank
        - ACTIVATION_RESERVE_BYTES
    )
    return int(free // (cost.kv_bytes_per_token_per_rank * config.block_size))


def _catalog(config: SimConfig) -> tuple[int, StepCost, int | None, int | None]:
    from gateway.capacity import replica_profile

    profile = replica_profile(
        model=config.catalog_model or config.model,
        gpu=config.gpu or "",
        tp=config.tp,
        kv_dtype=config.kv_dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
    )
    return profile.num_gpu_blocks, profile.step_cost, profile.max_model_len, profile.max_num_seqs


def _lora_blocks(config: SimConfig, cost: StepCost) -> int:
    """The KV blocks the adapter buffers displace: vLLM counts them with the weights."""
    from gateway.capacity import load_catalog
    from gateway.capacity.lora import LoraOptions, lora_buffer_bytes

    name = (config.catalog_model or config.model) if config.gpu is not None else BUILT_IN_MODEL
    taken = lora_buffer_bytes(
        load_catalog().model(name),
        LoraOptions(max_loras=config.max_loras, max_lora_rank=config.max_lora_rank),
        tp=config.tp,
    )
    per_block = cost.kv_bytes_per_token_per_rank * config.block_size
    return -(-taken // int(per_block))


def resolve(config: SimConfig) -> ResolvedSim:
    catalog_len: int | None = None
    catalog_seqs: int | None = None
    if config.gpu is not None:
        num_blocks, cost, catalog_len, catalog_seqs = _catalog(config)
        cost = config.step_cost or cost
    else:
        cost = config.step_cost or DEFAULT_STEP_COST
        num_blocks = _default_num_blocks(config, cost)
    if config.enable_lora and config.kv_tokens is None:
        num_blocks -= _lora_blocks(config, cost)
    if config.kv_tokens is not None:
        num_blocks = config.kv_tokens // config.block_size
    if num_blocks < 1:
        raise ValueError("no room for a KV cache block: the model does not fit this GPU")
    kv_tokens = num_blocks * config.block_size
    max_model_len = config.max_model_len or min(catalog_len or DEFAULT_MAX_MODEL_LEN, kv_tokens)
    if max_model_len > kv_tokens:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the {kv_tokens} tokens the KV cache "
            "can hold; lower max_model_len or raise kv_tokens"
        )
    return ResolvedSim(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
        step_cost=cost,
        max_num_seqs=config.max_num_seqs or catalog_seqs or DEFAULT_MAX_NUM_SEQS,
    )
