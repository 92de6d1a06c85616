"""`spillgate bench [NAME] [its options]`: every benchmark by name, each imported only when
it runs. Alone, or with options only, `spillgate bench` runs `overhead`, as it always did.

Each benchmark module exposes `main(argv) -> int`, which parses its own options (and keeps
`python -m loadtest.bench.NAME` working).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

DEFAULT = "overhead"
BENCHES: dict[str, tuple[str, str]] = {
    "overhead": (
        "loadtest.bench.overhead",
        "what the gateway costs beside direct access and raw relays (needs wrk)",
    ),
    "builds": ("loadtest.bench.builds", "two checkouts' gateways side by side at concurrency 64"),
    "instructions": (
        "loadtest.bench.instructions",
        "machine instructions per request, under valgrind's callgrind",
    ),
    "ops": ("loadtest.bench.ops", "Python bytecode run per request, counted in-process"),
    "limiter": ("loadtest.bench.limiter", "rate-limiter decisions per second, Redis beside local"),
    "loadgen": ("loadtest.bench.loadgen", "how many arrivals/s `spillgate loadtest` keeps on time"),
    "admission": (
        "loadtest.bench.admission",
        "the admission arms and direct on the same seeded bursts and a spike",
    ),
    "warm-start": (
        "loadtest.bench.warm_start",
        "a burst from the first request: a fresh gateway, a warm one, a second replica",
    ),
    "prefix": ("loadtest.bench.prefix", "prefix-aware routing on a shared-prefix workload"),
    "slo-ladder": (
        "loadtest.bench.slo_ladder",
        "goodput under a spike: the TTFT ladder against the fixed overflow chain",
    ),
    "restart": (
        "loadtest.bench.restart",
        "rolling restarts: what clients see while the backends are stopped in turn",
    ),
    "failover": (
        "loadtest.bench.failover",
        "a Redis Cluster master killed under load, then its promoted replica: 2 replicas",
    ),
    "fairness": (
        "loadtest.bench.fairness",
        "a flood against a light tenant and a lower class, on one replica and on three",
    ),
    "kv-events": (
        "loadtest.bench.kv_events",
        "prefix routing by the engines' KV events, with evictions and direct traffic",
    ),
    "tokenize": (
        "loadtest.bench.tokenize",
        "what tokenizing a prompt for the KV-events index costs the request path",
    ),
    "hostile": (
        "loadtest.bench.hostile",
        "one tenant timed while another's upstream sends an event that never ends",
    ),
    "adapters": (
        "loadtest.bench.adapters",
        "LoRA adapter routing against round-robin on two engines with adapter slots",
    ),
    "disagg": (
        "loadtest.bench.disagg",
        "prefill and decode on different engines against a unified pool, either leg failing",
    ),
    "preempt": (
        "loadtest.bench.preempt",
        "critical requests into a pool full of sheddable streams, with and without preemption",
    ),
    "soak": ("loadtest.soak", "minutes of mixed load with faults injected, resources sampled"),
    "tools": ("loadtest.tools.run", "guidellm and inference-perf, direct and through the gateway"),
}


class BenchModule(Protocol):
    def main(self, argv: Sequence[str] | None = None) -> int: ...


def usage() -> str:
    lines = ["usage: spillgate bench [NAME] [options]", "", "benchmarks:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in BENCHES.items()]
    lines += [
        "",
        f"Without a NAME: {DEFAULT}. Run `spillgate bench NAME --help` for a benchmark's options.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("--list", "-h", "--help"):
        print(usage())
        return 0
    name = DEFAULT if not args or args[0].startswith("-") else args.pop(0)
    if name not in BENCHES:
        valid = ", ".join(BENCHES)
        print(f"spillgate bench: unknown benchmark {name!r}; one of: {valid}", file=sys.stderr)
        return 2
    module = cast(BenchModule, importlib.import_module(BENCHES[name][0]))
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
