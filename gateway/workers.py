"""`spillgate serve --workers N`: N worker processes on one socket, sharing state through Redis.

uvicorn's supervisor binds the socket once, spawns N workers and replaces any that die.
Each worker builds its own app from the same config (the factory `worker_app` reads a
WorkerSpec from the environment) and shares tenant buckets, the in-flight ledger, queue
wake-ups and the response cache with the other workers and replicas through Redis. Without
Redis every worker would keep its own ledger and each would fill every backend to its
limit, so more than one worker needs a Redis URL. Metrics add up across the workers:
prometheus-client's multiprocess mode, with its files in PROMETHEUS_MULTIPROC_DIR (wiped at
start; a temporary folder, removed at exit, when unset), each worker refreshing its gauges
every second so a scrape answered by any worker sees them all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from gateway.app import create_app
from gateway.config import Settings, load_settings
from gateway.metrics import MULTIPROC_ENV, forget_dead_workers

SPEC_ENV = "SPILLGATE_WORKER_SPEC"


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What every worker needs to build the same app; travels in the environment."""

    config: str
    redis_url: str
    workers: int
    log_level: str = "info"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


def configure_logging(level: str) -> None:
    """The gateway's log at `level`. httpx logs every request it makes at INFO, which for
    the probes of every backend is a line per backend every few seconds: its requests are
    logged at debug level only (the gateway logs each backend's changes of state)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def worker_app() -> ASGIApp:
    """The app factory uvicorn calls in each worker process."""
    spec = WorkerSpec.from_env(os.environ[SPEC_ENV])
    configure_logging(spec.log_level)
    return create_app(load_settings(spec.config), redis_url=spec.redis_url, workers=spec.workers)


def workers_problem(settings: Settings, *, workers: int, redis_url: str | None) -> str | None:
    """Why these workers cannot run, or None."""
    if workers > 1 and not redis_url:
        return (
            f"--workers {workers} needs Redis (--redis URL or ${settings.redis.url_env}): "
            "worker processes share the in-flight ledger, rate limits and queue wake-ups only "
            "through Redis; without it each would fill every backend on its own"
        )
    return None


def serve_workers(
    settings: Settings,
    *,
    config: str,
    redis_url: str,
    workers: int,
    host: str,
    port: int,
    log_level: str,
) -> int:
    spec = WorkerSpec(
        config=str(Path(config).resolve()),
        redis_url=redis_url,
        workers=workers,
        log_level=log_level,
    )
    with metrics_dir() as path:
        os.environ[MULTIPROC_ENV] = path
        os.environ[SPEC_ENV] = spec.to_env()
        uvicorn.run(
            "gateway.workers:worker_app",
            factory=True,
            workers=workers,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            loop="uvloop",
            http="httptools",
        )
        # a worker that could not finish its shutdown (killed, or failed on the way) left
        # its live gauges behind; they would count in the next run's sums
        forget_dead_workers(path)
    return 0


@contextlib.contextmanager
def metrics_dir() -> Iterator[str]:
    """PROMETHEUS_MULTIPROC_DIR emptied of an earlier run's files, or a temporary folder."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        for stale in Path(given).glob("*.db"):
            stale.unlink(missing_ok=True)
        yield given
        return
    path = tempfile.mkdtemp(prefix="spillgate-metrics-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
