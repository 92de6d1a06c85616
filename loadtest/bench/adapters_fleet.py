"""The engines and the gateway `spillgate bench adapters` measures: two engines serving LoRA
adapters of one model (simulators, or real vLLMs of the CPU build), each with `--max-loras`
slots, and a `spillgate serve` with one pool over both that declares the adapters.

A scenario says which adapters each engine serves from start-up, and which adapter (if
any) no engine serves: the pool declares that one with a `path`, and the engines run with
runtime loading allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), so the gateway may load it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.config import hash_key
from loadtest.bench import admission_fleet
from loadtest.procs import free_port
from loadtest.real_vllm import RealVllm, install, model_dir, running

ADAPTERS = ("a1", "a2", "a3", "a4")
MODEL = "tiny"  # the real vLLM's served name; the simulators take it too
TENANT, KEY = "bench", "sk-bench-adapters"
LORA_DIR = Path("/tmp/spillgate-lora")  # the real vLLMs read the adapters' weights here
MAX_LORA_RANK = 8
UNLIMITED = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    served: tuple[tuple[str, ...], tuple[str, ...]]  # each engine's adapters from start-up
    loaded: str | None = None  # declared with a `path`, served by no engine at start-up
    help: str = ""


SCENARIOS = {
    "shared": Scenario(
        name="shared",
        served=(ADAPTERS, ADAPTERS),
        help="both engines serve all four adapters: round-robin may send any adapter to either",
    ),
    "split": Scenario(
        name="split",
        served=(("a1", "a2"), ("a3",)),
        loaded="a4",
        help="engine 0 serves a1 and a2, engine 1 a3; a4 is served nowhere and has a path",
    ),
}


@dataclass(frozen=True, kw_only=True)
class Engine:
    name: str
    url: str
    adapters: tuple[str, ...]
    # what its server's command line holds, and no other process's (machine.cores_seen)
    command: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Fleet:
    engines: tuple[Engine, ...]
    kind: str  # simulator | real-vllm
    extra: dict[str, Any]  # added to every request's body


def adapter_paths() -> dict[str, Path]:
    """Where each adapter's files are: all four made together under the vLLM virtualenv
    when one is missing (a seed each, by their order: the same name, the same weights)."""
    paths = {name: LORA_DIR / name for name in ADAPTERS}
    if not all((p / "adapter_model.safetensors").is_file() for p in paths.values()):
        python = Path(os.environ.get("VLLM_VENV", "/tmp/vllmenv")) / "bin" / "python"
        maker = Path(__file__).resolve().parents[1] / "real_vllm" / "make_lora.py"
        command = [str(python), str(maker), str(model_dir()), *map(str, paths.values())]
        subprocess.run(command, check=True, timeout=300)
    return paths


def _lora_args(served: tuple[str, ...], *, max_loras: int, paths: dict[str, Path]) -> list[str]:
    args = ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(MAX_LORA_RANK)]
    if served:
        args += ["--lora-modules", *(f"{name}={paths[name]}" for name in served)]
    return args


@contextlib.contextmanager
def _simulator(
    served: tuple[str, ...],
    *,
    max_loras: int,
    kv_tokens: int,
    speed: float,
    paths: dict[str, Path],
    log: Path,
    cores: str | None = None,
) -> Iterator[str]:
    port = free_port()
    confine = ["taskset", "-c", cores] if cores is not None else []
    cmd = [
        *confine,
        sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", MODEL,
        "--kv-tokens", str(kv_tokens), "--speed", str(speed), "--allow-runtime-lora",
        *_lora_args(served, max_loras=max_loras, paths=paths),
    ]  # fmt: skip
    with admission_fleet.process(cmd, port, log=log) as url:
        yield url


@contextlib.contextmanager
def start_all(contexts: list[contextlib.AbstractContextManager[str]]) -> Iterator[list[str]]:
    """Enter every context at once (a real vLLM takes a minute to start), exit each after."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(contexts)) as pool:
        futures = [pool.submit(context.__enter__) for context in contexts]
        urls, failure = [], None
        for context, future in zip(contexts, futures, strict=True):
            try:
                urls.append(future.result())
            except Exception as exc:  # the others started may still need stopping
                failure = exc
                continue
            stack.push(context.__exit__)
        if failure is not None:
            raise failure
        yield urls


