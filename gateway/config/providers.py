"""An external OpenAI-compatible provider a pool may spill to."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import Timeouts, _http_url, _Model


class ProviderSettings(_Model):
    """An external OpenAI-compatible provider; its key comes from the environment."""

    name: str = Field(min_length=1, description="the name a pool's `provider` key names")
    base_url: str = Field(
        description=(
            "the provider's OpenAI-compatible API, up to and including `/v1` (unlike a "
            "backend's `url`): `https://api.openai.com/v1`"
        )
    )
    api_key_env: str | None = Field(None, description="env variable holding the provider's key")

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        return _http_url(url)

    models: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "pool name → the provider's model name; a pool's LoRA adapter may be named too "
            "(its requests spill here only where it is)"
        ),
    )
    tokens_per_minute: int = Field(
        100_000,
        gt=0,
        description=(
            "the provider's own token budget; with Redis one for the whole fleet (while Redis "
            "is away each process takes its share)"
        ),
    )
    max_concurrency: int = Field(
        16,
        gt=0,
        description=(
            "the provider's concurrency cap; with Redis one for the whole fleet, as leases, "
            "freed within `ledger.lease_ttl_s` when a replica dies (while Redis is away each "
            "process takes its share)"
        ),
    )
    prompt_price_per_m: float = Field(
        0.0,
        ge=0,
        description=(
            "dollars per million prompt tokens, for `spillgate_provider_cost_dollars_total`"
        ),
    )
    completion_price_per_m: float = Field(
        0.0,
        ge=0,
        description=(
            "dollars per million completion tokens, for `spillgate_provider_cost_dollars_total`"
        ),
    )
    timeouts: Timeouts = Field(
        Timeouts(first_token=20.0, total=120.0),
        description="the provider's time budgets in seconds",
    )
    breaker_failures: int = Field(
        3,
        gt=0,
        description=(
            "consecutive failures (any error status but a refusal of one request, 400, 413 or "
            "422; timeouts; answers that are not one) that open the breaker"
        ),
    )
    breaker_cooldown_s: float = Field(
        10.0,
        gt=0,
        description="how long the breaker stays open (a provider's `Retry-After` wins)",
    )
