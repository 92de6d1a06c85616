"""A plan as a readable table, and as a chart of tokens/s and TTFT against concurrency."""

from __future__ import annotations

from pathlib import Path

from gateway.capacity import throughput
from gateway.capacity.catalog import Catalog
from gateway.capacity.disaggregated import DisaggregatedPlan
from gateway.capacity.plan import DEFAULT_TARGET_FILL, Plan


def _row(label: str, value: str) -> str:
    return f"  {label:<34}{value:>16}"


def _memory_rows(plan: Plan) -> list[str]:
    b, o = plan.budget, plan.options

    def source(override: float | None) -> str:
        return "given" if override is not None or o.kv_cache_gib is not None else "est."

    return [
        "Memory per GPU (GiB)",
        _row(f"usable ({b.total_gib:.2f} x {b.gpu_memory_utilization:.2f})", f"{b.usable_gib:.2f}"),
        _row(f"weights ({source(o.weights_gib)})", f"{b.weights_gib:.2f}"),
        _row(f"activation peak ({source(o.activation_gib)})", f"{b.activation_gib:.2f}"),
        _row(f"non-torch ({source(o.non_torch_gib)})", f"{b.non_torch_gib:.2f}"),
        *_lora_memory_rows(plan),
        _row(
            "KV cache" + (" (given)" if o.kv_cache_gib is not None else ""), f"{b.kv_cache_gib:.2f}"
        ),
    ]


def _lora_memory_rows(plan: Plan) -> list[str]:
    lora = plan.options.lora
    if lora is None:
        return []
    # vLLM's own pool given outright is not reduced by the buffers either
    source = "not from KV" if plan.options.kv_cache_gib is not None else "est."
    label = f"LoRA ({lora.max_loras} x rank {lora.max_lora_rank}, {source})"
    return [_row(label, f"{plan.budget.lora_gib:.2f}")]


def _lora_kv_rows(plan: Plan) -> list[str]:
    if not plan.lora_blocks:
        return []
    taken = plan.lora_blocks * plan.profile.block_size
    return [_row("  taken by LoRA", f"{plan.lora_blocks:,} ({taken:,} tokens)")]


def _kv_rows(plan: Plan) -> list[str]:
    p = plan.profile
    return [
        "KV cache",
        _row("bytes per token per GPU", f"{plan.kv_bytes_per_token:,}"),
        _row("blocks", f"{p.num_gpu_blocks:,}"),
        *_lora_kv_rows(plan),
        _row("tokens", f"{p.kv_cache_tokens:,}"),
        _row(f"max concurrency at {p.max_model_len:,} tokens", f"{plan.max_concurrency:.2f}x"),
    ]


def _shared_prompt_rows(plan: Plan) -> list[str]:
    w = plan.workload
    if w.shared_prompt_tokens == 0:
        return []
    whole = plan.profile.blocks_per_session(w.tokens)
    own = whole - plan.shared_prompt_blocks
    return [
        f"Shared prompt: {w.shared_prompt_tokens:,} tokens, carried by "
        f"{w.shared_share * 100:.3g}% of requests",
        _row("whole blocks, held once", f"{plan.shared_prompt_blocks:,}"),
        _row("blocks of a session carrying it", f"{own:,} of {whole:,}"),
        _row("sessions at the KV bound", f"{plan.sessions_per_replica:,}"),
        _row("  without sharing", f"{plan.sessions_without_sharing:,}"),
    ]


def _limit_rows(plan: Plan) -> list[str]:
    if plan.running_limit == plan.sessions_per_replica:
        return []
    return [_row("running at once (max_num_seqs)", f"{plan.running_limit:,}")]