@contextlib.contextmanager
def fleet(
    scenario: Scenario,
    *,
    real_vllm: bool,
    ports: tuple[int, int],
    max_loras: int,
    kv_tokens: int,
    sim_speed: float,
    workdir: Path,
    engine_cores: str | None = None,
) -> Iterator[Fleet]:
    """The scenario's two engines, started together; stopped after. `engine_cores`: both
    confined to those cores (`taskset -c`), a real vLLM's worker bound there too; None:
    each real vLLM's worker bound to a core of its own (0, 1), the servers unconfined."""
    contexts: list[contextlib.AbstractContextManager[str]]
    if real_vllm:
        install()
        paths = adapter_paths()
        contexts = [
            running(
                RealVllm(
                    port=port,
                    kv_tokens=kv_tokens,
                    # vLLM binds every worker to core 0; the second to core 1, unless
                    # both are placed together
                    cores=engine_cores if engine_cores is not None else str(i),
                    confined=engine_cores is not None,
                    args=tuple(_lora_args(served, max_loras=max_loras, paths=paths)),
                    runtime_lora=True,
                )
            )
            for i, (port, served) in enumerate(zip(ports, scenario.served, strict=True))
        ]
    else:
        paths = {name: LORA_DIR / name for name in ADAPTERS}  # a simulator reads none
        contexts = [
            _simulator(
                served,
                max_loras=max_loras,
                kv_tokens=kv_tokens,
                speed=sim_speed,
                paths=paths,
                log=workdir / f"engine-{i}.log",
                cores=engine_cores,
            )
            for i, served in enumerate(scenario.served)
        ]
    with start_all(contexts) as urls:
        program = "vllm.entrypoints.openai.api_server" if real_vllm else "gateway.cli sim"
        engines = tuple(
            Engine(
                name=f"engine-{i}",
                url=url,
                adapters=served,
                command=(program, f"--port {url.rsplit(':', 1)[1]} "),
            )
            for i, (url, served) in enumerate(zip(urls, scenario.served, strict=True))
        )
        # every answer runs to max_tokens: the same work on every arm
        extra = {"ignore_eos": True}
        yield Fleet(engines=engines, kind="real-vllm" if real_vllm else "simulator", extra=extra)


def gateway_config(fleet_: Fleet, scenario: Scenario, *, refresh_s: float) -> dict[str, Any]:
    """One pool over both engines declaring the four adapters (the scenario's unserved one
    with its path); the tenant's limits out of the way; probes every `refresh_s`."""
    adapters: list[dict[str, Any]] = [
        {"name": name, **({"path": str(LORA_DIR / name)} if name == scenario.loaded else {})}
        for name in ADAPTERS
    ]
    backends = [{"url": e.url, "served_model": MODEL, "capacity": "auto"} for e in fleet_.engines]
    return {
        "tenants": [{"name": TENANT, "key_sha256": hash_key(KEY), **UNLIMITED}],
        "pools": [
            {
                "name": MODEL,
                "backends": backends,
                "adapters": adapters,
                "overflow": ["queue", "reject"],
                "capacity_refresh_s": refresh_s,
                "timeouts": admission_fleet.TIMEOUTS,
            }
        ],
    }


def reset(fleet_: Fleet, scenario: Scenario) -> None:
    """Between arms: empty each engine's prefix cache, and drop the scenario's loaded
    adapter wherever an arm before had it loaded (so each arm finds it served nowhere)."""
    with httpx.Client(timeout=30) as client:
        for engine in fleet_.engines:
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{engine.url}/reset_prefix_cache")
                if scenario.loaded is not None:
                    body = {"lora_name": scenario.loaded}
                    client.post(f"{engine.url}/v1/unload_lora_adapter", json=body)
