"""A private Redis Cluster on loopback: masters, a replica each, and the verbs a failover
drill needs (kill a node, restart it, wait for its replica to take over). For the tests
and the failover benchmark; never the user's Redis."""

from __future__ import annotations

import itertools
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from loadtest.procs import redis_server_binary, wait_for_port

NODE_TIMEOUT_MS = 2000  # the cluster's cluster-node-timeout: how soon a master is failed over


def _free_pair(taken: list[int]) -> int:
    """A port whose cluster bus port (+10000) is free too, so both stay under 65536."""
    while True:
        port = random.randint(20000, 40000)
        if port in taken:
            continue
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


class ClusterProcesses:
    """`masters` redis-server masters with `replicas` replicas each, joined by
    `redis-cli --cluster create`; each node keeps its folder (its nodes.conf), so a node
    killed and restarted rejoins the cluster (as a replica, once its slots were failed
    over)."""

    def __init__(
        self, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = NODE_TIMEOUT_MS
    ) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="spillgate-cluster-"))
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(_free_pair(self.ports))
        self._masters, self._replicas = masters, replicas
        self._node_timeout_ms = node_timeout_ms
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """One node's URL, as a gateway is given it (redis: {cluster: true})."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self) -> ClusterProcesses:
        for port in self.ports:
            (self._root / str(port)).mkdir()
            self._run(port)
        for port in self.ports:
            wait_for_port(port)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        create = ["redis-cli", "--cluster", "create", *nodes]
        create += ["--cluster-replicas", str(self._replicas), "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        self.wait_healthy()
        return self

    def _run(self, port: int) -> None:
        folder = str(self._root / str(port))
        args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self._node_timeout_ms),
                "--save", "", "--appendonly", "no", "--dir", folder]  # fmt: skip
        self._procs[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def kill(self, port: int) -> None:
        """SIGKILL: the node's connections are reset and new ones refused."""
        proc = self._procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start a killed node again from its nodes.conf: it rejoins the cluster."""
        self._run(port)
        wait_for_port(port)

    def nodes(self) -> list[dict[str, str]]:
        """CLUSTER NODES as a live node sees it: each node's port, id, flags, master's id."""
        port = next(p for p in self.ports if p in self._procs)
        with redis.Redis(port=port, socket_timeout=2, decode_responses=True) as client:
            table = client.execute_command("CLUSTER NODES")
        return [
            {
                "port": address.split("@")[0].rsplit(":", 1)[1],
                "id": node["node_id"],
                "flags": node["flags"],
                "master": node["master_id"],
            }
            for address, node in table.items()
        ]

    def master_of(self, key: str) -> int:
        """The port of the master that holds `key`'s slot now."""
        port = next(p for p in self.ports if p in self._procs)
        with redis.Redis(port=port, socket_timeout=2) as client:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise LookupError(f"no master holds {key!r}'s slot")

    def tags_on(self, master: int, count: int, prefix: str, *, on: bool = True) -> list[str]:
        """`count` names (`prefix` and a number) that, as a hash tag, put a key on `master`
        (or, not `on`, on another master): tenants whose buckets live there."""
        names = (f"{prefix}{i}" for i in itertools.count())
        found = (n for n in names if (self.master_of(f"{{{n}}}") == master) == on)
        return list(itertools.islice(found, count))

    def masters(self) -> list[int]:
        """The ports of the masters that hold slots now."""
        port = next(p for p in self.ports if p in self._procs)
        with redis.Redis(port=port, socket_timeout=2) as client:
            return sorted({int(row[2][1]) for row in client.execute_command("CLUSTER SLOTS")})

    def replica_of(self, master: int) -> int:
        rows = self.nodes()
        master_id = next(r["id"] for r in rows if r["port"] == str(master))
        return next(int(r["port"]) for r in rows if r["master"] == master_id)

    def wait_healthy(self, *, timeout_s: float = 30.0) -> None:
        """Every live node says cluster_state:ok and every live replica's link is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._healthy(port) for port in self._procs):
                return
            time.sleep(0.1)
        raise TimeoutError("the cluster did not become healthy")

    def _healthy(self, port: int) -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as client:
                if client.cluster("INFO")["cluster_state"] != "ok":
                    return False
                info = client.info("replication")
                return info["role"] == "master" or info.get("master_link_status") == "up"
        except (redis.RedisError, OSError, KeyError):
            return False

    def close(self) -> None:
        for port in list(self._procs):
            self.kill(port)
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> ClusterProcesses:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
