"""Continuous batching as vLLM's V1 scheduler does it, without the GPU: pure and synchronous.

KV cache is a pool of fixed-size blocks, less one that vLLM's block pool keeps back (the null
block: 32 blocks hold 31 blocks of sequences); a sequence holds whole blocks. Each step,
running sequences (oldest first) get a slot for one more token; when the pool is empty the
newest running sequence is preempted: its blocks are freed and it goes back to the front of
the waiting queue, to be recomputed (prefill of prompt + tokens generated so far) when room
returns. Only in a step with no preemption are waiting sequences admitted, first come first
served, while their whole prefill fits in the free blocks, the sequence limit and the step's
token budget.

A step that computes a sequence's first `n` tokens leaves `n` tokens of KV behind it and
samples token `generated + 1`; a finished sequence frees its blocks at once.

With prefix caching (vLLM V1's default), a sequence that brings its prompt's token ids reuses
the cached blocks its prompt's leading full blocks hash to (see loadtest/sim/blocks.py): they
are shared, not allocated again, and their tokens are not computed. As in vLLM the hit stops
short of the last prompt token, whose logits the first sample needs. Only prompt blocks are
cached: generated tokens are filler no later prompt repeats.

With LoRA (`max_loras` > 0), at most `max_loras` distinct adapters run in one step: a waiting
sequence for another adapter is skipped, and those behind it may still be admitted; skipped
ones go back to the front of the queue in their order, as vLLM's scheduler does.

With a KV connector (`kv_connector`), a sequence may bring `external_tokens`: how many of its
prompt's first tokens a prefiller or a shared store holds (loadtest/sim/kv_transfer.py).
At its first admission, those beyond its local cache hit are loaded, not computed: their
blocks are allocated and named as computed ones, but the step spends no prefill on them. A
preempted sequence computes everything again, as vLLM's connectors load only once. The
adapters of requests the engine has begun (scheduled at least once, not yet ended) are
`active_adapters`, in the order they became active: what vLLM's `lora_requests_info` shows
(a request that has only waited is not in it, as its first event reaches vLLM's front-end
with its first token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from loadtest.sim.blocks import BlockEvents, BlockPool, hash_blocks
from loadtest.sim.config import Adapter


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class Sequence:
    """One request inside the engine."""

    __slots__ = (
        "adapter",
        "answer_tokens",
        "block_hashes",
        "block_ids",
        "cache_hit_tokens",
        "external_hit_tokens",
        "external_tokens",
        "generated",
        "max_tokens",
        "preemptions",
        "prompt_block_ids",
        "prompt_token_ids",
        "prompt_tokens",
        "state",
    )

    def __init__(
        self,
        *,
        prompt_tokens: int,
        max_tokens: int,
        answer_tokens: int | None = None,
        prompt_token_ids: TokenIds[int] | None = None,
        adapter: Adapter | None = None,
    ) -> None:
        """`answer_tokens`: where the answer ends (its sampled EOS), at most `max_tokens`;
        by default the answer runs to `max_tokens`. `prompt_token_ids`, when given, let the
        prefix cache find the prompt's blocks; without them the prompt never hits.
        `adapter`: the LoRA adapter it runs with, None for the base model."""
        answer = max_tokens if answer_tokens is None else answer_tokens
        if prompt_tokens < 1 or not 1 <= answer <= max_tokens:
            raise ValueError("a sequence needs a prompt token and 1..max_tokens output tokens")
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_tokens:
            raise ValueError("prompt_token_ids must hold prompt_tokens ids")
        self.prompt_tokens = prompt_tokens
        self.prompt_token_ids = prompt_token_ids
        self.adapter = adapter
        self.max_tokens = max_tokens
        self.answer_tokens = answer
        self.generated = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # of the prompt's full blocks, once added
        self.external_tokens = 0  # set before it is added: what a KV connector can load
        # where its prompt tokens came from at its first admission: the rest were computed
        self.cache_hit_tokens = 0
        self.external_hit_tokens = 0
        # the blocks that held its prompt's full blocks when it ended: what a prefiller
        # offers its decoder
        self.prompt_block_ids: list[int] = []
        self.preemptions = 0
        self.state = SeqState.WAITING

    @property
    def blocks(self) -> int:
        """KV blocks the sequence holds, shared ones included."""
        return len(self.block_ids)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the next step leaves in the cache."""
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.state is SeqState.FINISHED or self.state is SeqState.ABORTED


@dataclass(frozen=True, kw_only=True)
class SchedulerLimits:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_caching: bool = True
    max_loras: int = 0  # distinct adapters a step may run; 0: LoRA is off
    kv_connector: bool = False  # a KV connector is asked for every new prompt's tokens

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2: vLLM keeps one block back")
        if min(self.block_size, self.max_num_seqs) < 1:
            raise ValueError("block_size and max_num_seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")

    @property
    def usable_blocks(self) -> int:
        """The blocks sequences may hold: all but the null block."""
        return self.num_blocks - 1


