"""`spillgate measure`: the batch-fill vs TTFT trade of a live OpenAI-compatible endpoint.

At each concurrency level, that many clients each send streaming completions back to back
(a closed loop). Prompts are text, distinct per request so no prefix cache shortens a
prefill, sized on the endpoint's own token count (loadtest/measure/stream.py), and
`ignore_eos` makes every answer exactly --output-tokens long. Clients start staggered over
one request's duration so the engine sees arrivals spread out, as in a steady state;
tokens/s counts the tokens streamed while every client was busy. A request that fails is
counted, and the first failure's message is shown.

With --gpu (and --catalog-model when the served name is not a catalog name) the plan's
prediction for the same workload is printed beside each level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from gateway.capacity import throughput
from gateway.capacity.catalog import CapacityError
from gateway.capacity.cli import add_replica_arguments
from loadtest.loadgen.http import ConnectionPool, HttpError, Origin
from loadtest.measure.report import (
    Prediction,
    predict_for,
    report_json,
    report_table,
    write_chart,
)
from loadtest.measure.results import (
    EndpointKv,
    Level,
    Measurement,
    endpoint_kv,
    running_now,
    steady_tokens_per_s,
)
from loadtest.measure.stream import (
    MeasureError,
    Sample,
    StreamReader,
    calibrated_words,
    error_message,
    prompt_text,
)
from loadtest.percentile import percentile_or_nan


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    url: str
    model: str
    concurrency: tuple[int, ...]
    prompt_tokens: int = 512
    output_tokens: int = 128
    requests_per_level: int | None = None  # default: 4 per client
    api_key: str | None = None
    timeout_s: float = 120.0
    poll_s: float = 0.05


def _completion_body(cfg: MeasureConfig, prompt: str | list[int]) -> bytes:
    return orjson.dumps({
        "model": cfg.model,
        "prompt": prompt,
        "max_tokens": cfg.output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """Where the streams go (a raw client that times each network read) and the metrics."""

    streams: ConnectionPool
    headers: dict[str, str]
    client: httpx.AsyncClient


async def one_request(endpoint: Endpoint, cfg: MeasureConfig, prompt: str | list[int]) -> Sample:
    """One streamed completion, timed; raises MeasureError with the endpoint's message."""
    sample = Sample(started=time.perf_counter())
    reader = StreamReader(sample)
    try:
        async with asyncio.timeout(cfg.timeout_s):
            await _stream(endpoint, _completion_body(cfg, prompt), reader)
    except TimeoutError:
        raise MeasureError(f"no complete answer within {cfg.timeout_s:g} s") from None
    sample.ended = time.perf_counter()
    if not sample.arrivals:
        raise MeasureError("the stream carried no tokens")
    if not reader.done:
        raise MeasureError("the stream ended without [DONE]")
    sample.completion_tokens = sample.completion_tokens or sum(a.events for a in sample.arrivals)
    return sample


async def _stream(endpoint: Endpoint, body: bytes, reader: StreamReader) -> None:
    headers = {**endpoint.headers, "content-type": "application/json"}
    async with endpoint.streams.request(
        "POST", "/v1/completions", headers=headers, body=body
    ) as resp:
        if resp.status != 200:
            raise MeasureError(_http_error(resp.status, await resp.body()))
        async for data in resp.reads():
            reader.feed(data, time.perf_counter())


