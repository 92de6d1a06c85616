"""`spillgate sim`: one simulated vLLM replica, or with `--provider` a simulated external provider.

The replica batches continuously over a KV cache of `--kv-tokens` (or the catalog size of
`--catalog-model` on `--gpu`), steps as fast as its cost model says divided by `--speed`,
and exports vLLM's own metrics. Prompt tokens are counted as ceil(chars / 4) per message
plus 4 per message and 3 per chat prompt. Answers are filler words that end at a sampled
EOS (geometric, mean 256 tokens, as real vLLM stopping on 16 of ~4,096 token ids), capped by
`max_tokens`; `--answer-lengths max_tokens` runs every answer to its cap instead. Prompts'
leading full blocks are cached and reused as by vLLM V1's prefix caching, unless
`--no-enable-prefix-caching`.

A prompt that holds the start of an answer (a chat's last message, the assistant's, with
`continue_final_message`; a completion prompt that ends with the filler's first words) is
answered with the rest of it, as a deterministic model would (loadtest/sim/tokens.py).
SIGTERM stops the replica as it stops vLLM 0.32: by default the requests in flight end at
once with vLLM's dead-engine error and the server stops listening; with
`--shutdown-timeout N` they may run N more seconds while new requests are refused with a
500 (loadtest/sim/shutdown.py).

With `--enable-lora` it serves LoRA adapters as vLLM does (loadtest/sim/lora.py): vLLM's
`--lora-modules`, `--max-loras` and `--max-lora-rank`, and the load and unload endpoints
where VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or `--allow-runtime-lora`).

With `--kv-transfer` it plays either role of vLLM's disaggregated prefill/decode
(loadtest/sim/kv_transfer.py): `params` as NixlConnector (a prefill answer carries
`kv_transfer_params`, a decode leg that brings them loads the prompt's blocks), `shared` as
ExampleConnector (prompts' KV kept in the `--kv-shared-path` folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import uvicorn

from loadtest.sim.app import create_sim_replica
from loadtest.sim.config import (
    KvLoadFailurePolicy,
    KvTransfer,
    LoraLoadFailure,
    LoraModule,
    SimConfig,
    resolve,
)
from loadtest.sim.lengths import DEFAULT_MEAN_TOKENS, DEFAULT_SIGMA, AnswerLengths
from loadtest.sim.provider import DEFAULT_API_KEY, ProviderConfig, create_provider_app
from loadtest.sim.shutdown import Shutdown, SimServer

PROVIDER_KEY_ENV = "SPILLGATE_SIM_PROVIDER_KEY"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--port", type=int, default=8000, help="listen port")
    parser.add_argument("--json", action="store_true", help="print the start-up line as JSON")
    replica = parser.add_argument_group("simulated vLLM replica")
    replica.add_argument("--model", default="sim-model", help="served model name")
    replica.add_argument("--kv-tokens", type=int, help="KV-cache budget in tokens")
    replica.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    replica.add_argument(
        "--max-model-len",
        type=int,
        help="the context it accepts (default: the catalog's, else 8192)",
    )
    replica.add_argument(
        "--max-num-seqs", type=int, help="default: the catalog's with --gpu, else 256"
    )
    replica.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="prefill tokens a step takes"
    )
    replica.add_argument(
        "--default-max-tokens", type=int, default=256, help="a request's cap when it sets none"
    )
    replica.add_argument("--speed", type=float, default=1.0, help="10 = ten times real time")
    replica.add_argument("--no-delay", action="store_true", help="answer at once, no engine")
    replica.add_argument(
        "--flush-interval",
        type=float,
        default=0.05,
        help="least seconds between a stream's writes (0: every step)",
    )
    replica.add_argument("--gpu", help="size KV and step cost from the catalog for this GPU")
    replica.add_argument("--catalog-model", help="catalog model (default: --model)")
    replica.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (with --gpu)")
    replica.add_argument("--kv-dtype", default="auto", help="vLLM --kv-cache-dtype (with --gpu)")
    replica.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share (with --gpu)"
    )
    replica.add_argument("--vocab-size", type=int, help="refuse prompt token ids from this on")
    replica.add_argument(
        "--answer-lengths",
        choices=[m.value for m in AnswerLengths],
        default=AnswerLengths.GEOMETRIC.value,
        help="where answers end: at a sampled EOS, geometric (default) or lognormal, capped "
        "by max_tokens; or max_tokens: every answer runs to its cap (max_tokens, else "
        "--default-max-tokens). In every mode ignore_eos drops the sampled EOS and each of k "
        "stop_token_ids stops a token with probability k / --vocab-size (default 32000); "
        "stop strings are accepted but not matched",
    )
    replica.add_argument(
        "--answer-mean-tokens",
        type=float,
        default=DEFAULT_MEAN_TOKENS,
        help="mean answer length before the cap (default %(default)s)",
    )
    replica.add_argument(
        "--answer-sigma", type=float, default=DEFAULT_SIGMA, help="lognormal shape"
    )
    replica.add_argument(
        "--seed", type=int, help="seed answer lengths of requests that send no seed"
    )
    replica.add_argument(
        "--embedding-dim", type=int, help="serve an embedding model with vectors of this size"
    )
    replica.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes computed before, as vLLM V1 does "
        "(default: on)",
    )
    replica.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="vLLM's: on SIGTERM, 0 (default) ends the requests in flight at once with an "
        "error; N lets them run N more seconds while new ones are refused",
    )
    replica.add_argument(
        "--kv-events-port",
        type=int,
        help="publish vLLM's KV events (ZMQ PUB) on this port, the replay ROUTER on the next",
    )
    replica.add_argument(
        "--kv-events-drop-every",
        type=int,
        default=0,
        help="leave every Nth event batch off the PUB socket (replay still has it)",
    )
    replica.add_argument(
        "--tokenizer",
        help="a model directory (tokenizer.json, tokenizer_config.json): tokenize as it does",
    )
    _add_lora_arguments(parser)
    _add_kv_transfer_arguments(parser)
    provider = parser.add_argument_group("simulated external provider")
    provider.add_argument("--provider", action="store_true", help="run the provider instead")
    provider.add_argument(
        "--api-key", help=f"key the provider accepts (default: ${PROVIDER_KEY_ENV} or built-in)"
    )
    provider.add_argument(
        "--provider-model",
        action="append",
        default=[],
        dest="provider_models",
        help="a model it serves (repeatable; default: any)",
    )
    provider.add_argument("--rpm", type=int, default=600, help="requests per minute")
    provider.add_argument("--tpm", type=int, default=1_000_000, help="tokens per minute")
    provider.add_argument(
        "--first-token-latency", type=float, default=0.005, help="seconds to the first token"
    )
    provider.add_argument(
        "--token-latency", type=float, default=0.0005, help="seconds between tokens"
    )
    provider.add_argument(
        "--fail-rate", type=float, default=0.0, help="share of requests it fails, 0 to 1"
    )
    provider.add_argument(
        "--fail-status", type=int, default=500, help="the status a failed request gets"
    )


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters (as vLLM's options)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=LoraModule.parse,
        default=[],
        metavar="NAME=PATH",
        help="adapters served from start-up: NAME=PATH, vLLM's JSON form, or a bare NAME",
    )
    lora.add_argument(
        "--max-loras", type=int, default=1, help="distinct adapters a step may run, as vLLM's"
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=16, help="vLLM's; the largest rank it accepts"
    )
    lora.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also {RUNTIME_LORA_ENV}=1)",
    )
    lora.add_argument(
        "--lora-load-time",
        type=float,
        default=0.05,
        help="seconds a load takes",
    )
    lora.add_argument(
        "--fail-lora-loads",
        choices=[f.value for f in LoraLoadFailure],
        help="simulator only: every load fails, as vLLM answers a path with no adapter "
        "(not-found, 404) or an adapter it refuses (error, 500)",
    )


def _add_kv_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    kv = parser.add_argument_group("disaggregated prefill/decode (as vLLM's KV connectors)")
    kv.add_argument(
        "--kv-transfer",
        choices=[k.value for k in KvTransfer],
        help="params: as NixlConnector, a prefill leg (kv_transfer_params do_remote_decode) "
        "answers with the kv_transfer_params its decode leg brings, and a decode leg loads "
        "the prompt's full blocks from the prefiller instead of computing them; shared: as "
        "ExampleConnector, every engine saves prompts' KV in --kv-shared-path and loads the "
        "longest entry that begins a prompt (default: neither)",
    )
    kv.add_argument(
        "--kv-shared-path", help="the folder the engines share (with --kv-transfer shared)"
    )
    kv.add_argument(
        "--engine-id",
        help="the remote_engine_id its prefill answers name (default: a random one, as vLLM's)",
    )
    kv.add_argument(
        "--kv-load-failure-policy",
        choices=[p.value for p in KvLoadFailurePolicy],
        default=KvLoadFailurePolicy.FAIL.value,
        help="vLLM's: a KV load that fails (prefiller unreachable or of another engine id, a "
        "shared entry missing its file) kills the engine and the server exits (fail, the "
        "default), or the prompt is computed locally (recompute)",
    )


def _runtime_lora(args: argparse.Namespace) -> bool:
    """The flag, or vLLM's environment variable (1 or true) where LoRA is enabled: the
    variable may be set for a whole host, the flag is asked for."""
    value = os.environ.get(RUNTIME_LORA_ENV, "").strip().lower()
    return bool(args.allow_runtime_lora) or (args.enable_lora and value in ("1", "true"))


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        default_max_tokens=args.default_max_tokens,
        speed=args.speed,
        no_delay=args.no_delay,
        flush_interval_s=args.flush_interval,
        gpu=args.gpu,
        catalog_model=args.catalog_model,
        tp=args.tp,
        kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        vocab_size=args.vocab_size,
        answer_lengths=AnswerLengths(args.answer_lengths),
        answer_mean_tokens=args.answer_mean_tokens,
        answer_sigma=args.answer_sigma,
        seed=args.seed,
        embedding_dim=args.embedding_dim,
        enable_prefix_caching=args.enable_prefix_caching,
        shutdown_timeout_s=args.shutdown_timeout,
        kv_events_port=args.kv_events_port,
        kv_events_drop_every=args.kv_events_drop_every,
        tokenizer=args.tokenizer,
        enable_lora=args.enable_lora,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        allow_runtime_lora_updating=_runtime_lora(args),
        lora_load_s=args.lora_load_time,
        fail_lora_loads=args.fail_lora_loads,
        kv_transfer=None if args.kv_transfer is None else KvTransfer(args.kv_transfer),
        kv_shared_path=args.kv_shared_path,
        engine_id=args.engine_id,
        kv_load_failure_policy=KvLoadFailurePolicy(args.kv_load_failure_policy),
    )


def provider_config(args: argparse.Namespace) -> ProviderConfig:
    return ProviderConfig(
        api_key=args.api_key or os.environ.get(PROVIDER_KEY_ENV) or DEFAULT_API_KEY,
        models=tuple(args.provider_models),
        requests_per_minute=args.rpm,
        tokens_per_minute=args.tpm,
        first_token_latency_s=args.first_token_latency,
        token_latency_s=args.token_latency,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
    )


def run(args: argparse.Namespace) -> int:
    url = f"http://{args.host}:{args.port}"
    shutdown: Shutdown | None = None
    try:
        if args.provider:
            config = provider_config(args)
            app = create_provider_app(config)
            info: dict[str, object] = {
                "kind": "provider",
                "url": url,
                "rpm": config.requests_per_minute,
                "tpm": config.tokens_per_minute,
            }
        else:
            replica = sim_config(args)
            resolved = resolve(replica)
            built = create_sim_replica(replica)
            app, shutdown = built.app, built.shutdown
            info = {
                "kind": "vllm",
                "url": url,
                "model": replica.model,
                "kv_tokens": resolved.kv_tokens,
                "num_gpu_blocks": resolved.num_blocks,
                "max_model_len": resolved.max_model_len,
                "speed": replica.speed,
                "no_delay": replica.no_delay,
                "answer_lengths": replica.answer_lengths.value,
                "enable_prefix_caching": replica.enable_prefix_caching,
            }
            if replica.enable_lora:
                info["lora_modules"] = ",".join(m.name for m in replica.lora_modules)
                info["max_loras"] = replica.max_loras
                info["runtime_lora_updating"] = replica.allow_runtime_lora_updating
            if replica.kv_transfer is not None:
                info["kv_transfer"] = replica.kv_transfer.value
                info["kv_load_failure_policy"] = replica.kv_load_failure_policy.value
    except ValueError as exc:
        print(f"spillgate sim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info), flush=True)
    else:
        print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    served = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(served) if shutdown is None else SimServer(served, shutdown=shutdown)
    server.run()
    return 0
