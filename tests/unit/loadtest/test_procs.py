"""Loopback ports for the processes the tests, the demo and the benchmarks start."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from loadtest.procs import CLAIM_S, claim_port, free_port


def test_a_port_handed_out_is_not_handed_out_again_while_its_claim_holds(tmp_path: Path) -> None:
    assert claim_port(40_123, claims=tmp_path)
    assert not claim_port(40_123, claims=tmp_path)  # another process asking meanwhile
    assert claim_port(40_124, claims=tmp_path)


def test_a_stale_claim_is_removed_and_the_port_claimed_afresh_next_time(tmp_path: Path) -> None:
    assert claim_port(40_123, claims=tmp_path)
    stale = time.time() - CLAIM_S - 1
    os.utime(tmp_path / "40123", (stale, stale))
    assert not claim_port(40_123, claims=tmp_path)
    assert not (tmp_path / "40123").exists()
    assert claim_port(40_123, claims=tmp_path)


def test_free_ports_are_claimed_distinct_and_bindable(tmp_path: Path) -> None:
    ports = [free_port(claims=tmp_path) for _ in range(20)]
    assert len(set(ports)) == 20
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == sorted(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
