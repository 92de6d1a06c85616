"""API key → tenant. Keys are held only as SHA-256 hashes and compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import Priority, Settings, TenantSettings
from gateway.errors import Forbidden, Unauthenticated
from gateway.ratelimit import TenantLimits


@dataclass(frozen=True, kw_only=True)
class Tenant:
    name: str
    key_hash: bytes
    priority: Priority
    pools: frozenset[str]  # empty: every pool
    limits: TenantLimits
    ttft_budget_s: float | None
    tpot_budget_s: float | None = None
    batchable: bool = False  # its requests may wait, as batches, when their pool overflows

    def may_use(self, pool: str) -> bool:
        return not self.pools or pool in self.pools


def _tenant(t: TenantSettings, environ: Mapping[str, str]) -> Tenant:
    return Tenant(
        name=t.name,
        key_hash=bytes.fromhex(t.key_hash(dict(environ))),
        priority=t.priority,
        pools=frozenset(t.pools),
        limits=TenantLimits(
            tenant=t.name,
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            request_burst=t.request_burst,
            token_burst=t.token_burst,
        ),
        ttft_budget_s=None if t.ttft_budget_ms is None else t.ttft_budget_ms / 1000,
        tpot_budget_s=None if t.tpot_budget_ms is None else t.tpot_budget_ms / 1000,
        batchable=t.batchable,
    )


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if not token or scheme.lower() != "bearer":
        return None
    return token


class Authenticator:
    def __init__(self, settings: Settings, environ: Mapping[str, str]) -> None:
        tenants = [_tenant(t, environ) for t in settings.tenants]
        self._by_hash = {t.key_hash: t for t in tenants}
        self.by_name = {t.name: t for t in tenants}

    def tenant(self, authorization: str | None) -> Tenant:
        token = bearer_token(authorization)
        if token is None:
            raise Unauthenticated(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        digest = hashlib.sha256(token.encode()).digest()
        tenant = self._by_hash.get(digest)
        if tenant is None or not hmac.compare_digest(tenant.key_hash, digest):
            raise Unauthenticated("Incorrect API key provided.")
        return tenant


class AdminAuth:
    """The admin token comes from the environment; tenant keys never open admin endpoints."""

    def __init__(self, token: str | None, tenants: Authenticator) -> None:
        self._digest = None if not token else hashlib.sha256(token.encode()).digest()
        self._tenants = tenants

    def check(self, authorization: str | None) -> None:
        token = bearer_token(authorization)
        if token is None:
            raise Unauthenticated("This endpoint needs the admin token as a Bearer token.")
        digest = hashlib.sha256(token.encode()).digest()
        if self._digest is not None and hmac.compare_digest(self._digest, digest):
            return
        try:
            self._tenants.tenant(authorization)
        except Unauthenticated:
            raise Unauthenticated("Incorrect admin token.") from None
        raise Forbidden("Tenant API keys cannot use admin endpoints.")
