"""`spillgate demo` as a child process with a known key and admin token, for the drill."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.procs import free_port

READY_TIMEOUT_S = 60.0


class DemoProcess:
    """Starts the demo on a free port, waits for /readyz, and stops its whole process group."""

    def __init__(self, *, speed: float = 1.0, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.api_key = "sk-drill-" + secrets.token_hex(8)
        self.admin_token = secrets.token_hex(16)
        self.speed = speed
        self.extra = extra
        self._proc: subprocess.Popen[bytes] | None = None
        fd, log = tempfile.mkstemp(prefix="spillgate-drill-demo-", suffix=".log")
        os.close(fd)
        self._log = Path(log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DemoProcess:
        cmd = [
            sys.executable, "-m", "gateway.cli", "demo", "--port", str(self.port),
            "--api-key", self.api_key, "--admin-token", self.admin_token,
            "--speed", str(self.speed), *self.extra,
        ]  # fmt: skip
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 12) -> str:
        text = self._log.read_text(errors="replace") if self._log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise OSError(
                    f"spillgate demo exited with status {self._proc.returncode}:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"spillgate demo not ready after {READY_TIMEOUT_S:g}s")

    def stop(self) -> None:
        """Stop the demo, then whatever of its process group outlived it (its simulators)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the demo's clean stop, as Ctrl-C
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        self._log.unlink(missing_ok=True)

    def __enter__(self) -> DemoProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
