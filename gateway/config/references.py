"""The config's names that must be unique and the names that must point at something.

Read from the plain data (a YAML document's, or a validated Settings' model_dump), and
tolerant of parts that are malformed, so that these problems are reported beside every
other problem of a file rather than only once the rest is right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gateway.config.problems import Problem, did_you_mean, key_path
from gateway.config.routing import BUILTIN_PROFILES

Entry = tuple[int, dict[str, Any]]


def reference_problems(data: Any) -> list[Problem]:
    doc = data if isinstance(data, dict) else {}
    pools, providers, tenants = (_entries(doc, key) for key in ("pools", "providers", "tenants"))
    profiles = _entries(doc, "routing_profiles")
    pool_names, provider_names = _names(pools), _names(providers)
    problems = [
        *_repeated_names("pools", pools),
        *_repeated_names("providers", providers),
        *_repeated_names("tenants", tenants),
        *_repeated_backend_names(pools),
        *_repeated_tenant_keys(tenants),
        *_adapter_names(pools),
        *_repeated_names("routing_profiles", profiles),
        *_routing_references(pools, profiles),
    ]
    tenant_names = _names(tenants)
    for i, pool in pools:
        for j, adapter in _entries(pool, "adapters"):
            for k, name in _strings(adapter.get("tenants")):
                if name not in tenant_names:
                    loc = ("pools", i, "adapters", j, "tenants", k)
                    problems.append(_missing(loc, "tenant", name, tenant_names))
    problems += _degraded_adapters(pools)
    kinds = {pool.get("name"): pool.get("kind", "chat") for _, pool in pools}
    for i, pool in pools:
        problems += _pool_references(i, pool, pools=pool_names, providers=provider_names)
        problems += _kind_problems(i, pool, kinds)
        problems += _role_problems(i, pool)
    for i, tenant in tenants:
        for j, name in _strings(tenant.get("pools")):
            if name not in pool_names:
                problems.append(_missing(("tenants", i, "pools", j), "pool", name, pool_names))
    adapter_names = [name for _, pool in pools for name in _names(_entries(pool, "adapters"))]
    for i, provider in providers:
        models = provider.get("models")
        for name in models if isinstance(models, dict) else {}:
            if name not in pool_names and name not in adapter_names:
                known = pool_names + adapter_names
                problems.append(
                    _missing(("providers", i, "models", name), "pool or adapter", name, known)
                )
    return problems


def _routing_references(pools: list[Entry], profiles: list[Entry]) -> Iterator[Problem]:
    """A pool's `routing` names a profile; a profile of the config does not take a
    built-in one's name."""
    names = list(BUILTIN_PROFILES) + _names(profiles)
    for i, profile in profiles:
        name = profile.get("name")
        if name in BUILTIN_PROFILES:
            message = f"{name!r} is a built-in routing profile: give this one another name"
            yield Problem(loc=("routing_profiles", i, "name"), message=message)
    for i, pool in pools:
        routing = pool.get("routing")
        if isinstance(routing, str) and routing not in names:
            yield _missing(("pools", i, "routing"), "routing profile", routing, names)


def backend_name(pool: str, index: int, name: Any) -> str:
    """The name a backend is known by in metrics and the shared ledger."""
    return name if isinstance(name, str) and name else f"{pool}-{index}"


def _pool_references(
    i: int, pool: dict[str, Any], *, pools: list[str], providers: list[str]
) -> list[Problem]:
    problems: list[Problem] = []
    degrade_to, provider = pool.get("degrade_to"), pool.get("provider")
    if isinstance(degrade_to, str) and degrade_to not in pools:
        problems.append(_missing(("pools", i, "degrade_to"), "pool", degrade_to, pools))
    elif isinstance(degrade_to, str) and degrade_to == pool.get("name"):
        problems.append(
            Problem(loc=("pools", i, "degrade_to"), message="a pool cannot degrade to itself")
        )
    if isinstance(provider, str) and provider not in providers:
        problems.append(_missing(("pools", i, "provider"), "provider", provider, providers))
    chain = list(_strings(pool.get("overflow")))
    needs = {"degrade": "degrade_to", "provider": "provider"}
    first: dict[str, int] = {}
    for j, policy in chain:
        loc = ("pools", i, "overflow", j)
        if policy in first:
            message = f"{policy!r} is in the chain already, at overflow[{first[policy]}]"
            problems.append(Problem(loc=loc, message=message))
        elif policy in needs and pool.get(needs[policy]) is None:
            needed = key_path(("pools", i, needs[policy]))
            problems.append(Problem(loc=loc, message=f"{policy!r} needs {needed}"))
        first.setdefault(policy, j)
    rejects = [j for j, policy in chain if policy == "reject"]
    if rejects and rejects[0] != chain[-1][0]:
        message = "'reject' refuses every request: the policies after it would never run"
        problems.append(Problem(loc=("pools", i, "overflow", rejects[0]), message=message))
    return problems


# policies that cannot serve an embedding: no smaller model answers with the same vectors,
# and the cache keeps generated text
NOT_FOR_EMBEDDINGS = {
    "degrade": "another model's vectors do not match this model's",
    "cache": "the response cache keeps generated text, not vectors",
    "batch": "embeddings that may wait go to /v1/batches; the 202 answer is for chat pools",
}


