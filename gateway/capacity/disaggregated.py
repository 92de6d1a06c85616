"""Prefill and decode on separate engines, sized apart, against the same workload unified.

A prefill engine holds a prompt only while it computes it, then hands its KV to a decode
engine; a decode engine holds prompt plus answer for the stream's life and never stops to
prefill. Both are the replica of `perf.py` (the same KV pool and step costs); what differs
is which steps each runs. For λ requests/s (burst included) of P prompt and O output tokens:

Prefill engines. A prompt takes S = prefill(P) of one engine's compute. Each engine is
taken as one server with Poisson arrivals and a fixed service time (M/D/1): at utilization
ρ a prompt waits ρ S / (2 (1 − ρ)) on average before its turn. The time to first token is

    TTFT = wait + S + KV transfer + the decode engine's first step

(its first step as in throughput.py: the rest of the step in flight, then one step). The
TTFT objective leaves W for the wait, so ρ ≤ 2W / (S + 2W), and never above target_fill;
prefill engines = ceil(λ S / ρ).

Decode engines. A decode engine's step is the batch's decode alone. It runs B sessions:
target_fill of its running limit (the KV bound for P + O tokens a session, or max_num_seqs),
lowered to the most whose step is within the ITL objective. One engine makes B / step
output tokens/s; decode engines = ceil(λ O / that).

KV transfer. Each request moves its prompt's KV, P x KV bytes per token over all ranks,
from a prefill engine to a decode engine; each rank over its own link.

Unified engines are the plan of `plan.py` for the same demand and objectives; their step
carries the prefills of the sessions that start in it, spread over the batch as the
throughput model spreads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.capacity import kv, throughput
from gateway.capacity.catalog import CapacityError
from gateway.capacity.perf import ReplicaProfile
from gateway.capacity.plan import Demand, Plan, sessions_at_fill, slo_warning
from gateway.capacity.throughput import Workload

# a link per GPU that any RDMA fabric for disaggregated serving offers (a 100 GbE NIC);
# 400 Gbit/s InfiniBand, or NVLink within a node, is faster
DEFAULT_KV_TRANSFER_GBPS = 100.0


@dataclass(frozen=True, kw_only=True)
class PrefillSizing:
    prefill_s: float  # one prompt on an idle engine
    utilization_cap: float  # the most the TTFT objective (and target_fill) allows
    utilization: float  # at the replicas chosen
    wait_s: float  # the mean queue wait at that utilization
    replicas: int
    ttft_reachable: bool  # False when even an idle engine misses the TTFT objective

    @property
    def prompts_per_s(self) -> float:
        """What one engine computes when never idle."""
        return 1 / self.prefill_s


@dataclass(frozen=True, kw_only=True)
class DecodeSizing:
    running_limit: int  # the KV bound for prompt + answer, or max_num_seqs when lower
    itl_sessions: int | None  # most sessions whose step is within the ITL objective
    sessions: int  # the sessions each engine is sized to run
    step_s: float  # at that batch: the inter-token latency
    replicas: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.sessions / self.step_s


@dataclass(frozen=True, kw_only=True)
class KvTransfer:
    bytes_per_request: int  # the prompt's KV over all ranks
    bytes_per_s: float  # at the peak rate
    link_gbps: float  # each GPU's link
    transfer_s: float  # one request's, each rank sending its share over its own link
    link_load: float  # the share of the prefill GPUs' links the rate takes

    @property
    def gbps_needed(self) -> float:
        return self.bytes_per_s * 8 / 1e9


@dataclass(frozen=True, kw_only=True)
class DisaggregatedPlan:
    unified: Plan
    requests_per_s: float  # the peak, burst included
    prefill: PrefillSizing
    decode: DecodeSizing
    transfer: KvTransfer
    ttft_s: float
    warnings: tuple[str, ...]

    @property
    def prefill_gpus(self) -> int:
        return self.prefill.replicas * self.unified.options.tp

    @property
    def decode_gpus(self) -> int:
        return self.decode.replicas * self.unified.options.tp

    @property
    def gpus(self) -> int:
        return self.prefill_gpus + self.decode_gpus

    @property
    def unified_gpus(self) -> int:
        # make_disaggregated_plan refuses a plan without a rate, so there is always a count
        return self.unified.gpus_needed or 0

    @property
    def cheaper(self) -> str:
        if self.gpus == self.unified_gpus:
            return "equal"
        return "disaggregated" if self.gpus < self.unified_gpus else "unified"

    @property
    def unified_prefill_step_s(self) -> float:
        """A unified step that carries one prompt's prefill (a chunk of at most vLLM's
        max_num_batched_tokens): the inter-token latency of the streams it interrupts."""
        u = self.unified
        chunk = min(u.workload.prompt_tokens, kv.PROFILE_BATCHED_TOKENS)
        decode = throughput.decode_only_step_s(u.profile, u.workload, u.at_fill.running)
        return decode + u.profile.step_cost.prefill_s(chunk)


def md1_wait_s(*, utilization: float, service_s: float) -> float:
    """Mean wait before service in an M/D/1 queue (Pollaczek-Khinchine, fixed service)."""
    return utilization * service_s / (2 * (1 - utilization))


def utilization_for_wait(*, wait_s: float, service_s: float) -> float:
    """The utilization at which the M/D/1 mean wait is `wait_s`: the inverse of md1_wait_s."""
    return 2 * wait_s / (service_s + 2 * wait_s)


def size_decode(
    profile: ReplicaProfile, workload: Workload, demand: Demand, *, requests_per_s: float
) -> DecodeSizing:
    running = throughput.running_limit(profile, workload)
    itl_sessions = None
    if demand.itl_slo_s is not None:
        itl_sessions = throughput.max_sessions_within_itl(
            profile, workload, itl_s=demand.itl_slo_s, step=throughput.decode_only_step_s
        )
    sessions = sessions_at_fill(running, demand, itl_sessions)
    step = throughput.decode_only_step_s(profile, workload, sessions)
    output_tokens_per_s = requests_per_s * workload.output_tokens
    return DecodeSizing(
        running_limit=running,
        itl_sessions=itl_sessions,
        sessions=sessions,
        step_s=step,
        replicas=max(1, math.ceil(output_tokens_per_s * step / sessions - 1e-9)),
    )


def first_step_s(decode: DecodeSizing) -> float:
    """From a decode engine's receiving the KV to its first token: the rest of the step in
    flight, then one step (throughput.py's rule, without the prefill)."""
    return (1 - 1 / decode.sessions) * decode.step_s / 2 + decode.step_s


def size_prefill(
    profile: ReplicaProfile,
    workload: Workload,
    demand: Demand,
    *,
    requests_per_s: float,
    fixed_s: float,
) -> PrefillSizing:
    """Prefill engines for the rate; `fixed_s` is the TTFT every request spends outside the
    prefill engine's queue and compute."""
    service = profile.step_cost.prefill_s(workload.prompt_tokens)
    cap, met = demand.target_fill, True
    if demand.ttft_slo_s is not None:
        wait = demand.ttft_slo_s - fixed_s - service
        met = wait > 0
        if met:
            cap = min(cap, utilization_for_wait(wait_s=wait, service_s=service))
    replicas = max(1, math.ceil(requests_per_s * service / cap - 1e-9))
    utilization = requests_per_s * service / replicas
    return PrefillSizing(
        prefill_s=service,
        utilization_cap=cap,
        utilization=utilization,
        wait_s=md1_wait_s(utilization=utilization, service_s=service),
        replicas=replicas,
        ttft_reachable=met,
    )


def kv_transfer(
    profile: ReplicaProfile,
    workload: Workload,
    *,
    requests_per_s: float,
    link_gbps: float,
    prefill_gpus: int,
) -> KvTransfer:
    per_rank = profile.step_cost.kv_bytes_per_token_per_rank * workload.prompt_tokens
    link_bytes_per_s = link_gbps * 1e9 / 8
    per_request = round(per_rank * profile.tp)
    return KvTransfer(
        bytes_per_request=per_request,
        bytes_per_s=requests_per_s * per_request,
        link_gbps=link_gbps,
        transfer_s=per_rank / link_bytes_per_s,
        link_load=requests_per_s * per_request / (prefill_gpus * link_bytes_per_s),
    )


def make_disaggregated_plan(
    plan: Plan, *, kv_transfer_gbps: float = DEFAULT_KV_TRANSFER_GBPS
) -> DisaggregatedPlan:
    """Size prefill and decode engines for `plan`'s workload and demand; `plan` is the same
    workload on unified engines, the figure to compare against."""
    demand = plan.demand
    if demand.rps is None:
        raise CapacityError("--disaggregated sizes engines for a rate: give --rps")
    if kv_transfer_gbps <= 0:
        raise CapacityError("--kv-transfer-gbps must be more than 0")
    profile, workload, rate = plan.profile, plan.workload, demand.rps * demand.burst
    decode = size_decode(profile, workload, demand, requests_per_s=rate)
    # a request's transfer time does not depend on the prefill engines' count; the links'
    # load does, and is worked out once the count is known
    one_way = kv_transfer(
        profile, workload, requests_per_s=rate, link_gbps=kv_transfer_gbps, prefill_gpus=1
    )
    fixed = one_way.transfer_s + first_step_s(decode)
    prefill = size_prefill(profile, workload, demand, requests_per_s=rate, fixed_s=fixed)
    transfer = kv_transfer(
        profile,
        workload,
        requests_per_s=rate,
        link_gbps=kv_transfer_gbps,
        prefill_gpus=prefill.replicas * plan.options.tp,
    )
    single_step = throughput.decode_only_step_s(profile, workload, 1)
    warnings = [
        *slo_warning(
            "ITL (decode engines)",
            slo_s=demand.itl_slo_s,
            sessions=decode.itl_sessions,
            single_s=single_step,
        )
    ]
    if not prefill.ttft_reachable and demand.ttft_slo_s is not None:
        warnings.append(
            f"the TTFT SLO of {demand.ttft_slo_s * 1e3:.0f} ms is shorter than a prompt's "
            f"prefill, transfer and first decode step ({(prefill.prefill_s + fixed) * 1e3:.0f}"
            " ms) even with no queue; the prefill engines are sized at target_fill"
        )
    if transfer.link_load > 1:
        warnings.append(
            f"moving the prompts' KV takes {transfer.gbps_needed:,.1f} Gbit/s, more than the "
            f"prefill GPUs' links carry ({transfer.link_load:.0%} of them); add links or "
            "prefill GPUs"
        )
    return DisaggregatedPlan(
        unified=plan,
        requests_per_s=rate,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        ttft_s=prefill.wait_s + prefill.prefill_s + fixed,
        warnings=tuple(warnings),
    )


def disaggregated_json(split: DisaggregatedPlan) -> dict[str, object]:
    p, d, t, u = split.prefill, split.decode, split.transfer, split.unified
    return {
        "requests_per_s": split.requests_per_s,
        "kv_transfer_gbps": t.link_gbps,
        "prefill": {
            "prefill_ms": round(p.prefill_s * 1e3, 2),
            "prompt_tokens_per_s_per_replica": round(p.prompts_per_s * u.workload.prompt_tokens),
            "utilization_cap": round(p.utilization_cap, 4),
            "utilization": round(p.utilization, 4),
            "queue_wait_ms": round(p.wait_s * 1e3, 2),
            "replicas": p.replicas,
            "gpus": split.prefill_gpus,
        },
        "decode": {
            "running_limit": d.running_limit,
            "itl_sessions": d.itl_sessions,
            "sessions_per_replica": d.sessions,
            "itl_ms": round(d.step_s * 1e3, 2),
            "output_tokens_per_s_per_replica": round(d.output_tokens_per_s, 1),
            "replicas": d.replicas,
            "gpus": split.decode_gpus,
        },
        "kv_transfer": {
            "bytes_per_request": t.bytes_per_request,
            "bytes_per_s": round(t.bytes_per_s),
            "gbps_needed": round(t.gbps_needed, 3),
            "transfer_ms": round(t.transfer_s * 1e3, 3),
            "link_load": round(t.link_load, 4),
        },
        "ttft_ms": round(split.ttft_s * 1e3, 1),
        "itl_ms": round(d.step_s * 1e3, 2),
        "gpus": split.gpus,
        "unified": {
            "gpus": split.unified_gpus,
            "replicas": u.replicas_needed,
            "sessions_per_replica": u.sessions_at_fill,
            "ttft_ms": round(u.at_fill.ttft_s * 1e3, 1),
            "itl_ms": round(u.at_fill.itl_s * 1e3, 2),
            "prefill_step_ms": round(split.unified_prefill_step_s * 1e3, 2),
        },
        "cheaper": split.cheaper,
        "gpus_saved": abs(split.gpus - split.unified_gpus),
        "warnings": list(split.warnings),
    }
