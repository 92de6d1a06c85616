"""`spillgate demo`: a whole local fleet in one process tree, no external service needed.

Two simulated backends serve the large-model pool, one the small-model pool, one the
embedding-model pool, and a simulated external provider takes the spill. The large pool
is sized so that about 20 concurrent streaming requests fill it: its overflow chain is
reachable from one laptop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import hash_key, parse_settings
from loadtest.procs import free_port, wait_for_port
from loadtest.sim.lengths import AnswerLengths

LARGE, SMALL, PROVIDER = "llama-3.1-70b", "llama-3.1-8b", "sim-provider"
EMBED, EMBED_SERVED, EMBED_DIM = "bge-small-en", "BAAI/bge-small-en-v1.5", 384
PROVIDER_KEY_ENV = "SPILLGATE_DEMO_PROVIDER_KEY"
ADMIN_ENV = "SPILLGATE_ADMIN_TOKEN"
# ~20 streams of ~100 prompt + 256 output tokens fill 2 × 4096 tokens at 90 % target fill
LARGE_KV_TOKENS = 4096
SMALL_KV_TOKENS = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's listen address")
    parser.add_argument("--port", type=int, default=8080, help="the gateway's listen port")
    parser.add_argument("--api-key", help="the demo tenant's key (default: generated)")
    parser.add_argument("--admin-token", help="admin token (default: generated)")
    parser.add_argument("--redis", help="Redis URL for shared state (default: in-memory)")
    parser.add_argument("--speed", type=float, default=1.0, help="simulator speed factor")
    parser.add_argument("--provider-tpm", type=int, default=20_000, help="provider's own budget")
    parser.add_argument(
        "--answer-lengths",
        choices=[m.value for m in AnswerLengths],
        default=AnswerLengths.GEOMETRIC.value,
        help="where the simulated answers end (see `spillgate sim --help`): a sampled EOS "
        "(default geometric, mean 256 tokens) capped by max_tokens, or max_tokens: always "
        "the cap",
    )


def _sim(port: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--host", "127.0.0.1", "--port", str(port)]
    # a session of its own: a Ctrl-C at the terminal reaches the gateway alone, which stops
    # before the simulators do (the finally of simulated_fleet), not after them
    return subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL, start_new_session=True)


@contextlib.contextmanager
def simulated_fleet(
    *,
    speed: float,
    provider_key: str,
    provider_tpm: int,
    answer_lengths: AnswerLengths = AnswerLengths.GEOMETRIC,
) -> Iterator[dict[str, Any]]:
    """Start the simulated backends and provider; yield their part of the config."""
    ports = {
        "large0": free_port(),
        "large1": free_port(),
        "small": free_port(),
        "embed": free_port(),
        "prov": free_port(),
    }
    big, small = "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"

    def backend(port: int, model: str, kv_tokens: int) -> subprocess.Popen[bytes]:
        return _sim(
            port, "--model", model, "--kv-tokens", str(kv_tokens), "--speed", str(speed),
            "--answer-lengths", answer_lengths.value,
        )  # fmt: skip

    procs = [
        backend(ports["large0"], big, LARGE_KV_TOKENS),
        backend(ports["large1"], big, LARGE_KV_TOKENS),
        backend(ports["small"], small, SMALL_KV_TOKENS),
        _sim(
            ports["embed"], "--model", EMBED_SERVED, "--kv-tokens", str(SMALL_KV_TOKENS),
            "--embedding-dim", str(EMBED_DIM), "--speed", str(speed),
        ),
        _sim(
            ports["prov"], "--provider", "--api-key", provider_key,
            "--tpm", str(provider_tpm), "--rpm", "600",
        ),
    ]  # fmt: skip
    try:
        for port in ports.values():
            wait_for_port(port, timeout=30)
        url = "http://127.0.0.1:{}".format
        yield {
            "pools": [
                {
                    "name": LARGE,
                    "target_fill": 0.9,
                    "overflow": ["queue", "degrade", "provider", "cache", "reject"],
                    "queue": {"max_depth": 16, "max_wait_s": 1.0},
                    "degrade_to": SMALL,
                    "provider": PROVIDER,
                    "capacity_refresh_s": 2.0,
                    "backends": [
                        {"url": url(ports[k]), "served_model": big} for k in ("large0", "large1")
                    ],
                },
                {
                    "name": SMALL,
                    "target_fill": 0.9,
                    "overflow": ["queue", "reject"],
                    "queue": {"max_depth": 8, "max_wait_s": 0.5},
                    "backends": [
                        {
                            "url": url(ports["small"]),
                            "served_model": "meta-llama/Llama-3.1-8B-Instruct",
                        }
                    ],
                },
                {
                    "name": EMBED,
                    "kind": "embedding",
                    "target_fill": 0.9,
                    "overflow": ["queue", "reject"],
                    "queue": {"max_depth": 8, "max_wait_s": 0.5},
                    "backends": [{"url": url(ports["embed"]), "served_model": EMBED_SERVED}],
                },
            ],
            "providers": [
                {
                    "name": PROVIDER,
                    "base_url": url(ports["prov"]) + "/v1",
                    "api_key_env": PROVIDER_KEY_ENV,
                    "models": {LARGE: "provider-large"},
                    "tokens_per_minute": provider_tpm,
                    "max_concurrency": 8,
                    "prompt_price_per_m": 3.0,
                    "completion_price_per_m": 15.0,
                }
            ],
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def demo_settings(fleet: dict[str, Any], *, api_key: str) -> dict[str, Any]:
    tenant = {
        "name": "demo",
        "key_sha256": hash_key(api_key),
        "requests_per_minute": 100_000,
        "tokens_per_minute": 50_000_000,
        "priority": "standard",
    }
    return {"tenants": [tenant], **fleet}


def _backend_lines(fleet: dict[str, Any]) -> list[str]:
    """Each pool's backends by URL and served name: what `spillgate measure` is pointed at."""
    lines = []
    for pool in fleet["pools"]:
        urls = "  ".join(b["url"] for b in pool["backends"])
        served = pool["backends"][0]["served_model"]
        lines.append(f"{pool['name']}: {urls}  (serving {served})")
    for provider in fleet["providers"]:
        lines.append(f"{provider['name']}: {provider['base_url']}  (the external provider)")
    return lines


