"""Cost of one replica's decode steps and prefills: the model the planner and simulator share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.capacity import kv


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Memory-bandwidth decode and compute-bound prefill, per tensor-parallel rank.

    A decode step reads every weight once plus the KV of every token in the batch.
    """

    weights_bytes_per_rank: float
    kv_bytes_per_token_per_rank: float
    bandwidth_bytes_per_s: float  # effective: peak x efficiency
    prefill_flops_per_token: float  # 2 x parameters ÷ tp
    flops_per_s: float  # effective: peak x efficiency

    def decode_step_s(self, batch_kv_tokens: int) -> float:
        read = self.weights_bytes_per_rank + batch_kv_tokens * self.kv_bytes_per_token_per_rank
        return read / self.bandwidth_bytes_per_s

    def prefill_s(self, prompt_tokens: int) -> float:
        return prompt_tokens * self.prefill_flops_per_token / self.flops_per_s


@dataclass(frozen=True, kw_only=True)
class ReplicaProfile:
    """What one vLLM replica of a model on a GPU holds and how fast it steps."""

    model: str
    gpu: str
    tp: int
    block_size: int
    num_gpu_blocks: int
    step_cost: StepCost
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # vLLM's cap on sequences running at once
    warnings: tuple[str, ...] = ()

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def blocks_per_session(self, tokens: int) -> int:
        """Blocks one session of `tokens` (prompt + output) holds at its longest."""
        return max(1, math.ceil(tokens / self.block_size))

    def sessions_at_kv_bound(
        self, tokens: int, *, shared_prompt_tokens: int = 0, shared_share: float = 1.0
    ) -> int:
        """Sessions of `tokens` each that fit in the KV cache at once, every block reserved;
        a share of them carrying a prompt of `shared_prompt_tokens` that vLLM holds once."""
        return kv.sessions_at_kv_bound(
            num_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            tokens=tokens,
            shared_prompt_tokens=shared_prompt_tokens,
            shared_share=shared_share,
        )
