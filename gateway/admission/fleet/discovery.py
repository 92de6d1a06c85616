"""What a backend tells about itself: its KV-cache capacity and the lengths of the answers it
generated, from its own Prometheus metrics (vLLM or SGLang), and the models it serves, from
its `GET /v1/models`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.admission.fleet.metrics_text import samples

VLLM_CACHE = "vllm:cache_config_info"
SGLANG_TOKENS = "sglang:max_total_num_tokens"
# each finished request's generated tokens; SGLang exports its histogram only when started
# with --collect-tokens-histogram
ANSWER_HISTOGRAMS = ("vllm:request_generation_tokens", "sglang:generation_tokens_histogram")
_ANSWER_SAMPLES = frozenset(f"{h}{part}" for h in ANSWER_HISTOGRAMS for part in ("_bucket", "_sum"))


class KvCache(NamedTuple):
    """What a backend's KV cache can hold for admission: usable tokens, in whole blocks."""

    tokens: int
    block_size: int
    prefix_caching: bool = False  # every engine holds a shared prompt prefix once


def capacity_from_metrics(text: str) -> KvCache | None:
    """The KV cache the server reports, or None if it reports none.

    vLLM: `vllm:cache_config_info` labels num_gpu_blocks × block_size per engine, less one
    block per engine: vLLM's block pool keeps one (the null block) back, so 32 blocks hold
    31 blocks of sequences; its `enable_prefix_caching` label says whether a prefix shared
    by running requests is held once. SGLang: `sglang:max_total_num_tokens`, allocated
    token by token (its radix cache is not reported, so taken as not sharing). Several
    engines behind one address may each hold a shared prefix: the ledger counts it once,
    and what the engines report holding beyond the ledger covers the rest.
    """
    total = 0
    block_size = 0
    found = False
    sharing = True
    for sample in samples(text, (VLLM_CACHE, SGLANG_TOKENS)):
        if sample.name == VLLM_CACHE:
            blocks = sample.labels.get("num_gpu_blocks", "")
            size = sample.labels.get("block_size", "")
            if blocks.isdigit() and size.isdigit() and int(blocks) > 1 and int(size) > 0:
                total += (int(blocks) - 1) * int(size)
                block_size = max(block_size, int(size))
                found = True
                sharing &= sample.labels.get("enable_prefix_caching") == "True"
        else:
            total += int(sample.value)
            block_size = max(block_size, 1)
            found = True
            sharing = False
    if not found:
        return None
    return KvCache(tokens=total, block_size=block_size, prefix_caching=sharing)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedModel:
    """One entry of a backend's `GET /v1/models`, as vLLM writes it."""

    id: str
    root: str | None = None
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's: the model it adapts