S = TypeVar("S", bound=Sequence)


@dataclass(kw_only=True)
class Step(Generic[S]):
    """What one engine step computes."""

    prefills: list[S] = field(default_factory=list)
    decodes: list[S] = field(default_factory=list)
    prefill_tokens: int = 0
    kv_tokens: int = 0  # KV the step reads: every scheduled sequence's context

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass(kw_only=True)
class SchedulerStats:
    prompt_tokens: int = 0  # counted once per request, at its first token
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    peak_kv_blocks: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    peak_reserved_tokens: int = 0
    # vLLM's counters, in tokens, of requests admitted for the first time: prompt tokens
    # looked up, and those found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # the same, asked of a KV connector (only with one)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # vLLM's prompt tokens by source, counted with `prompt_tokens`: they sum to it
    prompt_tokens_local_compute: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external: int = 0


class Scheduler(Generic[S]):
    def __init__(self, limits: SchedulerLimits, *, events: BlockEvents | None = None) -> None:
        self.limits = limits
        self.pool = BlockPool(limits.usable_blocks, events=events)
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self.stats = SchedulerStats()
        # prompt + max_tokens of every sequence present: what a gateway reserves for them
        self.reserved_tokens = 0
        # adapter name -> its sequences begun and not ended, in the order adapters became so
        self.active_adapters: dict[str, int] = {}

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included: vLLM counts those as free."""
        return self.pool.num_free

    @property
    def used_blocks(self) -> int:
        return self.limits.usable_blocks - self.pool.num_free

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.limits.block_size)

    def add(self, seq: S) -> None:
        # the last token's KV is never written: the answer ends when it is sampled
        if self.blocks_for(seq.prompt_tokens + seq.answer_tokens - 1) > self.limits.usable_blocks:
            raise ValueError("sequence can never fit in the KV cache")
        if self.limits.prefix_caching and seq.prompt_token_ids is not None:
            seq.block_hashes = hash_blocks(
                seq.prompt_token_ids, self.limits.block_size, adapter=seq.adapter
            )
        self.waiting.append(seq)
        self.reserved_tokens += seq.prompt_tokens + seq.max_tokens
        stats = self.stats
        stats.peak_waiting = max(stats.peak_waiting, len(self.waiting))
        stats.peak_reserved_tokens = max(stats.peak_reserved_tokens, self.reserved_tokens)

    def abort(self, seq: S) -> None:
        """Drop a sequence wherever it is and free its blocks at once."""
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        else:
            return
        if seq.adapter is not None and (seq.state is SeqState.RUNNING or seq.preemptions):
            self._adapter_ended(seq.adapter)
        self._free(seq)
        self.reserved_tokens -= seq.prompt_tokens + seq.max_tokens
        seq.state = SeqState.ABORTED
        self.stats.aborted += 1

    def schedule(self) -> Step[S]:
        step: Step[S] = Step()
        preempted = self._schedule_running(step)
        if not preempted:
            self._admit_waiting(step)
        stats = self.stats
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, self.used_blocks)
        stats.peak_running = max(stats.peak_running, len(self.running))
        return step

    def complete(self, step: Step[S]) -> list[S]:
        """Each scheduled sequence still running gains a token; returns those that finished."""
        finished: list[S] = []
        produced = 0
        running = SeqState.RUNNING
        stats = self.stats
        for seq in step.prefills:
            if seq.state is running and seq.generated == 0:
                stats.prompt_tokens += seq.prompt_tokens
                stats.prompt_tokens_local_cache_hit += seq.cache_hit_tokens
                stats.prompt_tokens_external += seq.external_hit_tokens
                stats.prompt_tokens_local_compute += (
                    seq.prompt_tokens - seq.cache_hit_tokens - seq.external_hit_tokens
                )
        for group in (step.decodes, step.prefills):
            for seq in group:
                if seq.state is running:
                    seq.generated += 1
                    produced += 1
                    if seq.generated >= seq.answer_tokens:
                        finished.append(seq)
        self.stats.generation_tokens += produced
        if finished:
            self._retire(finished)
        return finished

    def _retire(self, finished: list[S]) -> None:
        for seq in finished:
            if seq.adapter is not None:
                self._adapter_ended(seq.adapter)
            seq.prompt_block_ids = seq.block_ids[: seq.prompt_tokens // self.limits.block_size]
            self._free(seq)
            self.reserved_tokens -= seq.prompt_tokens + seq.max_tokens
            seq.state = SeqState.FINISHED
        self.running = [s for s in self.running if s.state is SeqState.RUNNING]
        self.stats.finished += len(finished)

    def _schedule_running(self, step: Step[S]) -> bool:
        """Give every running sequence a slot, preempting the newest when blocks run out."""
        preempted = False
        bs = self.limits.block_size
        running, decodes = self.running, step.decodes
        kv_tokens = 0
        i = 0
        while i < len(running):
            seq = running[i]
            context = seq.prompt_tokens + seq.generated
            held = len(seq.block_ids)
            if context > held * bs:  # crosses into a new block
                need = -(-context // bs) - held
                while need > self.pool.num_free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.state is not SeqState.RUNNING:
                    break
                seq.block_ids += self.pool.allocate(need)
            decodes.append(seq)
            kv_tokens += context
            i += 1
        step.kv_tokens += kv_tokens
        return preempted

    def _admit_waiting(self, step: Step[S]) -> None:
        limits, pool = self.limits, self.pool
        budget = limits.max_num_batched_tokens - len(step.decodes)
        waiting = self.waiting
        loras = self._scheduled_loras(step)
        skipped: list[S] = []
        while waiting and len(self.running) < limits.max_num_seqs:
            seq = waiting[0]
            adapter = seq.adapter
            # a slot for another adapter: skipped, and those behind it may still run
            if (
                adapter is not None
                and adapter.lora_id not in loras
                and len(loras) >= limits.max_loras
            ):
                skipped.append(waiting.popleft())
                continue
            tokens = seq.context_tokens
            hit = self._cached_prefix(seq, tokens)
            hit_tokens = len(hit) * limits.block_size
            first = seq.preemptions == 0
            external = max(0, seq.external_tokens - hit_tokens) if first else 0
            computed = tokens - hit_tokens - external
            if step.prefills and computed > budget:
                break
            need = self.blocks_for(tokens) - len(hit)
            if need + pool.free_among(hit) > pool.num_free:
                break
            waiting.popleft()
            pool.touch(hit)
            seq.block_ids = hit + pool.allocate(need)
            # blocks are named when scheduled, as in vLLM: a prompt admitted later in this
            # same step already hits them
            full, bs, done = len(seq.block_hashes), limits.block_size, len(hit)
            pool.cache(
                seq.block_ids[done:full],
                seq.block_hashes[done:],
                parent=seq.block_hashes[done - 1] if done else None,
                token_ids=(seq.prompt_token_ids or ())[done * bs : full * bs],
                block_size=bs,
                adapter=adapter,
            )
            if first:
                self._count_first_admission(seq, hit_tokens=hit_tokens, external=external)
            if adapter is not None:
                loras.add(adapter.lora_id)
                if seq.preemptions == 0:
                    self._adapter_begun(adapter)
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            step.prefills.append(seq)
            step.prefill_tokens += computed
            step.kv_tokens += tokens
            budget -= computed
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _count_first_admission(self, seq: S, *, hit_tokens: int, external: int) -> None:
        seq.cache_hit_tokens = hit_tokens
        seq.external_hit_tokens = external
        stats = self.stats
        if self.limits.prefix_caching:
            stats.prefix_cache_queries += seq.prompt_tokens
            stats.prefix_cache_hits += hit_tokens
        if self.limits.kv_connector:
            stats.external_prefix_cache_queries += seq.prompt_tokens
            stats.external_prefix_cache_hits += external

    def _scheduled_loras(self, step: Step[S]) -> set[int]:
        """The adapters of the running sequences this step runs."""
        if not self.limits.max_loras:
            return set()
        return {seq.adapter.lora_id for seq in step.decodes if seq.adapter is not None}

    def _adapter_begun(self, adapter: Adapter) -> None:
        active = self.active_adapters
        active[adapter.name] = active.get(adapter.name, 0) + 1

    def _adapter_ended(self, adapter: Adapter) -> None:
        active = self.active_adapters
        left = active.get(adapter.name, 0) - 1
        if left > 0:
            active[adapter.name] = left
        else:
            active.pop(adapter.name, None)

    def _cached_prefix(self, seq: S, tokens: int) -> list[int]:
        """The cached blocks that begin the sequence, short of its last token: a whole-prompt
        hit would leave nothing to compute the first sample's logits from."""
        if not seq.block_hashes:
            return []
        most = (tokens - 1) // self.limits.block_size
        return self.pool.cached_prefix(seq.block_hashes[:most])

    def _preempt(self, seq: S) -> None:
        self._free(seq)
        seq.state = SeqState.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self.waiting))

    def _free(self, seq: S) -> None:
        self.pool.release(seq.block_ids)
        seq.block_ids = []
