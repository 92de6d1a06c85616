"""A capacity plan: one replica's KV cache and speed, then the replicas a workload needs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.capacity import kv, throughput
from gateway.capacity.catalog import CapacityError, GpuSpec, ModelSpec
from gateway.capacity.perf import ReplicaProfile
from gateway.capacity.profile import ReplicaOptions, build_profile, memory_budget
from gateway.capacity.throughput import LoadPoint, Workload

# the gateway's own default `target_fill` (gateway/config/pools.py): a plan sizes the fleet
# at the fill its gateway will run it at
DEFAULT_TARGET_FILL = 0.9
# the session a plan assumes when the workload's lengths are not given
DEFAULT_PROMPT_TOKENS = 1536
DEFAULT_OUTPUT_TOKENS = 512


@dataclass(frozen=True, kw_only=True)
class Demand:
    """Requests per second, or concurrent sessions, at peak before the burst factor."""

    rps: float | None = None
    sessions: int | None = None
    burst: float = 1.0
    target_fill: float = DEFAULT_TARGET_FILL
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None  # the inter-token latency objective: a step's time

    def __post_init__(self) -> None:
        for flag, slo in (("--ttft-slo-ms", self.ttft_slo_s), ("--itl-slo-ms", self.itl_slo_s)):
            if slo is not None and slo <= 0:
                raise CapacityError(f"{flag} must be more than 0")
        if self.rps is not None and self.sessions is not None:
            raise CapacityError("give --rps or --sessions, not both")
        if not 0 < self.target_fill <= 1:
            raise CapacityError("--target-fill must be in (0, 1]")
        if self.burst < 1:
            raise CapacityError("--burst must be at least 1")


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    gpu: GpuSpec
    options: ReplicaOptions
    workload: Workload
    demand: Demand
    budget: kv.MemoryBudget
    profile: ReplicaProfile
    max_concurrency: float
    sessions_per_replica: int  # at the KV bound
    sessions_without_sharing: int  # at the KV bound, each session holding all its blocks
    running_limit: int  # the KV bound, or max_num_seqs when lower
    at_bound: LoadPoint
    knee: int
    slo_sessions: int | None  # most sessions within the TTFT SLO, when one is given
    itl_sessions: int | None  # most sessions whose step is within the ITL SLO, when given
    sessions_at_fill: int
    at_fill: LoadPoint
    replica_tokens_per_s: float  # prompt + output tokens/s one replica serves at target fill
    peak_tokens_per_s: float | None
    replicas_needed: int | None
    warnings: tuple[str, ...]
    # the workload's options left to their defaults (`--prompt-tokens`, ...): the plan says so
    assumed: tuple[str, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.profile.step_cost.kv_bytes_per_token_per_rank)

    @property
    def shared_prompt_blocks(self) -> int:
        return kv.shared_prompt_blocks(
            shared_prompt_tokens=self.workload.shared_prompt_tokens,
            shared_share=self.workload.shared_share,
            block_size=self.profile.block_size,
        )

    @property
    def lora_blocks(self) -> int:
        """KV blocks the LoRA buffers displace (none from a pool given outright)."""
        if not self.budget.lora_taken_gib:
            return 0
        page = kv.block_bytes_per_layer(
            self.model,
            tp=self.options.tp,
            kv_dtype=self.options.kv_dtype,
            block_size=self.profile.block_size,
        )
        without = kv.num_gpu_blocks(
            kv_cache_bytes=self.budget.kv_cache_without_lora_gib * kv.GIB,
            block_bytes=page,
            layers=self.model.layers,
        )
        return without - self.profile.num_gpu_blocks

    @property
    def gpus_needed(self) -> int | None:
        return None if self.replicas_needed is None else self.replicas_needed * self.options.tp


def sessions_at_fill(sessions: int, demand: Demand, *caps: int | None) -> int:
    """The sessions a replica is run at: `target_fill` of its running limit, lowered to each
    cap an objective sets (never below one session)."""
    at_fill = max(1, math.floor(sessions * demand.target_fill))
    return min([at_fill, *(max(1, cap) for cap in caps if cap is not None)])


def _peak_tokens_per_s(demand: Demand, workload: Workload, at_fill: LoadPoint) -> float | None:
    if demand.rps is not None:
        return demand.rps * workload.tokens * demand.burst
    if demand.sessions is not None:
        per_session_rps = at_fill.output_tokens_per_s / at_fill.running / workload.output_tokens
        return demand.sessions * demand.burst * per_session_rps * workload.tokens
    return None


def _seqs_warnings(profile: ReplicaProfile, sessions: int) -> list[str]:
    if profile.max_num_seqs is None or sessions <= profile.max_num_seqs:
        return []
    return [
        f"the KV cache holds {sessions} sessions but vLLM runs at most max_num_seqs="
        f"{profile.max_num_seqs} at once; the speed figures are for {profile.max_num_seqs}"
    ]


def slo_warning(
    name: str, *, slo_s: float | None, sessions: int | None, single_s: float
) -> list[str]:
    """A warning when an objective is given and even one session per replica misses it."""
    if slo_s is None or sessions:
        return []
    return [
        f"even one session misses the {name} SLO of {slo_s * 1e3:.0f} ms "
        f"(predicted {single_s * 1e3:.0f} ms); the plan sizes for one session per replica"
    ]


def make_plan(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    options: ReplicaOptions,
    workload: Workload,
    demand: Demand,
    assumed: tuple[str, ...] = (),
) -> Plan:
    profile = build_profile(model, gpu, options)
    sessions = throughput.kv_bound(profile, workload)
    running = throughput.running_limit(profile, workload)
    slo_sessions = None
    if demand.ttft_slo_s is not None:
        slo_sessions = throughput.max_sessions_within(profile, workload, ttft_s=demand.ttft_slo_s)
    itl_sessions = None
    if demand.itl_slo_s is not None:
        itl_sessions = throughput.max_sessions_within_itl(profile, workload, itl_s=demand.itl_slo_s)
    at_fill = throughput.predict(
        profile, workload, sessions_at_fill(running, demand, slo_sessions, itl_sessions)
    )
    replica_tokens_per_s = at_fill.output_tokens_per_s * workload.tokens / workload.output_tokens
    peak = _peak_tokens_per_s(demand, workload, at_fill)
    replicas = None if peak is None else max(1, math.ceil(peak / replica_tokens_per_s - 1e-9))
    single = throughput.predict(profile, workload, 1)
    return Plan(
        model=model,
        gpu=gpu,
        options=options,
        workload=workload,
        demand=demand,
        budget=memory_budget(model, gpu, options),
        profile=profile,
        max_concurrency=kv.max_concurrency(
            num_blocks=profile.num_gpu_blocks,
            block_size=profile.block_size,
            max_model_len=profile.max_model_len or model.max_position,
        ),
        sessions_per_replica=sessions,
        sessions_without_sharing=profile.sessions_at_kv_bound(workload.tokens),
        running_limit=running,
        at_bound=throughput.predict(profile, workload, running),
        knee=throughput.knee(profile, workload),
        slo_sessions=slo_sessions,
        itl_sessions=itl_sessions,
        sessions_at_fill=at_fill.running,
        at_fill=at_fill,
        replica_tokens_per_s=replica_tokens_per_s,
        peak_tokens_per_s=peak,
        replicas_needed=replicas,
        warnings=(
            *profile.warnings,
            *_seqs_warnings(profile, sessions),
            *slo_warning(
                "TTFT", slo_s=demand.ttft_slo_s, sessions=slo_sessions, single_s=single.ttft_s
            ),
            *slo_warning(
                "ITL", slo_s=demand.itl_slo_s, sessions=itl_sessions, single_s=single.step_s
            ),
        ),
        assumed=assumed,
    )


def _batch1_step_s(plan: Plan) -> float:
    """One session alone, its KV at the workload's mean length: the decode-only step."""
    return plan.profile.step_cost.decode_step_s(round(plan.workload.mean_kv_tokens))


