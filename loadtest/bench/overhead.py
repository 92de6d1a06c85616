"""`spillgate bench overhead` (`spillgate bench` alone): what the gateway costs, on loopback.

Arms: direct to a zero-delay backend; the smallest raw relay, on uvicorn and aiohttp; the
same relay on the gateway's own upstream client (`lean relay`, loadtest/bench/apps.py);
Spillgate with a realistic config (auth, rate limiting, admission, metrics), Redis off
and on; and LiteLLM's proxy with `--with-litellm`. The arm under test runs on core 0,
the load generator (wrk, and a separate streaming client process) and the backend on
core 1. Each measurement is taken of every arm back to back, and the rounds repeat;
the table shows medians.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from loadtest.bench.litellm import litellm_arm
from loadtest.percentile import percentile_or_nan
from loadtest.procs import RedisProcess, free_port, wait_for_port

KEY = "sk-bench-key"
BODY = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
CONCURRENCY = 64  # closed-loop throughput and CPU per request are measured at this
RATES = (250, 500, 1000, 1500, 2000, 2500, 3000)  # offered req/s of the paced sweep
PACED_CONNECTIONS = 32
ADDED_P99_BUDGET_MS = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
%s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%%d,"duration_us":%%d,"errors":%%d,"non2xx":%%d,"p50_us":%%d,"p99_us":%%d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


# wrk is closed-loop; a pause before each request turns its connections into carriers
# of one open-loop schedule instead: each request takes the next arrival of a Poisson
# process at the offered rate (LuaJIT's ffi reads the monotonic clock) and waits for it.
# Latency still runs from each request's own send; an arm that cannot keep up shows it
# as an achieved rate below direct's, since its connections are all busy at their slots.
# The seed is fixed per offer, so every arm is sent the same arrivals.
PACING = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } spillgate_timespec;
int clock_gettime(int clock, spillgate_timespec *ts);
]]
local ts = ffi.new("spillgate_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
math.randomseed(%d)
local mean_ms = %.4f
local next_at = nil
delay = function()
  local now = now_ms()
  next_at = (next_at or now) - math.log(1 - math.random()) * mean_ms
  return math.max(0, next_at - now)
end
"""


def script(path: Path, *, rate: float | None = None) -> Path:
    """A wrk script posting the bench request: back to back, or paced to `rate` req/s."""
    pacing = "" if rate is None else PACING % (round(rate), 1000 / rate)
    path.write_text(WRK_SCRIPT % (BODY.decode(), KEY, pacing))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=3, help="per measurement")
    parser.add_argument("--with-litellm", action="store_true")
    parser.add_argument("--arms", help="comma-separated subset of arms to run")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")


@dataclass
class Arm:
    name: str
    url: str
    pid: int | None  # the process whose tree's CPU is counted; None for direct
    figures: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.figures.setdefault(key, []).append(value)

    def median(self, key: str) -> float:
        values = self.figures.get(key, [])
        return statistics.median(values) if values else float("nan")


