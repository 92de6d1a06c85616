"""What `spillgate measure` found, beside what the plan predicts: table, JSON and chart."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gateway.capacity import throughput
from gateway.capacity.catalog import load_catalog
from gateway.capacity.cli import replica_options
from gateway.capacity.perf import ReplicaProfile
from gateway.capacity.profile import build_profile
from loadtest.measure.results import EndpointKv, Level, Measurement


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The plan's numbers for the measured workload, scaled to a simulator's --speed."""

    profile: ReplicaProfile
    workload: throughput.Workload
    speed: float = 1.0

    @property
    def sessions_at_kv_bound(self) -> int:
        return throughput.kv_bound(self.profile, self.workload)

    @property
    def knee(self) -> int:
        return throughput.knee(self.profile, self.workload)

    def at(self, concurrency: int) -> throughput.LoadPoint:
        p = throughput.predict(self.profile, self.workload, concurrency)
        return throughput.LoadPoint(
            concurrency=concurrency,
            running=p.running,
            step_s=p.step_s / self.speed,
            output_tokens_per_s=p.output_tokens_per_s * self.speed,
            ttft_s=p.ttft_s / self.speed,
        )


def endpoint_sessions(kv: EndpointKv | None, workload: throughput.Workload) -> int | None:
    """Sessions the endpoint's own KV cache holds, every block reserved, as the plan counts."""
    if kv is None:
        return None
    return kv.num_gpu_blocks // max(1, math.ceil(workload.tokens / kv.block_size))


def predict_for(
    args: argparse.Namespace, workload: throughput.Workload, max_model_len: int | None
) -> Prediction | None:
    if not args.gpu:
        return None
    catalog = load_catalog(args.catalog)
    model = catalog.model(args.catalog_model or args.model)
    options = replica_options(args)
    if options.max_model_len is None and max_model_len:
        options = replace(options, max_model_len=max_model_len)
    profile = build_profile(model, catalog.gpu(args.gpu), options)
    return Prediction(profile=profile, workload=workload, speed=args.speed)


def _level_row(level: Level, prediction: Prediction | None) -> str:
    run = "-" if level.peak_running is None else str(level.peak_running)
    row = (
        f"{level.concurrency:>5} {level.requests:>5} {level.ttft_p50_ms:>9.1f} "
        f"{level.ttft_p99_ms:>8.1f} {level.itl_p50_ms:>8.2f} {level.itl_p99_ms:>8.2f} "
        f"{level.tokens_per_s:>9.1f} {run:>5}"
    )
    if prediction is not None:
        p = prediction.at(level.concurrency)
        diff = (level.tokens_per_s / p.output_tokens_per_s - 1) * 100
        row += f" | {p.output_tokens_per_s:>9.1f} {diff:>+6.1f}% {p.ttft_s * 1e3:>9.1f}"
    return row


def report_table(
    result: Measurement, workload: throughput.Workload, prediction: Prediction | None
) -> str:
    lines = [f"workload: {workload.prompt_tokens} prompt + {workload.output_tokens} output tokens"]
    counted = [level.prompt_tokens for level in result.levels if level.prompt_tokens]
    if counted:
        mean = sum(counted) / len(counted)
        lines[0] += f" (the endpoint counted {mean:,.0f} prompt tokens a request)"
    sessions = endpoint_sessions(result.kv, workload)
    if result.kv is not None:
        kv = result.kv
        lines.append(
            f"endpoint KV cache: {kv.num_gpu_blocks:,} blocks x {kv.block_size} = "
            f"{kv.num_gpu_blocks * kv.block_size:,} tokens, {sessions} sessions at the KV bound"
        )
    if prediction is not None:
        lines.append(
            f"plan ({prediction.profile.model} on {prediction.profile.tp} x "
            f"{prediction.profile.gpu}, speed {prediction.speed:g}): "
            f"{prediction.profile.num_gpu_blocks:,} blocks, {prediction.sessions_at_kv_bound} "
            f"sessions at the KV bound, knee {prediction.knee}"
        )
    head = " conc  reqs  TTFT p50      p99  ITL p50      p99     tok/s   run"
    if prediction is not None:
        head += " | plan tok/s   diff plan TTFT"
    lines += ["", head, *(_level_row(level, prediction) for level in result.levels)]
    lines.append("(milliseconds; run = most requests running at once, from /metrics)")
    for level in result.levels:
        if level.errors:
            lines.append(
                f"concurrency {level.concurrency}: {level.errors} of "
                f"{level.errors + level.requests} requests failed, the first with: "
                f"{level.first_error}"
            )
    return "\n".join(lines)


def report_json(
    result: Measurement, workload: throughput.Workload, prediction: Prediction | None
) -> dict[str, object]:
    levels = []
    for level in result.levels:
        row: dict[str, object] = asdict(level)
        if prediction is not None:
            p = prediction.at(level.concurrency)
            row["plan_tokens_per_s"] = p.output_tokens_per_s
            row["plan_ttft_ms"] = p.ttft_s * 1e3
            row["plan_itl_ms"] = p.itl_s * 1e3
        levels.append(row)
    plan = None
    if prediction is not None:
        plan = {
            "model": prediction.profile.model,
            "gpu": prediction.profile.gpu,
            "num_gpu_blocks": prediction.profile.num_gpu_blocks,
            "sessions_at_kv_bound": prediction.sessions_at_kv_bound,
            "knee_concurrency": prediction.knee,
            "speed": prediction.speed,
        }
    return {
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "endpoint_kv": None if result.kv is None else asdict(result.kv),
        "endpoint_sessions_at_kv_bound": endpoint_sessions(result.kv, workload),
        "plan": plan,
        "levels": levels,
    }


def write_chart(path: Path, result: Measurement, prediction: Prediction | None) -> None:
    from gateway.capacity.charts import LineChart, Marker, Series, write_svg

    xs = [level.concurrency for level in result.levels]
    tokens = [
        Series(
            name="measured tok/s", points=[(x.concurrency, x.tokens_per_s) for x in result.levels]
        )
    ]
    ttft = [
        Series(name="TTFT p50", points=[(x.concurrency, x.ttft_p50_ms) for x in result.levels]),
        Series(name="TTFT p99", points=[(x.concurrency, x.ttft_p99_ms) for x in result.levels]),
    ]
    markers: list[Marker] = []
    if prediction is not None:
        plan = [prediction.at(c) for c in xs]
        tokens.append(
            Series(
                name="plan tok/s",
                dashed=True,
                points=[(p.concurrency, p.output_tokens_per_s) for p in plan],
            )
        )
        ttft.append(
            Series(
                name="plan TTFT",
                dashed=True,
                points=[(p.concurrency, p.ttft_s * 1e3) for p in plan],
            )
        )
        markers = [
            Marker(x=prediction.sessions_at_kv_bound, label="KV bound", color="#d62728"),
            Marker(x=prediction.knee, label="knee", color="#2ca02c"),
        ]
    write_svg(
        path,
        [
            LineChart(
                title="throughput",
                x_label="concurrency",
                y_label="output tokens/s",
                series=tokens,
                markers=markers,
                log_x=True,
            ),
            LineChart(
                title="time to first token",
                x_label="concurrency",
                y_label="ms",
                series=ttft,
                markers=markers,
                log_x=True,
            ),
        ],
    )
