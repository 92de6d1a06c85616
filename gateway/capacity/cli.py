"""`spillgate plan`: KV-cache sessions, tokens per second and GPUs for a model, GPU and workload."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.capacity import render, throughput
from gateway.capacity.catalog import CapacityError, Catalog, ModelSpec, load_catalog
from gateway.capacity.disaggregated import (
    DEFAULT_KV_TRANSFER_GBPS,
    disaggregated_json,
    make_disaggregated_plan,
)
from gateway.capacity.hf_config import model_from_hf_config
from gateway.capacity.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoraOptions
from gateway.capacity.plan import (
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_TARGET_FILL,
    Demand,
    Plan,
    make_plan,
    plan_json,
)
from gateway.capacity.profile import BANDWIDTH_EFFICIENCY, FLOPS_EFFICIENCY, ReplicaOptions


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that size one replica; `spillgate measure` shares them."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica")
    parser.add_argument("--kv-dtype", default="auto", help="vLLM --kv-cache-dtype (auto, fp8)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of GPU memory"
    )
    parser.add_argument("--max-model-len", type=int, help="default: the model's context")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, help="default: vLLM's for the GPU")
    parser.add_argument("--catalog", type=Path, help="a catalog YAML instead of the packaged one")
    lora = parser.add_argument_group(
        "LoRA (vLLM's adapter buffers, allocated at start-up, come out of the KV cache)"
    )
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="as vLLM's; implied by --max-loras, --max-lora-rank and --lora-target-modules",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help=f"adapters in one batch: buffer slots (vLLM's default {DEFAULT_MAX_LORAS})",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        metavar="R",
        help=f"the rank every slot is sized for (vLLM's default {DEFAULT_MAX_LORA_RANK})",
    )
    lora.add_argument(
        "--lora-target-modules",
        nargs="+",
        metavar="MODULE",
        help="only these layers get buffers (q_proj, o_proj, ...; default: all vLLM wraps)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="a catalog model (see --list)")
    which.add_argument("--model-config", type=Path, help="a Hugging Face config.json")
    parser.add_argument("--gpu", help="a catalog GPU (see --list)")
    parser.add_argument("--list", action="store_true", help="list the known models and GPUs")
    add_replica_arguments(parser)
    memory = parser.add_argument_group("memory overrides (GiB per GPU; default: estimated)")
    memory.add_argument(
        "--weights-gib",
        type=float,
        help='the weights alone (vLLM\'s "Model loading took" also counts LoRA buffers)',
    )
    memory.add_argument("--activation-gib", type=float, help="PyTorch activation peak")
    memory.add_argument("--non-torch-gib", type=float, help="CUDA graphs, NCCL and the like")
    memory.add_argument(
        "--kv-cache-gib",
        type=float,
        help="the KV pool outright, like vLLM's --kv-cache-memory; overrides the other three",
    )
    work = parser.add_argument_group(
        "workload (lengths not given are assumed, and the plan says which)"
    )
    work.add_argument(
        "--prompt-tokens", type=int, help=f"a session's prompt (default {DEFAULT_PROMPT_TOKENS})"
    )
    work.add_argument(
        "--output-tokens", type=int, help=f"a session's answer (default {DEFAULT_OUTPUT_TOKENS})"
    )
    work.add_argument(
        "--shared-prompt-tokens",
        type=int,
        metavar="S",
        help="prompt tokens that requests open with in common (a system prompt); vLLM's "
        "prefix cache holds their whole blocks once per replica (default 0)",
    )
    work.add_argument(
        "--shared-share",
        type=float,
        metavar="F",
        help="share of requests that carry the shared prompt, 0 to 1 (default 1)",
    )
    rate = work.add_mutually_exclusive_group()
    rate.add_argument("--rps", type=float, help="peak requests per second")
    rate.add_argument("--sessions", type=int, help="peak concurrent sessions")
    work.add_argument("--burst", type=float, default=1.0, help="peak-to-mean factor on top")
    work.add_argument(
        "--target-fill",
        type=float,
        default=DEFAULT_TARGET_FILL,
        help="fraction of the KV bound each replica is run at, as the gateway's target_fill",
    )
    work.add_argument("--ttft-slo-ms", type=float, help="cap sessions per replica to meet it")
    work.add_argument(
        "--itl-slo-ms",
        type=float,
        help="inter-token latency objective: cap sessions per replica so a step meets it",
    )
    split = parser.add_argument_group(
        "disaggregated prefill/decode (prefill and decode engines sized apart, against unified)"
    )
    split.add_argument(
        "--disaggregated",
        action="store_true",
        help="also size prefill and decode engines apart for --rps, and compare the GPUs",
    )
    split.add_argument(
        "--kv-transfer-gbps",
        type=float,
        default=DEFAULT_KV_TRANSFER_GBPS,
        metavar="GBIT",
        help="each GPU's link for moving a prompt's KV from prefill to decode engine",
    )
    speed = parser.add_argument_group("speed model")
    speed.add_argument(
        "--bandwidth-efficiency",
        type=float,
        default=BANDWIDTH_EFFICIENCY,
        help="share of the GPU's memory bandwidth a decode step attains",
    )
    speed.add_argument(
        "--flops-efficiency",
        type=float,
        default=FLOPS_EFFICIENCY,
        help="share of the GPU's dense bf16 FLOPS a prefill attains",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--chart", type=Path, metavar="FILE", help="SVG of tokens/s and TTFT against concurrency"
    )


def lora_options(args: argparse.Namespace) -> LoraOptions | None:
    """vLLM needs --enable-lora; here giving any LoRA size is taken to mean it."""
    sizes = (
        getattr(args, "max_loras", None),
        getattr(args, "max_lora_rank", None),
        getattr(args, "lora_target_modules", None),
    )
    if not getattr(args, "enable_lora", False) and all(size is None for size in sizes):
        return None
    max_loras, max_lora_rank, target_modules = sizes
    return LoraOptions(
        max_loras=DEFAULT_MAX_LORAS if max_loras is None else max_loras,
        max_lora_rank=DEFAULT_MAX_LORA_RANK if max_lora_rank is None else max_lora_rank,
        target_modules=None if target_modules is None else tuple(target_modules),
    )


def replica_options(args: argparse.Namespace) -> ReplicaOptions:
    return ReplicaOptions(
        tp=args.tp,
        kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        weights_gib=getattr(args, "weights_gib", None),
        activation_gib=getattr(args, "activation_gib", None),
        non_torch_gib=getattr(args, "non_torch_gib", None),
        kv_cache_gib=getattr(args, "kv_cache_gib", None),
        lora=lora_options(args),
        bandwidth_efficiency=getattr(args, "bandwidth_efficiency", BANDWIDTH_EFFICIENCY),
        flops_efficiency=getattr(args, "flops_efficiency", FLOPS_EFFICIENCY),
    )


def _model(args: argparse.Namespace, catalog: Catalog) -> ModelSpec:
    if args.model_config is not None:
        return model_from_hf_config(args.model_config)
    if not args.model:
        raise CapacityError("give --model NAME or --model-config FILE (see --list)")
    return catalog.model(args.model)


def _workload(args: argparse.Namespace) -> throughput.Workload:
    if args.shared_share is not None and args.shared_prompt_tokens is None:
        raise CapacityError("--shared-share needs --shared-prompt-tokens: the prompt it shares")
    return throughput.Workload(
        prompt_tokens=args.prompt_tokens or DEFAULT_PROMPT_TOKENS,
        output_tokens=args.output_tokens or DEFAULT_OUTPUT_TOKENS,
        shared_prompt_tokens=args.shared_prompt_tokens or 0,
        shared_share=1.0 if args.shared_share is None else args.shared_share,
    )


def build_plan(args: argparse.Namespace) -> Plan:
    catalog = load_catalog(args.catalog)
    if not args.gpu:
        raise CapacityError("give --gpu NAME (see --list)")
    demand = Demand(
        rps=args.rps,
        sessions=args.sessions,
        burst=args.burst,
        target_fill=args.target_fill,
        ttft_slo_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1e3,
        itl_slo_s=None if args.itl_slo_ms is None else args.itl_slo_ms / 1e3,
    )
    return make_plan(
        _model(args, catalog),
        catalog.gpu(args.gpu),
        options=replica_options(args),
        workload=_workload(args),
        demand=demand,
        assumed=tuple(
            option
            for option, given in (
                ("--prompt-tokens", args.prompt_tokens),
                ("--output-tokens", args.output_tokens),
            )
            if given is None
        ),
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.list:
            print(render.catalog_listing(load_catalog(args.catalog)))
            return 0
        plan = build_plan(args)
        split = None
        if args.disaggregated:
            split = make_disaggregated_plan(plan, kv_transfer_gbps=args.kv_transfer_gbps)
    except CapacityError as exc:
        print(f"spillgate plan: error: {exc}", file=sys.stderr)
        return 2
    if args.chart is not None:
        render.write_chart(plan, args.chart)
        print(f"wrote {args.chart.resolve()}", file=sys.stderr)
    if args.json:
        out = plan_json(plan)
        if split is not None:
            out["disaggregated"] = disaggregated_json(split)
        print(json.dumps(out, indent=2))
    else:
        print(render.plan_table(plan))
        if split is not None:
            print(f"\n{render.disaggregated_table(split)}")
    return 0
