"""API key → tenant. Keys are held only as SHA-256 hashes and compared in constant time.

A refused key is counted and told in the log, so a client with a stale or mistyped key is
seen by the operator and not only by the client; neither ever holds the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.clock import Clock
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


log = logging.getLogger("spillgate.auth")

# at most one log line about refused keys in this many seconds, per process: a client
# retrying a wrong key in a loop must not flood the log
REFUSALS_LOG_EVERY_S = 10.0


def shown_key(token: str) -> str:
    """A key as OpenAI's errors show it: its first characters, the rest as asterisks (at
    most a third shown, so a short key is not given away)."""
    shown = min(8, len(token) // 3)
    return token[:shown] + "*" * (len(token) - shown)


class KeyRefusals:
    """Refused API keys: counted by reason (`missing` or `incorrect`, never the key) and
    told in the log at most once every `every_s`, with the key as OpenAI shows it and how
    many were refused since the line before."""

    def __init__(
        self, counter: Counter, *, clock: Clock, every_s: float = REFUSALS_LOG_EVERY_S
    ) -> None:
        self._counter = counter
        self._clock = clock
        self._every_s = every_s
        self._quiet_until = float("-inf")
        self._untold = 0  # refused while the log was quiet

    def refused(self, token: str | None) -> None:
        self._counter.labels(reason="missing" if token is None else "incorrect").inc()
        now = self._clock.monotonic()
        if now < self._quiet_until:
            self._untold += 1
            return
        what = "no API key" if token is None else f"incorrect API key {shown_key(token)}"
        since = f" ({self._untold} more refused since the last line)" if self._untold else ""
        log.warning("refused a request: %s%s", what, since)
        self._untold, self._quiet_until = 0, now + self._every_s


class Authenticator:
    def __init__(
        self,
        settings: Settings,
        environ: Mapping[str, str],
        *,
        refusals: KeyRefusals | None = None,
    ) -> None:
        tenants = [_tenant(t, environ) for t in settings.tenants]
        self._by_hash = {t.key_hash: t for t in tenants}
        self.by_name = {t.name: t for t in tenants}
        self._refusals = refusals

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant whose key the request carries; a key refused is counted and logged."""
        token = bearer_token(authorization)
        tenant = None if token is None else self.holder(token)
        if tenant is not None:
            return tenant
        if self._refusals is not None:
            self._refusals.refused(token)
        if token is None:
            raise Unauthenticated(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        raise Unauthenticated("Incorrect API key provided.")

    def holder(self, token: str) -> Tenant | None:
        """The tenant whose key `token` is, if any (nothing counted)."""
        digest = hashlib.sha256(token.encode()).digest()
        tenant = self._by_hash.get(digest)
        if tenant is None or not hmac.compare_digest(tenant.key_hash, digest):
            return None
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
        if self._tenants.holder(token) is None:
            raise Unauthenticated("Incorrect admin token.")
        raise Forbidden("Tenant API keys cannot use admin endpoints.")