def _lora_json(plan: Plan) -> dict[str, object] | None:
    lora = plan.options.lora
    if lora is None:
        return None
    return {
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "layers": list(lora.layers),
        "buffer_bytes": round(plan.budget.lora_gib * kv.GIB),
        "kv_cache_gib_taken": round(plan.budget.lora_taken_gib, 4),
        "kv_blocks_taken": plan.lora_blocks,
        "kv_tokens_taken": plan.lora_blocks * plan.profile.block_size,
    }


def plan_json(plan: Plan) -> dict[str, object]:
    budget = plan.budget
    return {
        "model": plan.model.name,
        "gpu": plan.gpu.name,
        "tp": plan.options.tp,
        "kv_dtype": plan.options.kv_dtype,
        "block_size": plan.profile.block_size,
        "max_model_len": plan.profile.max_model_len,
        "assumed": list(plan.assumed),
        "prompt_tokens": plan.workload.prompt_tokens,
        "output_tokens": plan.workload.output_tokens,
        "shared_prompt_tokens": plan.workload.shared_prompt_tokens,
        "shared_share": plan.workload.shared_share,
        "shared_prompt_blocks": plan.shared_prompt_blocks,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "usable_gib": round(budget.usable_gib, 4),
        "weights_gib": round(budget.weights_gib, 4),
        "activation_gib": round(budget.activation_gib, 4),
        "non_torch_gib": round(budget.non_torch_gib, 4),
        "lora_gib": round(budget.lora_gib, 4),
        "lora": _lora_json(plan),
        "kv_cache_gib": round(budget.kv_cache_gib, 4),
        "num_gpu_blocks": plan.profile.num_gpu_blocks,
        "kv_cache_tokens": plan.profile.kv_cache_tokens,
        "max_concurrency": round(plan.max_concurrency, 2),
        "sessions_per_replica": plan.sessions_per_replica,
        "sessions_per_replica_without_sharing": plan.sessions_without_sharing,
        "max_num_seqs": plan.profile.max_num_seqs,
        "running_limit": plan.running_limit,
        "decode_tokens_per_s": round(plan.at_bound.output_tokens_per_s, 1),
        "itl_ms": round(plan.at_bound.itl_s * 1e3, 2),
        "ttft_ms": round(plan.at_bound.ttft_s * 1e3, 1),
        "batch1_tokens_per_s": round(1 / _batch1_step_s(plan), 1),
        "knee_concurrency": plan.knee,
        "slo_sessions": plan.slo_sessions,
        "itl_sessions": plan.itl_sessions,
        "itl_ms_at_fill": round(plan.at_fill.itl_s * 1e3, 2),
        "target_fill": plan.demand.target_fill,
        "sessions_at_fill": plan.sessions_at_fill,
        "decode_tokens_per_s_at_fill": round(plan.at_fill.output_tokens_per_s, 1),
        "ttft_ms_at_fill": round(plan.at_fill.ttft_s * 1e3, 1),
        "replica_tokens_per_s_at_fill": round(plan.replica_tokens_per_s, 1),
        "peak_tokens_per_s": None
        if plan.peak_tokens_per_s is None
        else round(plan.peak_tokens_per_s, 1),
        "replicas_needed": plan.replicas_needed,
        "gpus_needed": plan.gpus_needed,
        "warnings": list(plan.warnings),
    }
