"""Two builds of the gateway side by side at concurrency 64, each round beside the raw relay.

    spillgate bench builds BEFORE AFTER [--rounds 10] [--seconds 3]

BEFORE and AFTER are checkouts, each with its own virtualenv (`make .venv/.dev`), e.g.
`git worktree add /tmp/before HEAD~3`. Both serve `spillgate bench`'s config (Redis off),
pinned to core 0 as the bench pins them, beside the raw relay; the zero-delay backend
and wrk run on core 1. Every round measures the three back to back, in an order that
turns each round, and the figures are the medians of per-round ratios: this machine's
speed drifts by up to 2x over minutes, so only measurements taken together compare.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.bench.overhead import (
    _pinned,
    _spillgate_config,
    _tree_cpu_s,
    _uvicorn,
    _wrk,
    script,
    serve_command,
)
from loadtest.procs import free_port, wait_for_port

RAW = "raw relay"


def _serve(root: Path, config: Path, port: int) -> subprocess.Popen[bytes]:
    python = root / ".venv" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python}: make the checkout's virtualenv (make .venv/.dev)")
    cmd = [*serve_command(str(python), config), "--port", str(port)]
    return subprocess.Popen(
        ["taskset", "-c", "0", *cmd], cwd=root,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def compare(before: Path, after: Path, *, rounds: int, seconds: int) -> dict[str, Any]:
    """Requests/s and CPU per request of each build and the raw relay, round by round."""
    with tempfile.TemporaryDirectory(prefix="spillgate-builds-") as tmpdir:
        tmp = Path(tmpdir)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            port = free_port()
            procs.append(_pinned(1, _uvicorn("loadtest.bench.apps:backend", port)))
            wait_for_port(port)
            backend = f"http://127.0.0.1:{port}"
            config = tmp / "spillgate.yaml"
            _spillgate_config(backend, config)
            arms: dict[str, tuple[str, int]] = {}
            port = free_port()
            procs.append(_pinned(0, _uvicorn("loadtest.bench.apps:relay", port),
                                 {"BENCH_UPSTREAM": backend}))  # fmt: skip
            arms[RAW] = (f"http://127.0.0.1:{port}", port)
            for name, root in (("before", before), ("after", after)):
                port = free_port()
                procs.append(_serve(root, config, port))
                arms[name] = (f"http://127.0.0.1:{port}", port)
            pids = dict(zip(arms, (p.pid for p in procs[1:]), strict=True))
            for _url, port in arms.values():
                wait_for_port(port, timeout=60)
            post = script(tmp / "post.lua")
            for url, _ in arms.values():
                _wrk(url, 64, 1, post)  # connections opened, caches warm
            figures: dict[str, dict[str, list[float]]] = {
                a: {"rps": [], "cpu_us": []} for a in arms
            }
            order = list(arms)
            for n in range(rounds):
                for arm in order:
                    url, _ = arms[arm]
                    cpu = _tree_cpu_s(pids[arm])
                    out = _wrk(url, 64, seconds, post)
                    cpu = _tree_cpu_s(pids[arm]) - cpu
                    if out["failed"]:
                        raise RuntimeError(f"{arm}: {out['failed']} requests failed")
                    figures[arm]["rps"].append(out["rps"])
                    figures[arm]["cpu_us"].append(cpu / out["requests"] * 1e6)
                order = order[1:] + order[:1]
                print(f"round {n + 1}/{rounds}: " + "  ".join(
                    f"{a} {f['rps'][-1]:,.0f} req/s" for a, f in figures.items()
                ), file=sys.stderr)  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=10)
    return figures


def summary(figures: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Medians of the per-round ratios: each build against the raw relay, after/before."""
    raw = figures[RAW]
    out: dict[str, float] = {}
    for build in ("before", "after"):
        mine = figures[build]
        out[f"{build} req/s vs raw relay"] = statistics.median(
            a / r for a, r in zip(mine["rps"], raw["rps"], strict=True)
        )
        out[f"{build} CPU vs raw relay"] = statistics.median(
            a / r for a, r in zip(mine["cpu_us"], raw["cpu_us"], strict=True)
        )
    paired = [a / b for a, b in zip(figures["after"]["rps"], figures["before"]["rps"], strict=True)]
    out["after/before req/s"] = statistics.median(paired)
    out["rounds after was faster"] = sum(p > 1 for p in paired)
    out["rounds"] = len(paired)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="spillgate bench builds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("before", type=Path, help="a checkout with its .venv")
    parser.add_argument("after", type=Path, help="a checkout with its .venv")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=int, default=3, help="per measurement")
    args = parser.parse_args(argv)
    figures = compare(args.before, args.after, rounds=args.rounds, seconds=args.seconds)
    for name, value in summary(figures).items():
        print(f"{name:28} {value:8.3f}" if isinstance(value, float) else f"{name:28} {value:8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
