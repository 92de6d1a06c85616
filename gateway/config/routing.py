"""Routing profiles: the scorers that weigh a pool's backends for each request, with their
weights, and the picker that orders them (gateway/admission/routing/plugins.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.base import _Model

# the scorers and pickers gateway/admission/routing/profile.py registers, by name
ScorerName = Literal["fill", "prefix", "adapter", "waiting"]
PickerName = Literal["best"]


class ScorerSettings(_Model):
    """One scorer of a profile and how much its say weighs."""

    plugin: ScorerName = Field(
        description=(
            "`fill`: the least filled once it holds the request; `prefix`: the likeliest to "
            "hold the prompt's leading blocks or its session, within the herding guard; "
            "`adapter`: where a LoRA adapter is active, then where a slot is free; `waiting`: "
            "the fewest requests waiting inside the engine"
        )
    )
    weight: float = Field(1.0, gt=0, description="what its scores (0 to 1) count for in the sum")


class RoutingProfileSettings(_Model):
    """A named way of choosing a backend, for pools to name in `routing`."""

    name: str = Field(min_length=1, description="what a pool's `routing` calls it")
    scorers: list[ScorerSettings] = Field(
        min_length=1,
        description=(
            "each scorer scores every backend that may take the request from 0 to 1; the "
            "backends are tried by the weighted sum, highest first, ties least filled first"
        ),
    )
    picker: PickerName = Field(
        "best", description="how the sums order the backends: `best`, the highest first"
    )


def _scorers(*pairs: tuple[ScorerName, float]) -> list[ScorerSettings]:
    return [ScorerSettings(plugin=plugin, weight=weight) for plugin, weight in pairs]


# What `routing: prefix` and `routing: least_filled` mean. The weights are an order: each
# scorer only settles what the ones above it leave equal (a fill stays below 10).
BUILTIN_PROFILES = {
    "prefix": RoutingProfileSettings(
        name="prefix", scorers=_scorers(("adapter", 100), ("prefix", 10), ("fill", 1))
    ),
    "least_filled": RoutingProfileSettings(
        name="least_filled", scorers=_scorers(("adapter", 100), ("fill", 1))
    ),
}


def profile_named(
    name: str, profiles: list[RoutingProfileSettings] | tuple[()] = ()
) -> RoutingProfileSettings:
    """The profile a pool's `routing` names: one of `profiles`, else a built-in one."""
    for profile in profiles:
        if profile.name == name:
            return profile
    return BUILTIN_PROFILES[name]
