"""Machine instructions run per request, counted under valgrind's callgrind.

`spillgate bench instructions` sends the bench's request (`spillgate bench`'s
config, Redis off) through each arm's ASGI interface, one at a time on uvloop, as
`loadtest.bench.ops` does, but in a child process under `valgrind --tool=callgrind`, and
counts the instructions the whole process ran. Each arm runs twice, with `--warmup` and
with `--warmup` + `--requests` requests; the difference over `--requests` is the cost
of one request, with start-up and shutdown cancelled out. The zero-delay backend runs
in its own process, outside valgrind. Repeated runs agree within about half a percent,
where timings on this machine drift by 2x over minutes.

Under valgrind a request runs some fifty times slower, so the request watch's first
tick (100 ms in) would begin a disconnect watch that a request at full speed never
starts; the child moves that tick past the run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from loadtest.bench.overhead import _uvicorn
from loadtest.procs import free_port, serving_process

ARMS = ("raw relay", "lean relay", "spillgate")  # lean: the raw relay on the gateway's client
TICK_PAST_RUN_S = 3600.0


def _child(arm: str, requests: int, backend: str) -> None:
    """Runs in the process valgrind watches: `requests` bench requests through `arm`."""
    import uvloop

    from gateway.front import watch
    from loadtest.bench.ops import _app, drive

    # the default itself, so that no wrapper adds its own cost to every request
    watch.RequestWatch.__init__.__kwdefaults__["after_s"] = TICK_PAST_RUN_S
    with tempfile.TemporaryDirectory() as tmp:
        uvloop.run(drive(_app(arm, backend, Path(tmp)), requests))


def child_command(arm: str, requests: int, backend: str) -> list[str]:
    """The process callgrind watches: `requests` bench requests through `arm`."""
    return [
        sys.executable, "-m", "loadtest.bench.instructions", "--child", arm,
        "--requests", str(requests), "--backend", backend,
    ]  # fmt: skip


def callgrind_total(cmd: list[str], out: Path) -> int:
    """Instructions `cmd` ran under callgrind, start-up and shutdown included."""
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts run to run
    done = subprocess.run([*valgrind, *cmd], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed under callgrind:\n{done.stderr[-2000:]}")
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {out}")


def count(
    arms: tuple[str, ...] = ARMS, *, requests: int = 200, warmup: int = 20
) -> dict[str, float]:
    """Instructions per request for each arm."""
    if not shutil.which("valgrind"):
        raise FileNotFoundError("needs valgrind (Debian: apt-get install valgrind)")
    result: dict[str, float] = {}
    port = free_port()
    with (
        serving_process(_uvicorn("loadtest.bench.apps:backend", port), port) as backend,
        tempfile.TemporaryDirectory() as tmp,
    ):
        for arm in arms:
            base = callgrind_total(child_command(arm, warmup, backend), Path(tmp) / "base.out")
            more = callgrind_total(
                child_command(arm, warmup + requests, backend), Path(tmp) / "more.out"
            )
            result[arm] = (more - base) / requests
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillgate bench instructions", description=__doc__)
    parser.add_argument("--requests", type=int, default=200, help="requests counted per arm")
    parser.add_argument("--warmup", type=int, default=20, help="requests both runs make first")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.requests, args.backend)
        return 0
    result = count(requests=args.requests, warmup=args.warmup)
    raw = result.get("raw relay")
    for arm, n in result.items():
        ratio = f"  ({n / raw:.2f}x the raw relay)" if raw and arm != "raw relay" else ""
        print(f"{arm:12} {n:12,.0f} instructions per request{ratio}")
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json.resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
