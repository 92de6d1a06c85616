"""`spillgate serve -c FILE`: load and validate a config, then serve it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from gateway.app import create_app
from gateway.config import ConfigError, check_environment, load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="YAML config file")
    parser.add_argument("--host", help="listen address (default: server.host from the config)")
    parser.add_argument("--port", type=int, help="listen port (default: server.port)")
    parser.add_argument("--redis", help="Redis URL (default: the env variable redis.url_env names)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
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
    if args.check:
        print(f"{args.config}: ok ({len(settings.pools)} pools, {len(settings.tenants)} tenants)")
        return 0
    app = create_app(settings, redis_url=args.redis)
    uvicorn.run(
        app,
        host=args.host or settings.server.host,
        port=args.port if args.port is not None else settings.server.port,
        log_level=args.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
    return 0
