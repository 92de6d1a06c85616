"""A private Redis Cluster on loopback, for the tests that need one (loadtest/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from loadtest.cluster import ClusterProcesses


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[int]]:
    """`masters` redis-server nodes joined by `redis-cli --cluster create`; their ports."""
    with ClusterProcesses(masters=masters) as cluster:
        yield cluster.ports
