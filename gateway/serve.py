"""`spillgate serve -c FILE`: load and validate a config, then serve it with uvicorn.

`--workers N` runs N worker processes on the one socket, sharing state through Redis
(gateway/workers.py); without a Redis URL more than one worker is refused.
"""

from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from gateway.app import create_app
from gateway.config import ConfigError, LoadedConfig, Settings, load_config
from gateway.config.environment import check_environment, redis_url_problem
from gateway.config.problems import Problem
from gateway.workers import configure_logging, serve_workers, workers_problem


def _workers(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("must be a port number, 0 to 65535")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="YAML config file")
    parser.add_argument("--host", help="listen address (default: server.host from the config)")
    parser.add_argument("--port", type=_port, help="listen port (default: server.port)")
    parser.add_argument("--redis", help="Redis URL (default: the env variable redis.url_env names)")
    parser.add_argument(
        "--workers", type=_workers, default=1, help="worker processes (more than 1 needs Redis)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the least severe log lines written",
    )
    parser.add_argument("--check", action="store_true", help="validate the config and exit")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        loaded = load_config(args.config)
    except ConfigError as exc:
        _tell(exc.problems)
        return 2
    settings = loaded.settings
    redis_url = args.redis or os.environ.get(settings.redis.url_env)
    # `--check` needs no secrets (a CI job checking a file has none): one unset is a
    # warning there, while `serve` refuses to start without it
    unset = check_environment(settings, environ=os.environ)
    warnings = loaded.document.lines(unset, warning=True) if args.check else []
    problems = [
        *([] if args.check else loaded.document.lines(unset)),
        *_redis_problems(loaded, redis_url=redis_url, from_args=args.redis is not None),
        *_worker_problems(settings, workers=args.workers, redis_url=redis_url),
    ]
    _tell([*warnings, *problems])
    if problems:
        return 2
    if args.check:
        counts = f"{len(settings.pools)} pools, {len(settings.tenants)} tenants"
        needs = "; serve needs the variables above" if warnings else ""
        print(f"{args.config}: ok ({counts}){needs}")
        return 0
    return _serve(args, settings, redis_url=redis_url)


def _serve(args: argparse.Namespace, settings: Settings, *, redis_url: str | None) -> int:
    host = args.host or settings.server.host
    port = args.port if args.port is not None else settings.server.port
    if args.workers > 1 and redis_url:
        return serve_workers(
            settings,
            config=args.config,
            redis_url=redis_url,
            workers=args.workers,
            host=host,
            port=port,
            log_level=args.log_level,
        )
    app = create_app(settings, redis_url=args.redis)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
    return 0


def _tell(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def _redis_problems(loaded: LoadedConfig, *, redis_url: str | None, from_args: bool) -> list[str]:
    problem = None if redis_url is None else redis_url_problem(redis_url)
    if problem is None:
        return []
    if from_args:
        return [f"spillgate: --redis {problem}"]
    env = loaded.settings.redis.url_env
    return loaded.document.lines([Problem(loc=("redis", "url_env"), message=f"${env} {problem}")])


def _worker_problems(settings: Settings, *, workers: int, redis_url: str | None) -> list[str]:
    problem = workers_problem(settings, workers=workers, redis_url=redis_url)
    return [] if problem is None else [f"spillgate: {problem}"]
