"""Capacity math: KV-cache sessions, tokens per second, and GPUs for a workload."""

from gateway.capacity.catalog import (
    CapacityError,
    Catalog,
    GpuSpec,
    MlaSpec,
    ModelSpec,
    load_catalog,
)
from gateway.capacity.perf import ReplicaProfile, StepCost
from gateway.capacity.profile import ReplicaOptions, build_profile, replica_profile

__all__ = [
    "CapacityError",
    "Catalog",
    "GpuSpec",
    "MlaSpec",
    "ModelSpec",
    "ReplicaOptions",
    "ReplicaProfile",
    "StepCost",
    "build_profile",
    "load_catalog",
    "replica_profile",
]