def _replica_rows(plan: Plan) -> list[str]:
    w, bound, fill = plan.workload, plan.at_bound, plan.at_fill
    batch1 = plan.profile.step_cost.decode_step_s(round(w.mean_kv_tokens))
    assumed = f" (assumed: no {' or '.join(plan.assumed)} given)" if plan.assumed else ""
    rows = [
        f"One replica, sessions of {w.prompt_tokens:,} prompt + {w.output_tokens:,} output "
        f"tokens{assumed}",
        _row("batch-1 decode", f"{1 / batch1:.1f} tok/s"),
        _row("sessions at the KV bound", f"{plan.sessions_per_replica:,}"),
        *_limit_rows(plan),
        _row("  decode tokens/s", f"{bound.output_tokens_per_s:,.0f}"),
        _row("  inter-token latency", f"{bound.itl_s * 1e3:.1f} ms"),
        _row("  TTFT", f"{bound.ttft_s * 1e3:,.0f} ms"),
        _row(f"knee (TTFT {throughput.KNEE_FACTOR:g}x single session)", f"{plan.knee:,}"),
    ]
    if plan.slo_sessions is not None:
        slo = plan.demand.ttft_slo_s or 0.0
        rows.append(_row(f"sessions within TTFT {slo * 1e3:.0f} ms", f"{plan.slo_sessions:,}"))
    if plan.itl_sessions is not None:
        itl = plan.demand.itl_slo_s or 0.0
        rows.append(_row(f"sessions within ITL {itl * 1e3:.0f} ms", f"{plan.itl_sessions:,}"))
    rows += [
        _row(f"sessions at {plan.demand.target_fill:.0%} fill", f"{plan.sessions_at_fill:,}"),
        _row("  decode tokens/s", f"{fill.output_tokens_per_s:,.0f}"),
        *(
            [_row("  inter-token latency", f"{fill.itl_s * 1e3:.1f} ms")]
            if plan.itl_sessions is not None
            else []
        ),
        _row("  TTFT", f"{fill.ttft_s * 1e3:,.0f} ms"),
        _row("  prompt + output tokens/s", f"{plan.replica_tokens_per_s:,.0f}"),
    ]
    return rows


def _workload_rows(plan: Plan) -> list[str]:
    d, w = plan.demand, plan.workload
    if plan.peak_tokens_per_s is None:
        return ["Workload: give --rps or --sessions for replicas and GPUs"]
    if d.rps is not None:
        head = f"Workload: {d.rps:g} req/s x {w.tokens:,} tokens x burst {d.burst:g}"
    else:
        head = f"Workload: {d.sessions:,} sessions x burst {d.burst:g}"
    fill = f"replicas at {d.target_fill:.0%} fill"
    if d.target_fill == DEFAULT_TARGET_FILL:
        fill += " (the gateway's default target_fill)"
    return [
        f"{head}, {fill}",
        _row("peak tokens/s", f"{plan.peak_tokens_per_s:,.0f}"),
        _row(f"replicas needed at {d.target_fill:.0%} fill", f"{plan.replicas_needed:,}"),
        _row("GPUs needed", f"{plan.gpus_needed:,}"),
    ]


def plan_table(plan: Plan) -> str:
    o = plan.options
    head = (
        f"{plan.model.name} on {o.tp} x {plan.gpu.name} (kv {o.kv_dtype}, block {o.block_size}, "
        f"gpu_memory_utilization {o.gpu_memory_utilization:g}"
        + (", LoRA" if o.lora is not None else "")
        + ")"
    )
    sections = [[head], _memory_rows(plan), _kv_rows(plan)]
    if shared := _shared_prompt_rows(plan):
        sections.append(shared)
    sections.append(_replica_rows(plan))
    sections.append(_workload_rows(plan))
    if plan.warnings:
        sections.append([f"warning: {w}" for w in plan.warnings])
    return "\n\n".join("\n".join(s) for s in sections)


def _prefill_rows(split: DisaggregatedPlan) -> list[str]:
    p, demand = split.prefill, split.unified.demand
    allowed = "utilization allowed"
    if demand.ttft_slo_s is not None and p.ttft_reachable:
        allowed += f" (TTFT {demand.ttft_slo_s * 1e3:.0f} ms)"
    elif p.utilization_cap == demand.target_fill:
        allowed += " (target_fill)"
    return [
        f"Prefill engines, prompts of {split.unified.workload.prompt_tokens:,} tokens",
        _row("one prompt's prefill", f"{p.prefill_s * 1e3:.1f} ms"),
        _row("  prompts/s per engine, never idle", f"{p.prompts_per_s:,.1f}"),
        _row(allowed, f"{p.utilization_cap:.0%}"),
        _row("utilization at the rate", f"{p.utilization:.0%}"),
        _row("  mean queue wait (M/D/1)", f"{p.wait_s * 1e3:,.1f} ms"),
        _row("engines / GPUs", f"{p.replicas:,} / {split.prefill_gpus:,}"),
    ]


def _decode_rows(split: DisaggregatedPlan) -> list[str]:
    d, w, demand = split.decode, split.unified.workload, split.unified.demand
    rows = [
        f"Decode engines, each stream holding {w.tokens:,} tokens for its life",
        _row("sessions at the KV bound", f"{d.running_limit:,}"),
    ]
    if d.itl_sessions is not None:
        itl = demand.itl_slo_s or 0.0
        rows.append(_row(f"sessions within ITL {itl * 1e3:.0f} ms", f"{d.itl_sessions:,}"))
    return [
        *rows,
        _row("sessions per engine", f"{d.sessions:,}"),
        _row("  inter-token latency", f"{d.step_s * 1e3:.1f} ms"),
        _row("  decode tokens/s", f"{d.output_tokens_per_s:,.0f}"),
        _row("engines / GPUs", f"{d.replicas:,} / {split.decode_gpus:,}"),
    ]


