"""The gateway's OpenAPI description (gateway/ops/openapi.yaml), served as JSON at /openapi.json."""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson
import yaml
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

OPENAPI_PATH = "/openapi.json"


def openapi_document() -> dict[str, Any]:
    text = resources.files("gateway.ops").joinpath("openapi.yaml").read_text("utf-8")
    document: dict[str, Any] = yaml.safe_load(text)
    return document


def openapi_route() -> Route:
    """GET /openapi.json; the document is read and encoded once, when the app is built."""
    body = orjson.dumps(openapi_document())

    async def serve(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return Route(OPENAPI_PATH, serve, methods=["GET"])
