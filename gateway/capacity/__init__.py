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
from gateway.capacity.plan import Demand, Plan, make_plan, plan_json
from gateway.capacity.profile import ReplicaOptions, build_profile, replica_profile
from gateway.capacity.throughput import LoadPoint, Workload, knee, predict

__all__ = [
    "CapacityError",
    "Catalog",
    "Demand",
    "GpuSpec",
    "LoadPoint",
    "MlaSpec",
    "ModelSpec",
    "Plan",
    "ReplicaOptions",
    "ReplicaProfile",
    "StepCost",
    "Workload",
    "build_profile",
    "knee",
    "load_catalog",
    "make_plan",
    "plan_json",
    "predict",
    "replica_profile",
]
