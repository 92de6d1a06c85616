"""The whole configuration, one YAML file, and how it is loaded: validated with every
problem of the file reported at once, each on its line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from gateway.config.base import _Model
from gateway.config.pools import PoolSettings
from gateway.config.problems import (
    ConfigDocument,
    Problem,
    Problems,
    describe,
    yaml_syntax,
)
from gateway.config.providers import ProviderSettings
from gateway.config.references import reference_problems
from gateway.config.routing import RoutingProfileSettings
from gateway.config.server import BatchSettings, ServerSettings, TracingSettings
from gateway.config.shared import LedgerSettings, RateLimitSettings, RedisSettings
from gateway.config.tenants import TenantSettings


class Settings(_Model):
    """A gateway's whole configuration, one YAML file."""

    server: ServerSettings = ServerSettings()
    redis: RedisSettings = RedisSettings()
    ratelimit: RateLimitSettings = RateLimitSettings()
    ledger: LedgerSettings = LedgerSettings()
    tenants: list[TenantSettings] = Field(min_length=1)
    pools: list[PoolSettings] = Field(min_length=1)
    providers: list[ProviderSettings] = Field(default_factory=list)
    routing_profiles: list[RoutingProfileSettings] = Field(
        default_factory=list,
        description=(
            "Ways of choosing a backend beyond the built-in `prefix` and `least_filled`, for "
            "pools to name in `routing` ([how](routing-plugins.md))"
        ),
    )
    tracing: TracingSettings = TracingSettings()
    batch: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _references(self) -> Settings:
        problems = reference_problems(self.model_dump())
        if problems:
            raise Problems(problems)
        return self


class ConfigError(Exception):
    """Every problem of one config file, one line each (file, line, key path, problem)."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    settings: Settings
    document: ConfigDocument  # tells a later problem (the environment's) on its line


def validate(data: Any) -> tuple[Settings | None, list[Problem]]:
    """The settings, or every problem of `data` at once: the references between its parts
    are checked even where some part is malformed."""
    if data is None:
        return None, [Problem(loc=(), message="the file is empty: it needs tenants and pools")]
    try:
        return Settings.model_validate(data), []
    except ValidationError as exc:
        problems = describe(exc.errors(), root=Settings)
        if not any(isinstance(e.get("ctx", {}).get("error"), Problems) for e in exc.errors()):
            problems += reference_problems(data)  # the model's own check never ran
        return None, problems


def parse_settings(data: Any, *, source: str = "<config>") -> Settings:
    return _settings(data, ConfigDocument(name=source))


def _settings(data: Any, document: ConfigDocument, *, also: Sequence[Problem] = ()) -> Settings:
    settings, problems = validate(data)
    if settings is None or also:
        raise ConfigError(document.name, document.lines([*also, *problems]))
    return settings


def load_config(path: str | Path) -> LoadedConfig:
    """The file's settings, or a ConfigError with every problem of the file."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(name, [f"{name}: cannot be read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(name, [f"{name}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        document = ConfigDocument.parse(name, text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(name, [yaml_syntax(name, exc)]) from None
    settings = _settings(data, document, also=document.repeated_keys())
    return LoadedConfig(settings=settings, document=document)


def load_settings(path: str | Path) -> Settings:
    return load_config(path).settings
