"""What a config needs of the environment it runs in: the secrets it names by variable,
set and distinct, and a Redis URL that redis-py can use. Checked when the gateway starts."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.config.problems import Problem
from gateway.config.settings import Settings
from gateway.config.tenants import hash_key


def check_environment(settings: Settings, *, environ: Mapping[str, str]) -> list[Problem]:
    """The secrets the config names by environment variable, unset or empty in `environ`,
    and tenant keys that two variables share."""
    problems: list[Problem] = []
    holders: dict[str, int] = {
        t.key_sha256: i for i, t in enumerate(settings.tenants) if t.key_sha256
    }
    for i, tenant in enumerate(settings.tenants):
        if tenant.key_env is None:
            continue
        loc = ("tenants", i, "key_env")
        problem = _secret(loc, tenant.key_env, environ)
        if problem is not None:
            problems.append(problem)
            continue
        digest = hash_key(environ[tenant.key_env])
        if digest in holders:
            message = f"${tenant.key_env} holds the key of tenants[{holders[digest]}] too"
            problems.append(Problem(loc=loc, message=message))
        holders.setdefault(digest, i)
    for i, provider in enumerate(settings.providers):
        if provider.api_key_env is not None:
            problem = _secret(("providers", i, "api_key_env"), provider.api_key_env, environ)
            problems += [problem] if problem is not None else []
    return problems


def _secret(loc: tuple[str | int, ...], name: str, environ: Mapping[str, str]) -> Problem | None:
    value = environ.get(name)
    if value is None:
        return Problem(loc=loc, message=f"${name} is not set")
    if not value.strip():
        return Problem(loc=loc, message=f"${name} is empty")
    return None


def redis_url_problem(url: str) -> str | None:
    """Why redis-py could not use `url`, without repeating it (it may hold a password)."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises
    except ValueError:
        return "is not a valid URL (its port should be a number)"
    if parts.scheme not in ("redis", "rediss", "unix"):
        return "is not a Redis URL: it should start with redis://, rediss:// or unix://"
    return None