def models_from_listing(data: Any) -> list[ServedModel] | None:
    """The models an OpenAI-style `/v1/models` body lists, or None when it is not a listing.

    vLLM reports each model's `max_model_len` (the context it accepts, prompt plus output)
    and `root` (the weights it loaded), and a LoRA adapter's `parent` (the model it adapts);
    servers that do not are read as not telling.
    """
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    models = []
    for entry in data["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        length = entry.get("max_model_len")
        root, parent = entry.get("root"), entry.get("parent")
        models.append(
            ServedModel(
                id=entry["id"],
                root=root if isinstance(root, str) else None,
                parent=parent if isinstance(parent, str) else None,
                max_model_len=length
                if isinstance(length, int) and not isinstance(length, bool) and length > 0
                else None,
            )
        )
    return models


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthHistogram:
    """A backend's histogram of the tokens its answers generated, as Prometheus keeps one:
    cumulative counts at each upper bound (the last one +Inf), and the lengths' sum."""

    bounds: tuple[float, ...]  # rising, the last one inf
    counts: tuple[float, ...]  # answers at or under each bound
    total: float

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def __add__(self, other: LengthHistogram) -> LengthHistogram:
        """Two backends' answers together; with other bounds, the one that saw more."""
        if other.bounds != self.bounds:
            return max(self, other, key=lambda h: h.count)
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return LengthHistogram(bounds=self.bounds, counts=counts, total=self.total + other.total)

    def lengths(self, n: int) -> list[int]:
        """`n` lengths (fewer when it saw fewer answers) spread as the histogram's are: each
        bucket's share, across the bucket, placed toward its upper or lower bound so that
        their mean is the histogram's (its sum over its count); above the last finite
        bound, around the mean the sum leaves for them."""
        seen = self.count
        n = min(n, int(seen))
        if n <= 0:
            return []
        lows = (0.0, *self.bounds[:-1])
        in_bucket = [max(0.0, c - below) for below, c in itertools.pairwise((0.0, *self.counts))]
        shares = _apportion(in_bucket, n)
        finite = [
            (k, lo, hi)
            for k, lo, hi in zip(shares, lows, self.bounds, strict=True)
            if k and hi < math.inf
        ]
        k_over = shares[-1] if math.isinf(self.bounds[-1]) else 0
        over_low = lows[-1] + 1
        want = self.total / seen * n  # what the n lengths add up to
        # the answers over the last finite bound take what the others leave of the sum, as
        # long as that keeps them over it; the others are moved up or down to make it so
        shape = 1.0
        if not k_over or _added(finite, shape) > want - k_over * over_low:
            shape = _shape(finite, want - k_over * over_low)
        lengths = [
            max(math.floor(lo) + 1, min(math.floor(hi), round(lo + (hi - lo) * t)))
            for k, lo, hi in finite
            for t in _positions(k, shape)
        ]
        if k_over:
            mean = max(over_low, (want - sum(lengths)) / k_over)
            lengths.extend(
                round(over_low + 2 * (mean - over_low) * t) for t in _positions(k_over, 1.0)
            )
        return lengths


def _positions(k: int, shape: float) -> list[float]:
    """Where k lengths sit in their bucket, 0 its lower bound and 1 its upper: evenly
    spaced, then raised to `shape` (under 1 pushes them up, over 1 down)."""
    return [((j + 0.5) / k) ** shape for j in range(k)]


def _added(buckets: list[tuple[int, float, float]], shape: float) -> float:
    """What the buckets' lengths add up to, placed with `shape`."""
    return sum(lo + (hi - lo) * t for k, lo, hi in buckets for t in _positions(k, shape))


def _shape(buckets: list[tuple[int, float, float]], want: float) -> float:
    """The `_positions` shape that makes the buckets' lengths add up to `want`, as near as
    their bounds allow (bisection: their sum falls as the shape rises)."""
    low, high = math.log(1 / 64), math.log(64)
    for _ in range(30):
        middle = (low + high) / 2
        if _added(buckets, math.exp(middle)) > want:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2)


def _apportion(weights: list[float], n: int) -> list[int]:
    """`n` split in proportion to `weights`, by largest remainders."""
    whole = sum(weights)
    exact = [w * n / whole for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[: n - sum(shares)]:
        shares[i] += 1
    return shares


def answer_lengths_from_metrics(text: str, *, model: str) -> LengthHistogram | None:
    """The histogram of the answers a backend generated for `model`, all its engines
    together; None when it reports none (or none for that model). Raises ValueError on a
    line the parser cannot read."""
    by_bound: dict[float, float] = {}
    total = 0.0
    for sample in samples(text, _ANSWER_SAMPLES):
        if sample.labels.get("model_name", model) != model:
            continue
        if sample.name.endswith("_sum"):
            total += sample.value
            continue
        bound = float(sample.labels.get("le", "nan"))
        if not math.isnan(bound):
            by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
    if not by_bound or math.inf not in by_bound:
        return None
    bounds = tuple(sorted(by_bound))
    return LengthHistogram(bounds=bounds, counts=tuple(by_bound[b] for b in bounds), total=total)


def merged(histograms: Iterable[LengthHistogram | None]) -> LengthHistogram | None:
    """The pool's answers, its backends' histograms together."""
    found = [h for h in histograms if h is not None]
    if not found:
        return None
    combined = found[0]
    for h in found[1:]:
        combined = combined + h
    return combined
