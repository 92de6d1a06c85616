"""What tokenizing a prompt costs the request path, for a pool routed by KV events.

    spillgate bench tokenize                       # the tiny model's and the sim's tokenizers
    spillgate bench tokenize --requests 200 --json out.json

A pool whose backends publish KV events tokenizes every request as its engine does
(gateway/admission/prompt_tokens.py, `prompt_token_ids`: the chat template rendered, the
text split at its special tokens, each piece tokenized once and cached), then keys the
prompt's blocks (gateway/admission/routing/kv_index.py, `block_keys`) for the router. This runs that
very code in process on chats of about 1k and 8k prompt tokens: a system prompt and a short
user message, each request's system prompt new (`cold`: nothing cached) or the tenant's
same one (`cached`: only the user message is new), and reports per request the median and
p90 of

- `on loop`: CPU time the event loop's thread spent (rendering, splitting, the cache, the
  hand-off to the worker thread, keying the blocks): what every other request waits for;
- `total`: wall time until the request has its block keys, the worker's tokenizing too;
- `inline`: the same work all on the loop (`PromptTokenizer.chat`), as it was done before
  new text moved to a worker thread.

Tokenizers: the tiny Llama's the real-vLLM runs serve (loadtest/real_vllm/tiny_model.py,
a 4,096-token BPE; from $TINY_MODEL_DIR, /tmp/spillgate-tiny-llama, when there, else made
here) and the simulator's (loadtest/sim/tokenizer_files.py, 512 tokens). Results in
BENCHMARKS.md ("Tokenizing for the KV-events index").
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.admission.prompt_tokens import PromptTokenizer, prompt_token_ids
from gateway.admission.routing.kv_index import block_keys
from loadtest.loadgen.text import table
from loadtest.percentile import percentile

SIZES = (1024, 8192)  # prompt tokens
USER_TOKENS = 48
BLOCK_SIZE = 16  # vLLM's default on GPUs: the most keys a prompt makes
_WORDS = (
    "the of and to in is that for it as with was on be by this are from or an at which not "
    "have has but they all were one their can more when will there been also its into only "
    "other time some would these may could first over such then after most made through "
    "request backend cache tokens prompt model gateway tenant engine block routing latency "
    "throughput replica queue answer system user assistant policy budget capacity memory"
)
WORDS = _WORDS.split(" ")


def prose(rng: random.Random, words: int) -> str:
    parts = []
    for i in range(words):
        word = rng.choice(WORDS)
        parts.append(word + ("." if i % 13 == 12 else "," if i % 7 == 6 else ""))
    return " ".join(parts)


def system_prompt(tokenizer: PromptTokenizer, rng: random.Random, tokens: int) -> str:
    """About `tokens` less USER_TOKENS tokens of prose, as `tokenizer` counts them."""
    want = tokens - USER_TOKENS
    per_word = len(tokenizer.text(prose(rng, 400))) / 400
    text = prose(rng, int(want / per_word))
    while (have := len(tokenizer.text(text))) < want * 0.98:
        text += " " + prose(rng, max(4, int((want - have) / per_word)))
    return text


def chat(system: str, user: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


async def path_cost(tokenizer: PromptTokenizer, body: dict[str, Any]) -> tuple[float, float, int]:
    """(seconds on the loop's thread, seconds in all, prompt tokens) of one request."""
    cpu, wall = time.thread_time(), time.perf_counter()
    ids = await prompt_token_ids(body, tokenizer)
    block_keys(ids, BLOCK_SIZE)
    return time.thread_time() - cpu, time.perf_counter() - wall, len(ids)


def inline_cost(tokenizer: PromptTokenizer, body: dict[str, Any]) -> float:
    wall = time.perf_counter()
    block_keys(tokenizer.chat(body) or [], BLOCK_SIZE)
    return time.perf_counter() - wall


def measure_case(
    make: Callable[[], PromptTokenizer], size: int, *, cached: bool, requests: int, seed: int
) -> dict[str, Any]:
    """One case on fresh tokenizers: the path's cost, then the same bodies inline."""
    rng = random.Random(seed)
    probe = make()
    shared = system_prompt(probe, rng, size)
    bodies = [
        chat(shared if cached else system_prompt(probe, rng, size), prose(rng, USER_TOKENS // 2))
        for _ in range(requests)
    ]
    on_loop, total, tokens = [], [], []
    tokenizer = make()
    if cached:
        tokenizer.chat(chat(shared, "warm"))

    async def run() -> None:
        for body in bodies:
            cpu, wall, n = await path_cost(tokenizer, body)
            on_loop.append(cpu)
            total.append(wall)
            tokens.append(n)

    asyncio.run(run())
    tokenizer = make()
    if cached:
        tokenizer.chat(chat(shared, "warm"))
    inline = [inline_cost(tokenizer, body) for body in bodies]
    return {
        "prompt_tokens_median": percentile(sorted(tokens), 50),
        **_quantiles("on_loop", on_loop),
        **_quantiles("total", total),
        **_quantiles("inline", inline),
    }


def _quantiles(name: str, seconds: list[float]) -> dict[str, float | None]:
    ordered = sorted(seconds)
    return {f"{name}_p50_ms": _ms(percentile(ordered, 50)),
            f"{name}_p90_ms": _ms(percentile(ordered, 90))}  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def tokenizers(workdir: Path) -> dict[str, Path]:
    from loadtest import real_vllm
    from loadtest.sim import tokenizer_files

    shared = real_vllm.MODEL_DIR
    tiny = shared if real_vllm.has_model(shared) else real_vllm.model_dir(workdir / "tiny")
    return {"tiny": tiny, "sim": tokenizer_files.write(workdir / "sim")}


def measure(requests: int, seed: int) -> dict[str, Any]:
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as workdir:
        for name, directory in tokenizers(Path(workdir)).items():
            for size in SIZES:
                for cached in (False, True):
                    n = requests if size <= 1024 or cached else max(10, requests // 4)
                    make = functools.partial(PromptTokenizer, directory)
                    figures = measure_case(make, size, cached=cached, requests=n, seed=seed)
                    cases.append({"tokenizer": name, "size": size, "cached": cached,
                                  "requests": n, **figures})  # fmt: skip
                    print(f"{name} {size} {'cached' if cached else 'cold'}: done",
                          file=sys.stderr, flush=True)  # fmt: skip
    return {"block_size": BLOCK_SIZE, "cases": cases}


def report(figures: dict[str, Any]) -> str:
    header = ["tokenizer", "chat", "system prompt", "tokens", "on loop p50", "p90",
              "total p50", "p90", "inline p50", "p90"]  # fmt: skip
    rows = [header]
    for c in figures["cases"]:
        rows.append([c["tokenizer"], f"{c['size'] // 1024}k",
                     "cached" if c["cached"] else "cold", str(c["prompt_tokens_median"]),
                     *(f"{c[k]:.3f}" for k in ("on_loop_p50_ms", "on_loop_p90_ms",
                                               "total_p50_ms", "total_p90_ms",
                                               "inline_p50_ms", "inline_p90_ms"))])  # fmt: skip
    note = f"milliseconds a request; block keys of {figures['block_size']} tokens included"
    return table(rows, ["<", "<", "<"] + [">"] * 7) + "\n" + note


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spillgate bench tokenize", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--requests", type=int, default=200, help="requests a case (8k cold: 1/4)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    figures = measure(args.requests, args.seed)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
