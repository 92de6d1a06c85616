"""A private three-master Redis Cluster on loopback, for the tests that need one."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtest.procs import redis_server_binary, wait_for_port


def _free_pair() -> int:
    """A port whose cluster bus port (+10000) is free too, so both stay under 65536."""
    while True:
        port = random.randint(20000, 40000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[list[int]]:
    """`masters` redis-server nodes joined by `redis-cli --cluster create`; their ports."""
    root = Path(tempfile.mkdtemp(prefix="spillgate-cluster-"))
    ports: list[int] = []
    while len(ports) < masters:
        port = _free_pair()
        if port not in ports:
            ports.append(port)
    procs = []
    try:
        for port in ports:
            folder = root / str(port)
            folder.mkdir()
            args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--save", "", "--appendonly", "no", "--dir", str(folder)]  # fmt: skip
            procs.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in ports:
            wait_for_port(port)
        nodes = [f"127.0.0.1:{port}" for port in ports]
        create = ["redis-cli", "--cluster", "create", *nodes]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        _wait_until_ok(ports[0])
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def _wait_until_ok(port: int) -> None:
    for _ in range(100):
        info = subprocess.run(
            ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
        ).stdout
        if "cluster_state:ok" in info:
            return
        subprocess.run(["sleep", "0.1"], check=True)
    raise TimeoutError("the cluster never reached cluster_state:ok")