def _kind_problems(i: int, pool: dict[str, Any], kinds: dict[Any, Any]) -> list[Problem]:
    """An embedding pool's chain holds only what can serve an embedding; a pool degrades
    only to a pool of its own kind."""
    kind = pool.get("kind", "chat")
    problems: list[Problem] = []
    degrade_to = pool.get("degrade_to")
    if isinstance(degrade_to, str) and degrade_to in kinds and kinds[degrade_to] != kind:
        message = (
            f"{degrade_to!r} is a pool of kind {kinds[degrade_to]!r}, this one of kind "
            f"{kind!r}: a pool degrades only to a pool of its kind"
        )
        problems.append(Problem(loc=("pools", i, "degrade_to"), message=message))
    if kind != "embedding":
        return problems
    for j, policy in _strings(pool.get("overflow")):
        if policy in NOT_FOR_EMBEDDINGS:
            message = f"{policy!r} cannot serve an embedding pool: {NOT_FOR_EMBEDDINGS[policy]}"
            problems.append(Problem(loc=("pools", i, "overflow", j), message=message))
    return problems


def _repeated_names(section: str, entries: list[Entry]) -> Iterator[Problem]:
    return _repeated(
        section,
        entries,
        "name",
        lambda name, at: f"{name!r} is the name of {section}[{at}] already",
    )


def _repeated(
    section: str, entries: list[Entry], key: str, says: Callable[[str, int], str]
) -> Iterator[Problem]:
    """A problem for each entry whose `key` an earlier entry of `section` holds already:
    `says(value, where the first one is)`."""
    first: dict[str, int] = {}
    for i, entry in entries:
        value = entry.get(key)
        if not isinstance(value, str):
            continue
        if value in first:
            yield Problem(loc=(section, i, key), message=says(value, first[value]))
        first.setdefault(value, i)


def _adapter_names(pools: list[Entry]) -> Iterator[Problem]:
    """An adapter is asked for by its name as a pool is: each name names one thing."""
    first = {name: f"pools[{i}]" for i, pool in pools if isinstance(name := pool.get("name"), str)}
    for i, pool in pools:
        for j, adapter in _entries(pool, "adapters"):
            name = adapter.get("name")
            if not isinstance(name, str):
                continue
            if name in first:
                message = f"{name!r} is the name of {first[name]} already"
                yield Problem(loc=("pools", i, "adapters", j, "name"), message=message)
            first.setdefault(name, f"pools[{i}].adapters[{j}]")


def _degraded_adapters(pools: list[Entry]) -> Iterator[Problem]:
    """An adapter's `degrade_to` names an adapter of the pool its pool degrades to."""
    adapters = {
        name: _names(_entries(pool, "adapters"))
        for _, pool in pools
        if isinstance(name := pool.get("name"), str)
    }
    for i, pool in pools:
        target = pool.get("degrade_to")
        for j, adapter in _entries(pool, "adapters"):
            name = adapter.get("degrade_to")
            if not isinstance(name, str):
                continue
            loc = ("pools", i, "adapters", j, "degrade_to")
            if not isinstance(target, str):
                needed = key_path(("pools", i, "degrade_to"))
                yield Problem(loc=loc, message=f"an adapter degrades only where {needed} is set")
            elif target in adapters and name not in adapters[target]:
                known = adapters[target]
                hint = did_you_mean(name, known) if known else ": it declares no adapters"
                yield Problem(loc=loc, message=f"pool {target!r} has no adapter {name!r}{hint}")


def _repeated_backend_names(pools: list[Entry]) -> Iterator[Problem]:
    first: dict[str, str] = {}
    for i, pool in pools:
        pool_name = pool.get("name")
        backends = pool.get("backends")
        if not isinstance(pool_name, str) or not isinstance(backends, list):
            continue
        for j, backend in enumerate(backends):
            if not isinstance(backend, dict):
                continue
            name = backend_name(pool_name, j, backend.get("name"))
            loc: tuple[str | int, ...] = ("pools", i, "backends", j)
            if name in first:
                written = isinstance(backend.get("name"), str)
                message = (
                    f"backend name {name!r} is taken by {first[name]} already: metrics and "
                    "the shared ledger tell backends apart by name"
                )
                yield Problem(loc=(*loc, "name") if written else loc, message=message)
            first.setdefault(name, key_path(loc))


def _repeated_tenant_keys(tenants: list[Entry]) -> Iterator[Problem]:
    return _repeated(
        "tenants",
        tenants,
        "key_sha256",
        lambda _, at: f"the key of tenants[{at}] too: a key names one tenant",
    )


def _missing(loc: tuple[str | int, ...], kind: str, name: str, known: list[str]) -> Problem:
    if not known:
        return Problem(loc=loc, message=f"no {kind} named {name!r}: the file has no {kind}s")
    return Problem(loc=loc, message=f"no {kind} named {name!r}{did_you_mean(name, known)}")


def _entries(doc: dict[str, Any], key: str) -> list[Entry]:
    items = doc.get(key)
    if not isinstance(items, list):
        return []
    return [(i, item) for i, item in enumerate(items) if isinstance(item, dict)]


def _names(entries: list[Entry]) -> list[str]:
    return [entry["name"] for _, entry in entries if isinstance(entry.get("name"), str)]


def _strings(items: Any) -> Iterator[tuple[int, str]]:
    if isinstance(items, list):
        yield from ((i, item) for i, item in enumerate(items) if isinstance(item, str))


def _role_problems(i: int, pool: dict[str, Any]) -> Iterator[Problem]:
    """A pool whose backends all prefill has none to serve its requests, and an embedding
    pool has no answers to decode."""
    roles = [b.get("role", "both") for _, b in _entries(pool, "backends")]
    if "prefill" not in roles:
        return
    if all(role == "prefill" for role in roles):
        message = "every backend has `role: prefill`: at least one must serve requests"
        yield Problem(loc=("pools", i, "backends"), message=message)
    if pool.get("kind", "chat") == "embedding":
        message = "an embedding pool has nothing to decode: no backend may have `role: prefill`"
        yield Problem(loc=("pools", i, "backends"), message=message)
