"""The request as every part of the gateway sees it: the endpoint it came to, the immutable
`InferenceRequest` its body is parsed into (gateway/front/parse.py), and the per-pool
estimate of characters per token. The core of the house: it imports nothing of the gateway
but the config, so every room can import it."""

from __future__ import annotations

from collections.abc import Hashable
from enum import StrEnum
from typing import Any, NamedTuple

from gateway.config import Priority

# the headers that shape a request (gateway/front/request.py reads them)
BATCHABLE_HEADER = "x-spillgate-batchable"  # "true": the request may wait, as a batch
PRIORITY_HEADER = "x-spillgate-priority"
SESSION_HEADER = "x-spillgate-session"  # a conversation's turns go where its prefix is cached
# the request's service-level objectives, in milliseconds: time to its first token, and per
# output token after it; each overrides its tenant's default (ttft_budget_ms, tpot_budget_ms)
TTFT_HEADER = "x-spillgate-ttft-ms"
TPOT_HEADER = "x-spillgate-tpot-ms"


# the body field that tells a vLLM engine to keep a prompt's KV for another engine, or to load
# it from one (its KV connector's handshake; gateway/front/prefill.py)
KV_TRANSFER_FIELD = "kv_transfer_params"


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"


# the API each endpoint is, as vLLM names it when a model does not serve it
API_NAMES = {
    Endpoint.CHAT: "Chat Completions API",
    Endpoint.COMPLETIONS: "Completions API",
    Endpoint.EMBEDDINGS: "Embeddings API",
    Endpoint.RESPONSES: "Responses API",
}


class SharedBlocks(NamedTuple):
    """The leading prompt blocks one request may hold in common with other requests in
    flight on a backend whose blocks are `block_tokens` tokens: their keys (chained, so a
    key matches only where everything before it does; gateway/admission/ledger/holders.py)."""

    keys: tuple[Hashable, ...] = ()
    block_tokens: int = 0

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.block_tokens


NO_BLOCKS = SharedBlocks()


class InferenceRequest(NamedTuple):
    """One parsed request; immutable (a NamedTuple: one is made per request, and a frozen
    dataclass costs several times as much to build)."""

    endpoint: Endpoint
    tenant: str
    pool: str
    priority: Priority
    stream: bool
    client_wants_usage: bool
    prompt_chars: int
    prompt_tokens: int  # estimate, corrected over time from real usage
    max_output_tokens: int  # what the backend may generate per choice; reserved on admission
    body: dict[str, Any]
    n: int = 1  # choices asked for: vLLM runs one sequence per choice
    # the output one choice reserves on admission (admission/fleet/output_lengths.py); 0: all of
    # max_output_tokens
    output_reserve: int = 0
    # what a stream keeps reserved per choice beyond what it holds as it grows
    # (gateway/admission/ledger/growth.py)
    headroom: int = 0
    batchable: bool = False  # may wait: overflow may accept it into a batch (policies/batch.py)
    # the keys of its prompt's leading blocks and its session, where its pool routes by
    # prefix (gateway/admission/routing/prefix_index.py)
    prefix: tuple[bytes, ...] = ()
    session: str | None = None
    # the blocks it may share with requests in flight, one set per block size of its
    # pool's backends that cache prefixes, worked out once (gateway/admission/ledger/holders.py):
    # a backend holding them already does not reserve them again; none where its pool
    # caches no prefixes, for several choices, or where the prompt is not all in the
    # request (a Responses continuation) or not a prompt (embeddings)
    shared: tuple[SharedBlocks, ...] = ()
    # its prompt's token ids as the engine sees them, where its pool has backends that
    # publish KV events (gateway/admission/routing/kv_index.py)
    token_ids: tuple[int, ...] = ()
    # its objectives in seconds: time to first token from its arrival, and per output token
    # after it (None: none); the header's, else its tenant's default
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # backends of its pool it must not go to: a Responses continuation goes only to the one
    # that stores its previous response (gateway/front/response_homes.py)
    avoid: frozenset[str] = frozenset()
    # the LoRA adapter of its pool's model it asks for by name (gateway/config/pools.py,
    # `adapters`): it goes only to a backend that serves it, and is sent there by that name
    adapter: str | None = None
    # the model's context (prompt and output tokens of one sequence) where its pool knows
    # it: its `max_model_len` setting, else the longest its backends report; None where
    # unknown. What an answer's usage may say is bounded by it (gateway/upstream/usage.py)
    model_context: int | None = None

    @property
    def sequence_tokens(self) -> int:
        """What one choice's sequence reserves on admission: prompt + expected output."""
        return self.prompt_tokens + (self.output_reserve or self.max_output_tokens)

    @property
    def context_tokens(self) -> int:
        """The longest one choice's sequence may grow: prompt + max output."""
        return self.prompt_tokens + self.max_output_tokens

    @property
    def charge_tokens(self) -> int:
        """What the tenant's bucket is charged on admission, and refunded from usage: the
        tokens the request may use in all, the prompt once and each choice's output."""
        return self.prompt_tokens + self.n * self.max_output_tokens


class PromptEstimator:
    """Characters per token for one pool, corrected from the real `usage.prompt_tokens`."""

    def __init__(self, *, chars_per_token: float = 4.0, weight: float = 0.05) -> None:
        self.chars_per_token = chars_per_token
        self._weight = weight

    def observe(self, *, prompt_chars: int, prompt_tokens: int) -> None:
        if prompt_tokens <= 0 or prompt_chars <= 0:
            return
        seen = prompt_chars / prompt_tokens
        estimate = self.chars_per_token + self._weight * (seen - self.chars_per_token)
        self.chars_per_token = 1.0 if estimate < 1.0 else 16.0 if estimate > 16.0 else estimate
