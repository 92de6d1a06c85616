"""Loading a LoRA adapter that no backend of its pool serves onto one that then does.

A pool's adapter with a `path` (gateway/config/pools.py) may be loaded at run time: a
request for it that finds no backend serving it waits while the gateway asks a backend to
load it (vLLM's `POST /v1/load_lora_adapter`, served where the engine runs with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), then goes there: a backend with a free adapter slot
first, the least filled first among equals. One load of an adapter
runs at a time in a pool: every request for it waits on the same load. A load that fails
with a backend's error or no answer is tried again, with a short backoff, then on the next
backend; the request waits no longer than its deadline.

vLLM answers a load of an adapter it holds already with a 400 saying so: that backend
serves it (its listing had not said so yet), which is all the request needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from gateway.admission.fleet.backends import Backend, Pool
from gateway.clock import Clock
from gateway.config import AdapterSettings
from gateway.errors import BackendUnavailable

log = logging.getLogger("spillgate.adapters")

ATTEMPTS = 3  # on one backend, before the next is asked
LOAD_TIMEOUT_S = 30.0  # one try: an engine reads the adapter's weights from its storage
LOADED_ALREADY = "has already been loaded"
# told of each load as (pool, adapter, backend, loaded): the metrics
LoadListener = Callable[[str, str, str, bool], None]


class _Retryable(Exception):
    """A load the backend may yet take: no answer, or a server error."""


class _Refused(Exception):
    """A load the backend will not take: the route is off, the path holds no adapter."""


class AdapterLoader:
    def __init__(
        self,
        *,
        client: httpx.AsyncClient,
        clock: Clock,
        candidates: Callable[[str], list[Backend]],
        on_load: LoadListener | None = None,
    ) -> None:
        """`candidates(pool)`: the pool's backends in rotation, least filled first."""
        self._client = client
        self._clock = clock
        self._candidates = candidates
        self._on_load = on_load
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def load(self, pool: Pool, adapter: AdapterSettings, *, deadline: float) -> None:
        """Until a backend of `pool` serves `adapter`, loading it on one; raises
        BackendUnavailable when none could, or not before `deadline` (Clock time)."""
        key = (pool.name, adapter.name)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(pool, adapter))
            self._loading[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        try:
            # shielded: a request that leaves does not cancel a load the others wait on
            async with asyncio.timeout(max(0.0, deadline - self._clock.monotonic())):
                await asyncio.shield(task)
        except TimeoutError:
            raise BackendUnavailable(
                f"The adapter {adapter.name!r} is still loading on pool {pool.name!r}.",
                retry_after=1.0,
            ) from None

    def _finished(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A load is over: the next request for the adapter starts a new one. Its failure
        is taken here too, so that a load every waiter left (past their deadlines) is not
        reported as an exception nobody retrieved; the waiters got it from `load`."""
        self._loading.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _load(self, pool: Pool, adapter: AdapterSettings) -> None:
        why: list[str] = []
        for backend in self._where_to_load(pool, adapter.name):
            if adapter.name in backend.adapters:
                return  # loaded meanwhile, by a probe's word or another load
            try:
                await self._load_on(backend, adapter)
            except (_Retryable, _Refused) as exc:
                why.append(f"{backend.name}: {exc}")
                self._told(pool, adapter, backend, loaded=False)
                continue
            backend.adapters = backend.adapters | {adapter.name}
            self._told(pool, adapter, backend, loaded=True)
            log.info("loaded adapter %s on backend %s", adapter.name, backend.name)
            return
        reasons = "; ".join(why) or "no backend is in rotation"
        raise BackendUnavailable(
            f"No backend of pool {pool.name!r} could load the adapter {adapter.name!r}: {reasons}."
        )

    def _where_to_load(self, pool: Pool, adapter: str) -> list[Backend]:
        """The pool's backends in rotation to ask, in turn: those with a free adapter slot
        (or that do not say) before those whose slots all run other adapters, where the
        adapter's requests would wait for one; each least filled first."""
        now = self._clock.monotonic()
        return sorted(self._candidates(pool.name), key=lambda b: b.adapter_room(adapter, now) == 2)

    async def _load_on(self, backend: Backend, adapter: AdapterSettings) -> None:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=1.0),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._post(backend, adapter)

    async def _post(self, backend: Backend, adapter: AdapterSettings) -> None:
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        timeout = LOAD_TIMEOUT_S
        try:
            response = await self._client.post(
                f"{backend.url}/v1/load_lora_adapter", json=body, timeout=timeout
            )
        except httpx.TimeoutException:
            raise _Retryable(f"no answer within {timeout:g} s") from None
        except httpx.TransportError as exc:
            raise _Retryable(type(exc).__name__) from None
        if response.status_code == 200:
            return
        text = response.text[:300]
        if response.status_code == 400 and LOADED_ALREADY in text:
            return
        if response.status_code == 404 and "lora" not in text.lower():  # no such route
            raise _Refused(
                "it does not load adapters at run time (vLLM does with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
            )
        if response.status_code >= 500:
            raise _Retryable(f"answered {response.status_code}: {text}")
        raise _Refused(f"answered {response.status_code}: {text}")

    def _told(
        self, pool: Pool, adapter: AdapterSettings, backend: Backend, *, loaded: bool
    ) -> None:
        if self._on_load is not None:
            self._on_load(pool.name, adapter.name, backend.name, loaded)