def _http_error(status: int, body: bytes) -> str:
    try:
        message = error_message(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = None
    return f"HTTP {status}: {message or body[:300].decode('utf-8', 'replace')}"


async def _poll_running(client: httpx.AsyncClient, every_s: float, peak: list[int]) -> None:
    while True:
        try:
            resp = await client.get("/metrics")
            running = running_now(resp.text) if resp.status_code == 200 else None
            if running is not None:
                peak.append(running)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(every_s)


@dataclass(frozen=True, kw_only=True)
class Prompts:
    words: int  # per prompt, calibrated on the endpoint's count

    def text(self, index: int) -> str:
        return prompt_text(index, self.words)


@dataclass(kw_only=True)
class Worker:
    samples: list[Sample]
    errors: list[str]


async def _worker(
    endpoint: Endpoint,
    cfg: MeasureConfig,
    prompts: Prompts,
    *,
    first: int,
    count: int,
    delay_s: float,
) -> Worker:
    await asyncio.sleep(delay_s)
    worker = Worker(samples=[], errors=[])
    for index in range(first, first + count):
        try:
            worker.samples.append(await one_request(endpoint, cfg, prompts.text(index)))
        except (HttpError, MeasureError, ValueError) as exc:
            worker.errors.append(str(exc))
    return worker


async def _run_workers(
    endpoint: Endpoint,
    cfg: MeasureConfig,
    prompts: Prompts,
    concurrency: int,
    *,
    first: int,
    stagger_s: float,
) -> list[Worker]:
    per_client = max(1, math.ceil((cfg.requests_per_level or 4 * concurrency) / concurrency))
    return await asyncio.gather(
        *(
            _worker(
                endpoint,
                cfg,
                prompts,
                first=first + i * per_client,
                count=per_client,
                delay_s=stagger_s * i / concurrency,
            )
            for i in range(concurrency)
        )
    )


async def run_level(
    endpoint: Endpoint,
    cfg: MeasureConfig,
    prompts: Prompts,
    concurrency: int,
    *,
    first: int,
    stagger_s: float,
) -> tuple[Level, list[Sample]]:
    peak: list[int] = []
    poller = asyncio.create_task(_poll_running(endpoint.client, cfg.poll_s, peak))
    try:
        workers = await _run_workers(
            endpoint, cfg, prompts, concurrency, first=first, stagger_s=stagger_s
        )
    finally:
        poller.cancel()
    errors = [e for w in workers for e in w.errors]
    samples = [s for w in workers for s in w.samples]
    if not samples:
        raise MeasureError(f"every request at concurrency {concurrency} failed: {errors[0]}")
    ttfts = [s.ttft_s * 1e3 for s in samples]
    itls = [x * 1e3 for s in samples for x in s.itls_s()]
    level = Level(
        concurrency=concurrency,
        requests=len(samples),
        errors=len(errors),
        ttft_p50_ms=percentile_or_nan(ttfts, 50),
        ttft_p99_ms=percentile_or_nan(ttfts, 99),
        itl_p50_ms=percentile_or_nan(itls, 50),
        itl_p99_ms=percentile_or_nan(itls, 99),
        tokens_per_s=steady_tokens_per_s([w.samples for w in workers]),
        peak_running=max(peak) if peak else None,
        prompt_tokens=sum(s.prompt_tokens for s in samples) / len(samples),
        first_error=errors[0] if errors else None,
    )
    return level, samples


async def _endpoint_info(client: httpx.AsyncClient) -> tuple[EndpointKv | None, int | None]:
    """The endpoint's KV pool from vLLM's cache_config_info, and its max_model_len, if shown."""
    kv, max_len = None, None
    resp = await client.get("/metrics")
    if resp.status_code == 200:
        kv = endpoint_kv(resp.text)
    resp = await client.get("/v1/models")
    if resp.status_code == 200:
        try:
            data = resp.json().get("data") or [{}]
            max_len = data[0].get("max_model_len")
        except (ValueError, AttributeError, IndexError):
            max_len = None
    return kv, max_len


@contextlib.asynccontextmanager
async def open_endpoint(cfg: MeasureConfig) -> AsyncIterator[Endpoint]:
    base = cfg.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    streams = ConnectionPool(Origin.parse(base))
    client = httpx.AsyncClient(
        base_url=base, headers=headers, timeout=httpx.Timeout(cfg.timeout_s, connect=5.0)
    )
    try:
        yield Endpoint(streams=streams, headers=headers, client=client)
    finally:
        await streams.close()
        await client.aclose()


def mean_duration_s(samples: list[Sample]) -> float:
    return sum(s.ended - s.started for s in samples) / len(samples)


async def measure_levels(endpoint: Endpoint, cfg: MeasureConfig) -> list[Level]:
    """One warm-up request, which sizes the prompts, then each level in turn.

    Clients start spread over about one request's duration at that level, estimated from
    the level before as growing no faster than the concurrency, so arrivals do not clump.
    """
    warm = await one_request(endpoint, cfg, prompt_text(0, cfg.prompt_tokens))
    words = calibrated_words(
        target_tokens=cfg.prompt_tokens, words=cfg.prompt_tokens, tokens=warm.prompt_tokens
    )
    prompts = Prompts(words=words)
    duration, previous = warm.ended - warm.started, 1
    levels: list[Level] = []
    first = 1
    for c in cfg.concurrency:
        stagger = duration * max(1.0, c / previous)
        level, samples = await run_level(endpoint, cfg, prompts, c, first=first, stagger_s=stagger)
        levels.append(level)
        duration, previous = mean_duration_s(samples), c
        first += level.requests + level.errors
    return levels


async def measure(cfg: MeasureConfig) -> Measurement:
    async with open_endpoint(cfg) as endpoint:
        kv, max_len = await _endpoint_info(endpoint.client)
        levels = await measure_levels(endpoint, cfg)
    return Measurement(levels=levels, kv=kv, max_model_len=max_len)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the endpoint's base URL")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument(
        "--concurrency", type=_levels, default=(1, 2, 4, 8, 16), help="the levels, e.g. 1,2,4"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="each request's prompt")
    parser.add_argument("--output-tokens", type=int, default=128, help="each request's answer")
    parser.add_argument("--requests-per-level", type=int, help="default: 4 per client")
    parser.add_argument("--api-key", help="sent as a Bearer token (default: none)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--chart", type=Path, metavar="FILE", help="SVG of the levels")
    plan = parser.add_argument_group("the plan's prediction beside the measurement")
    plan.add_argument("--gpu", help="catalog GPU the endpoint runs on")
    plan.add_argument("--catalog-model", help="catalog model, when --model is a served alias")
    plan.add_argument("--speed", type=float, default=1.0, help="the simulator's --speed")
    add_replica_arguments(parser)


async def _measure_and_predict(
    cfg: MeasureConfig, args: argparse.Namespace, workload: throughput.Workload
) -> tuple[Measurement, Prediction | None]:
    """The prediction is made first, so a wrong --gpu fails before any load is sent."""
    async with open_endpoint(cfg) as endpoint:
        kv, max_len = await _endpoint_info(endpoint.client)
        prediction = predict_for(args, workload, max_len)
        levels = await measure_levels(endpoint, cfg)
    return Measurement(levels=levels, kv=kv, max_model_len=max_len), prediction


def run(args: argparse.Namespace) -> int:
    cfg = MeasureConfig(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        requests_per_level=args.requests_per_level,
        api_key=args.api_key,
        timeout_s=args.timeout,
    )
    try:
        workload = throughput.Workload(
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens
        )
        result, prediction = asyncio.run(_measure_and_predict(cfg, args, workload))
    except (CapacityError, MeasureError, httpx.HTTPError, HttpError) as exc:
        print(f"spillgate measure: error: {exc}", file=sys.stderr)
        return 2
    if args.chart is not None:
        write_chart(args.chart, result, prediction)
        print(f"wrote {args.chart.resolve()}", file=sys.stderr)
    if args.json:
        print(json.dumps(report_json(result, workload, prediction), indent=2))
    else:
        print(report_table(result, workload, prediction))
    return 0