def _pinned(
    core: int, cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    prefix = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    return subprocess.Popen(
        [*prefix, *cmd], env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _uvicorn(target: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", target, "--port", str(port), "--loop", "uvloop",
        "--http", "httptools", "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip


def serve_command(python: str, config: Path) -> list[str]:
    """`spillgate serve` of the bench's config with `python`; the port is added by the caller."""
    return [python, "-m", "gateway.cli", "serve", "-c", str(config), "--log-level", "warning"]


def _spillgate_config(backend_url: str, path: Path) -> None:
    config = {
        "tenants": [
            {
                "name": "bench",
                "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                "requests_per_minute": 100_000_000,
                "tokens_per_minute": 1_000_000_000,
            }
        ],
        "pools": [
            {
                "name": "bench",
                "backends": [{"url": backend_url, "served_model": "bench-model",
                              "capacity": 1_000_000_000}],
                "overflow": ["reject"],
            }
        ],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / CLK_TCK
        stack += children.get(p, [])
    return total


def _wrk(url: str, connections: int, seconds: float, script: Path) -> dict[str, Any]:
    cmd = ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
           "--latency", "-s", str(script), f"{url}/v1/chat/completions"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=True)
    line = [row for row in out.stdout.splitlines() if row.startswith("{")][-1]
    result: dict[str, Any] = orjson.loads(line)
    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
    result["failed"] = result["errors"] + result["non2xx"]
    return result


def _stream(url: str, *, concurrency: int, seconds: float, gap_ms: float) -> dict[str, Any]:
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "loadtest.bench.stream",
           f"{url}/v1/chat/completions", "--key", KEY, "--concurrency", str(concurrency),
           "--seconds", str(seconds), "--gap-ms", str(gap_ms)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, timeout=seconds + 60, check=True)
    result: dict[str, Any] = orjson.loads(out.stdout)
    return result


Step = Callable[[Arm], None]


def steps(*, seconds: float, plain: Path, paced: dict[int, Path]) -> list[tuple[str, Step]]:
    """Every measurement of one round, each to be taken of all arms back to back: this
    machine's speed drifts over minutes, so arms compare best measured side by side."""

    def keep(arm: Arm, prefix: str, run: dict[str, Any]) -> None:
        arm.add(f"{prefix}_rps", run["rps"])
        arm.add(f"{prefix}_p50_ms", run["p50_us"] / 1000)
        arm.add(f"{prefix}_p99_ms", run["p99_us"] / 1000)
        arm.add(f"{prefix}_errors", run["failed"])

    def at_c1(arm: Arm) -> None:
        keep(arm, "c1", _wrk(arm.url, 1, seconds, plain))

    def closed(arm: Arm) -> None:
        cpu0 = _tree_cpu_s(arm.pid) if arm.pid else 0.0
        run = _wrk(arm.url, CONCURRENCY, seconds, plain)
        keep(arm, f"c{CONCURRENCY}", run)
        if arm.pid:
            arm.add("cpu_s_per_1k", (_tree_cpu_s(arm.pid) - cpu0) / run["requests"] * 1000)

    def offered(rate: int) -> Step:
        def step(arm: Arm) -> None:
            keep(arm, f"r{rate}", _wrk(arm.url, PACED_CONNECTIONS, seconds, paced[rate]))

        return step

    def gapped(arm: Arm) -> None:
        run = _stream(arm.url, concurrency=8, seconds=seconds, gap_ms=2.0)
        arm.add("stream_ttft_p50_ms", percentile_or_nan(run["ttft"], 50) * 1000)
        arm.add("stream_gap_p99_ms", percentile_or_nan(run["gap"], 99) * 1000)

    def fast(arm: Arm) -> None:
        arm.add("stream_chunks_per_s", _stream(arm.url, concurrency=16, seconds=seconds,
                                               gap_ms=0.0)["chunks_per_s"])  # fmt: skip

    return [
        ("c1", at_c1),
        (f"c{CONCURRENCY}", closed),
        *((f"{rate} req/s offered", offered(rate)) for rate in paced),
        ("streams 2 ms apart", gapped),
        ("streams back to back", fast),
    ]


@contextlib.contextmanager
def _arms(args: argparse.Namespace, backend: str, tmp: Path) -> Iterator[list[Arm]]:
    wanted = set(args.arms.split(",")) if args.arms else None
    procs: list[subprocess.Popen[bytes]] = []
    arms = [Arm("direct", backend, None)]
    redis = None
    try:
        port = free_port()
        procs.append(_pinned(0, _uvicorn("loadtest.bench.apps:relay", port),
                             {"BENCH_UPSTREAM": backend}))  # fmt: skip
        arms.append(Arm("raw relay", f"http://127.0.0.1:{port}", procs[-1].pid))
        port = free_port()
        procs.append(_pinned(0, _uvicorn("loadtest.bench.apps:lean_relay", port),
                             {"BENCH_UPSTREAM": backend}))  # fmt: skip
        arms.append(Arm("lean relay", f"http://127.0.0.1:{port}", procs[-1].pid))
        config = tmp / "spillgate.yaml"
        _spillgate_config(backend, config)
        serve = serve_command(sys.executable, config)
        port = free_port()
        procs.append(_pinned(0, [*serve, "--port", str(port)]))
        arms.append(Arm("spillgate", f"http://127.0.0.1:{port}", procs[-1].pid))
        redis = RedisProcess().start()
        port = free_port()
        procs.append(_pinned(0, [*serve, "--port", str(port), "--redis", redis.url]))
        arms.append(Arm("spillgate+redis", f"http://127.0.0.1:{port}", procs[-1].pid))
        if args.with_litellm:
            proc, url = litellm_arm(backend, tmp)
            procs.append(proc)
            arms.append(Arm("litellm", url, proc.pid))
        for arm, proc in zip(arms[1:], procs, strict=True):
            try:
                wait_for_port(int(arm.url.rsplit(":", 1)[1]), timeout=120)
            except TimeoutError:
                raise RuntimeError(f"{arm.name} did not start: {proc.args}") from None
        yield [a for a in arms if wanted is None or a.name in wanted or a.name == "direct"]
    finally:
        for proc in procs:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if redis is not None:
            redis.close()


def _table(arms: list[Arm]) -> str:
    direct, raw = arms[0], next((a for a in arms if a.name == "raw relay"), None)
    c, rps = f"@c{CONCURRENCY}", f"c{CONCURRENCY}_rps"
    rows = [
        ("added p50 @c1 (ms)", lambda a: a.median("c1_p50_ms") - direct.median("c1_p50_ms")),
        ("added p99 @c1 (ms)", lambda a: a.median("c1_p99_ms") - direct.median("c1_p99_ms")),
        (f"req/s {c}", lambda a: a.median(rps)),
        (f"req/s {c} vs raw", lambda a: a.median(rps) / raw.median(rps) if raw else 0),
        ("max req/s, added p99<5ms", lambda a: rate_under(a, direct, ADDED_P99_BUDGET_MS)),
        ("paced added p50 @500/s (ms)",
         lambda a: a.median("r500_p50_ms") - direct.median("r500_p50_ms")),
        ("paced added p99 @500/s (ms)",
         lambda a: a.median("r500_p99_ms") - direct.median("r500_p99_ms")),
        ("stream added TTFT p50 (ms)",
         lambda a: a.median("stream_ttft_p50_ms") - direct.median("stream_ttft_p50_ms")),
        ("stream added gap p99 (ms)",
         lambda a: a.median("stream_gap_p99_ms") - direct.median("stream_gap_p99_ms")),
        ("stream chunks/s", lambda a: a.median("stream_chunks_per_s")),
        ("stream chunks/s vs raw",
         lambda a: a.median("stream_chunks_per_s") / raw.median("stream_chunks_per_s")
         if raw else 0),
        (f"CPU s / 1k req {c}", lambda a: a.median("cpu_s_per_1k")),
        ("CPU vs raw", lambda a: a.median("cpu_s_per_1k") / raw.median("cpu_s_per_1k")
         if raw else 0),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows) + 2
    lines = ["".ljust(width) + "".join(a.name.rjust(16) for a in arms)]
    for label, fn in rows:
        cells = "".join(f"{fn(a):16.2f}" for a in arms)
        lines.append(label.ljust(width) + cells)
    return "\n".join(lines)


def rate_under(arm: Arm, direct: Arm, budget_ms: float) -> float:
    """The highest achieved rate of the paced sweep whose p99, less direct's p99 at the same
    offer, stays within `budget_ms`; an offer at which the arm fell more than 5 % short of
    direct's achieved rate (the same arrivals) ends it."""
    best = 0.0
    for rate in RATES:
        achieved = arm.median(f"r{rate}_rps")
        kept_up = achieved >= 0.95 * direct.median(f"r{rate}_rps")
        if not kept_up or arm.median(f"r{rate}_errors") > 0:
            break
        added = arm.median(f"r{rate}_p99_ms") - direct.median(f"r{rate}_p99_ms")
        if added > budget_ms:
            break
        best = achieved
    return best


def run(args: argparse.Namespace) -> int:
    if not shutil.which("wrk"):
        print("spillgate bench: needs wrk (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spillgate-bench-") as tmpdir:
        tmp = Path(tmpdir)
        plain = script(tmp / "post.lua")
        paced = {rate: script(tmp / f"paced-{rate}.lua", rate=rate) for rate in RATES}
        port = free_port()
        backend = _pinned(1, _uvicorn("loadtest.bench.apps:backend", port))
        try:
            wait_for_port(port)
            url = f"http://127.0.0.1:{port}"
            with _arms(args, url, tmp) as arms:
                for rep in range(args.repeats):
                    for label, step in steps(seconds=args.seconds, plain=plain, paced=paced):
                        print(f"round {rep + 1}/{args.repeats}: {label}", file=sys.stderr)
                        for arm in arms:
                            step(arm)
                print(f"cpus: {os.cpu_count()}, repeats: {args.repeats}, {args.seconds}s each")
                print(_table(arms))
                if args.json:
                    data = {a.name: a.figures for a in arms}
                    Path(args.json).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
                    print(f"wrote {Path(args.json).resolve()}", file=sys.stderr)
        finally:
            backend.terminate()
            backend.wait(timeout=10)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillgate bench overhead", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
