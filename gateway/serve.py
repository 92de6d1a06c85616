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
from gateway.config import ConfigError, check_environment, load_settings
from gateway.workers import configure_logging, refusal, serve_workers


def _workers(value: str) -> int:
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="YAML config file")
    parser.add_argument("--host", help="listen address (default: server.host from the config)")
    parser.add_argument("--port", type=int, help="listen port (default: server.port)")
    parser.add_argument("--redis", help="Redis URL (default: the env variable redis.url_env names)")
    parser.add_argument(
        "--workers", type=_workers, default=1, help="worker processes (more than 1 needs Redis)"
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        settings = load_settings(args.config)
    except (ConfigError, OSError) as exc:
        print(f"spillgate: {exc}", file=sys.stderr)
        return 2
    missing = check_environment(settings)
    if missing:
        print(f"spillgate: {args.config}: missing environment", file=sys.stderr)
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        return 2
    redis_url = args.redis or os.environ.get(settings.redis.url_env)
    problem = refusal(settings, workers=args.workers, redis_url=redis_url)
    if problem is not None:
        print(f"spillgate: {problem}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok ({len(settings.pools)} pools, {len(settings.tenants)} tenants)")
        return 0
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