def _banner(host: str, port: int, *, api_key: str, admin: str, fleet: dict[str, Any]) -> str:
    url = f"http://{host}:{port}"
    curl = (
        f"curl -sS {url}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
        f"-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{LARGE}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\''
    )
    auth = f"-H 'Authorization: Bearer {api_key}' -H 'Content-Type: application/json'"
    embed = (
        f"curl -sS {url}/v1/embeddings {auth} "
        f'-d \'{{"model": "{EMBED}", "input": ["Hello!", "Bonjour!"]}}\''
    )
    respond = (
        f"curl -sS {url}/v1/responses {auth} "
        f'-d \'{{"model": "{LARGE}", "input": "Hello!", "max_output_tokens": 32}}\''
    )
    first = fleet["pools"][0]["backends"][0]
    measure = f"spillgate measure --url {first['url']} --model {first['served_model']}"
    backends = _backend_lines(fleet)
    return "\n".join(
        [
            f"Spillgate demo is serving on {url}",
            f"  API key:      {api_key}",
            f"  admin token:  {admin}   (a header, 'Authorization: Bearer {admin}', "
            f"on GET {url}/admin/status)",
            f"  dashboard:    {url}/dashboard?token={admin}",
            f"  pools:        {LARGE} (2 backends), {SMALL} (1 backend); spill to {PROVIDER}",
            f"                {EMBED} (1 backend, embeddings: POST /v1/embeddings)",
            f"  backends:     {backends[0]}",
            *(f"                {line}" for line in backends[1:]),
            f"  try:          {curl}",
            f"  embeddings:   {embed}",
            f"  responses:    {respond}",
            f"  measure one:  {measure}",
            *_on_path(),
            "Press Ctrl-C to stop.",
        ]
    )


def _on_path() -> list[str]:
    """How to type `spillgate` as the docs write it, when this shell could not: the
    virtual environment `make demo` made is not on PATH until it is activated."""
    script = Path(sys.argv[0]).resolve()
    found = shutil.which("spillgate")
    if script.name != "spillgate" or (found is not None and Path(found).resolve() == script):
        return []
    activate = script.parent / "activate"
    if not activate.exists():
        return [f"  commands:     {script} (not on your PATH)"]
    shown = os.path.relpath(activate) if activate.is_relative_to(Path.cwd()) else activate
    return [f"  commands:     . {shown}   (puts spillgate on your PATH, in each new shell)"]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    api_key = args.api_key or "sk-demo-" + secrets.token_hex(12)
    admin = args.admin_token or secrets.token_hex(16)
    provider_key = "sk-prov-" + secrets.token_hex(8)
    with simulated_fleet(
        speed=args.speed,
        provider_key=provider_key,
        provider_tpm=args.provider_tpm,
        answer_lengths=AnswerLengths(args.answer_lengths),
    ) as fleet:
        settings = parse_settings(demo_settings(fleet, api_key=api_key), source="demo")
        env = {**os.environ, PROVIDER_KEY_ENV: provider_key, ADMIN_ENV: admin}
        app = create_app(settings, environ=env, redis_url=args.redis)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", access_log=False
        )
        server = uvicorn.Server(config)
        banner = _banner(args.host, args.port, api_key=api_key, admin=admin, fleet=fleet)
        print(banner, flush=True)
        # uvicorn re-raises the signal that stopped it; SIGTERM must unwind like Ctrl-C
        # so the simulators are stopped too
        signal.signal(signal.SIGTERM, _interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    print("Spillgate demo stopped.", flush=True)
    return 0
