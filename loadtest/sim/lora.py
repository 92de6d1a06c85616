"""LoRA adapters on the simulated replica, as vLLM 0.32 serves them (`--enable-lora`).

`Adapters` is the API server's table of loaded adapters (vLLM's `OpenAIServingModels`): the
`--lora-modules` from start-up, then what `/v1/load_lora_adapter` adds and
`/v1/unload_lora_adapter` drops. Each load takes the next `lora_int_id` (1, 2, ...), a failed
one too; with runtime updating allowed, a request naming no loaded adapter takes one as well,
as vLLM's resolver lookup does before it finds nothing. Unloading only forgets the name:
requests already running with the adapter finish with it, as in vLLM.

`LoraRoutes` answers the two endpoints with vLLM's status codes and bodies (a plain-text 200,
JSON errors); they exist only where runtime updating is allowed. A load holds its name's lock
for `lora_load_s` seconds, so a second load of the same name waits and then finds it loaded;
the engine does not step meanwhile, as vLLM's engine core runs the load between two steps,
and loads of other names wait their turn there.
`fail_lora_loads` makes every load fail as a backend that cannot load it (the simulator's
own option: a real engine fails for a missing path or an adapter it refuses).

What the scheduler does with adapters (at most `max_loras` in a step) is in
loadtest/sim/scheduler.py; the `vllm:lora_requests_info` metric in loadtest/sim/metrics.py.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.sim.apis import json_body
from loadtest.sim.config import Adapter, LoraLoadFailure, LoraModule, SimConfig
from loadtest.sim.protocol import SimRequestError
from loadtest.sim.wire import error_body


class Adapters:
    """The adapters a replica serves, by name, in the order they were loaded."""

    def __init__(
        self, *, base_model: str, modules: tuple[LoraModule, ...], runtime_updating: bool
    ) -> None:
        self._base = base_model
        self._runtime = runtime_updating
        self._loaded: dict[str, Adapter] = {}
        self._last_id = 0
        for module in modules:
            self.add(module.name, module.path)

    def __iter__(self) -> Iterator[Adapter]:
        return iter(list(self._loaded.values()))

    def resolve(self, model: str) -> Adapter | None:
        adapter = self._loaded.get(model)
        if adapter is None and self._runtime:
            self._last_id += 1
        return adapter

    def check_load(self, name: str, path: str, *, in_place: bool) -> None:
        """vLLM's refusals of a load request, before the engine is asked."""
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self._base:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if not in_place and name in self._loaded:
            raise _invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )

    def next_id(self, name: str) -> int:
        """The id a load of `name` gives it: its own when loaded in place, else a new one."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            return loaded.lora_id
        self._last_id += 1
        return self._last_id

    def add(self, name: str, path: str, lora_id: int | None = None) -> Adapter:
        adapter = Adapter(name=name, path=path, lora_id=lora_id or self.next_id(name))
        self._loaded[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if self._loaded.pop(name, None) is None:
            raise SimRequestError(
                f"The lora adapter '{name}' cannot be found.",
                status=404,
                error_type="NotFoundError",
            )


def _invalid(message: str) -> SimRequestError:
    return SimRequestError(message, error_type="InvalidUserInput")


def load_failure(failure: LoraLoadFailure, name: str, path: str, rank: int) -> SimRequestError:
    """What vLLM answers when its engine cannot load the adapter (`rank`: the replica's
    --max-lora-rank, which the refused adapter's exceeds)."""
    if failure is LoraLoadFailure.NOT_FOUND:
        return SimRequestError(
            f"Loading lora {name} failed: No adapter found for {path}",
            status=404,
            error_type="NotFoundError",
        )
    return SimRequestError(
        f"Call to add_lora method failed: Worker failed with error 'LoRA rank {rank * 2} is "
        f"greater than max_lora_rank {rank}.', please check the stack trace above for the "
        "root cause",
        status=500,
        error_type="InternalServerError",
    )


# vLLM's error bodies hide file paths (vllm/entrypoints/serve/exception_handling/utils.py)
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def _error(exc: SimRequestError) -> Response:
    message = _FILE_PATH.sub("<path>", _SYSTEM_PATH.sub("<path>", exc.message))
    body = error_body(message=message, error_type=exc.error_type, param=exc.param, code=exc.status)
    return Response(body, status_code=exc.status, media_type="application/json")


def _fields(raw: bytes, names: tuple[str, ...]) -> dict[str, Any]:
    """The request's JSON object, with vLLM's 400 (its request validation's words) for a
    field missing or not a string."""
    body = json_body(raw)
    for name in names:
        value = body.get(name)
        if isinstance(value, str):
            continue
        if value is None:
            kind, words, given = "missing", "Field required", f"<dict of {len(body)} items>"
        else:
            kind, words, given = "string_type", "Input should be a valid string", repr(value)
        detail = {"type": kind, "loc": f"body.{name}", "msg": words, "input": given}
        raise SimRequestError(
            f"1 validation error:\n  {detail}", param=f"body.{name}", error_type="Bad Request"
        )
    return body


class LoraRoutes:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter over `adapters`; `changed` is
    called after each change (the model list is rebuilt)."""

    def __init__(
        self,
        *,
        config: SimConfig,
        adapters: Adapters,
        hold: Callable[[float], None],
        changed: Callable[[], None],
    ) -> None:
        """`hold(seconds)` stops the engine's steps while a load runs."""
        self._adapters = adapters
        self._hold = hold
        self._load_s = config.lora_load_s
        self._failure = config.fail_lora_loads
        self._rank = config.max_lora_rank
        self._changed = changed
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # the engine core runs one utility call at a time: loads of two names queue there
        self._engine = asyncio.Lock()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, request: Request) -> Response:
        try:
            body = _fields(await request.body(), ("lora_name", "lora_path"))
            name, path = body["lora_name"], body["lora_path"]
            async with self._locks[name]:
                await self._load(name, path, in_place=body.get("load_inplace") is True)
        except SimRequestError as exc:
            return _error(exc)
        self._changed()
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def _load(self, name: str, path: str, *, in_place: bool) -> None:
        adapters = self._adapters
        adapters.check_load(name, path, in_place=in_place)
        lora_id = adapters.next_id(name)
        async with self._engine:
            self._hold(self._load_s)
            await asyncio.sleep(self._load_s)
        if self._failure is not None:
            raise load_failure(self._failure, name, path, self._rank)
        adapters.add(name, path, lora_id)

    async def unload(self, request: Request) -> Response:
        try:
            body = _fields(await request.body(), ("lora_name",))
            name = body["lora_name"]
            async with self._locks[name]:
                self._adapters.remove(name)
        except SimRequestError as exc:
            return _error(exc)
        self._changed()
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")