def _transfer_rows(split: DisaggregatedPlan) -> list[str]:
    t = split.transfer
    return [
        "KV transfer, a prompt's KV from prefill to decode engine",
        _row("bytes per request", f"{t.bytes_per_request:,}"),
        _row("needed at the rate", f"{t.gbps_needed:,.1f} Gbit/s"),
        _row(f"one request, {t.link_gbps:g} Gbit/s a GPU", f"{t.transfer_s * 1e3:.1f} ms"),
        _row("load on the prefill GPUs' links", f"{t.link_load:.0%}"),
    ]


def _side_by_side(label: str, split: str, unified: str) -> str:
    return f"  {label:<26}{split:>16}{unified:>10}"


def _comparison_rows(split: DisaggregatedPlan) -> list[str]:
    u = split.unified
    if split.cheaper == "equal":
        verdict = "the same GPUs either way"
    else:
        saved = abs(split.gpus - split.unified_gpus)
        verdict = f"{split.cheaper} is cheaper by {saved:,} GPU{'s' if saved > 1 else ''}"
    return [
        _side_by_side("Side by side", "disaggregated", "unified"),
        _side_by_side(
            "GPUs",
            f"{split.prefill_gpus:,} + {split.decode_gpus:,} = {split.gpus:,}",
            f"{split.unified_gpus:,}",
        ),
        _side_by_side("TTFT", f"{split.ttft_s * 1e3:,.0f} ms", f"{u.at_fill.ttft_s * 1e3:,.0f} ms"),
        _side_by_side(
            "inter-token latency",
            f"{split.decode.step_s * 1e3:.1f} ms",
            f"{u.at_fill.itl_s * 1e3:.1f} ms",
        ),
        _side_by_side(
            "  a step holding a prefill",
            f"{split.decode.step_s * 1e3:.1f} ms",
            f"{split.unified_prefill_step_s * 1e3:.1f} ms",
        ),
        verdict,
    ]


def disaggregated_table(split: DisaggregatedPlan) -> str:
    u = split.unified
    head = (
        f"Disaggregated: {split.requests_per_s:g} req/s (burst included) on prefill and decode "
        f"engines of {u.options.tp} x {u.gpu.name} each"
    )
    sections = [
        [head],
        _prefill_rows(split),
        _decode_rows(split),
        _transfer_rows(split),
        _comparison_rows(split),
    ]
    if split.warnings:
        sections.append([f"warning: {w}" for w in split.warnings])
    return "\n\n".join("\n".join(s) for s in sections)


def catalog_listing(catalog: Catalog) -> str:
    models = [
        f"  {m.name:<16}{m.params / 1e9:>8.1f}B  {m.layers:>3} layers  kv heads {m.kv_heads:>3}"
        for m in catalog.models.values()
    ]
    gpus = [
        f"  {g.name:<16}{g.memory_gib:>8.2f} GiB  {g.bandwidth_gb_s:>6.0f} GB/s  "
        f"{g.bf16_tflops:>5.0f} TFLOPS"
        for g in catalog.gpus.values()
    ]
    return "\n".join(["models:", *models, "", "GPUs:", *gpus])


def chart_concurrencies(plan: Plan, *, points: int = 48) -> list[int]:
    top = max(2, round(max(plan.running_limit, plan.knee) * 1.5))
    return sorted({max(1, round(top * i / points)) for i in range(points + 1)})


def write_chart(plan: Plan, path: Path) -> None:
    from gateway.capacity.charts import LineChart, Marker, Series, write_svg

    load = throughput.curve(plan.profile, plan.workload, chart_concurrencies(plan))
    markers = [
        Marker(
            x=plan.sessions_per_replica,
            label=f"KV bound {plan.sessions_per_replica}",
            color="#d62728",
        ),
        Marker(x=plan.knee, label=f"knee {plan.knee}", color="#2ca02c"),
    ]
    title = f"{plan.model.name} on {plan.options.tp} x {plan.gpu.name}"
    tokens = Series(
        name="decode tokens/s", points=[(p.concurrency, p.output_tokens_per_s) for p in load]
    )
    ttft = Series(name="TTFT ms", points=[(p.concurrency, p.ttft_s * 1e3) for p in load])
    write_svg(
        path,
        [
            LineChart(
                title=f"{title}: throughput",
                x_label="concurrent sessions",
                y_label="output tokens/s",
                series=[tokens],
                markers=markers,
            ),
            LineChart(
                title=f"{title}: time to first token",
                x_label="concurrent sessions",
                y_label="TTFT (ms)",
                series=[ttft],
                markers=markers,
            ),
        ],
    )
