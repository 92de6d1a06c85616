"""Typed gateway configuration, validated at load time with every error reported at once.

Secrets never live in the file: tenant keys are stored as SHA-256 hashes (or read from an
environment variable and hashed at load), and provider keys, the admin token and the Redis
URL are named by the environment variable that holds them.

The models live by area: `base` (what they all share), `pools` and `queue`, `providers`,
`tenants`, `shared` (what the replicas share through Redis), `server` (the listener,
tracing, the batch tier) and `settings` (the whole file, and loading it). Beside them,
`problems` tells a file's problems on their lines, `references` checks the names that
point at each other, `environment` checks the secrets a config names, and `docs` writes
docs/configuration.md from the models. Everything the rest of the gateway uses is
imported from here.
"""

from gateway.config.base import PRIORITIES, PolicyName, PoolKind, Priority, Timeouts
from gateway.config.pools import (
    AdapterSettings,
    BackendSettings,
    CacheSettings,
    KvEventsSettings,
    PoolSettings,
    ReservationSettings,
)
from gateway.config.providers import ProviderSettings
from gateway.config.queue import FairnessSettings, QueueSettings
from gateway.config.server import BatchSettings, ServerSettings, TracingSettings
from gateway.config.settings import (
    ConfigError,
    LoadedConfig,
    Settings,
    load_config,
    load_settings,
    parse_settings,
    validate,
)
from gateway.config.shared import LedgerSettings, RateLimitSettings, RedisSettings
from gateway.config.tenants import TenantSettings, hash_key

__all__ = [
    "PRIORITIES",
    "AdapterSettings",
    "BackendSettings",
    "BatchSettings",
    "CacheSettings",
    "ConfigError",
    "FairnessSettings",
    "KvEventsSettings",
    "LedgerSettings",
    "LoadedConfig",
    "PolicyName",
    "PoolKind",
    "PoolSettings",
    "Priority",
    "ProviderSettings",
    "QueueSettings",
    "RateLimitSettings",
    "RedisSettings",
    "ReservationSettings",
    "ServerSettings",
    "Settings",
    "TenantSettings",
    "Timeouts",
    "TracingSettings",
    "hash_key",
    "load_config",
    "load_settings",
    "parse_settings",
    "validate",
]
