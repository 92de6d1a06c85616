"""Where a request is forwarded: a value the router makes for each backend and a provider's
gate makes for its provider, kept apart from the forwarder so that both can name it without
importing how forwarding is done."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config import Timeouts


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """Where a request goes: a backend of a pool or an external provider."""

    name: str  # metrics label
    api_base: str  # up to and including /v1
    model: str  # the model name the upstream serves
    timeouts: Timeouts
    headers: Mapping[str, str] = field(default_factory=dict)  # the upstream's own credentials
    # an external provider: any answer but a readable success is its failure, never relayed
    # (its errors name its models and account); the caller passes the request on
    external: bool = False
