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

A hot adapter is spread: when a request for it finds no room on the backends that serve it
while another backend of the pool has room (the pipeline asks the router), `spread` loads it
on one more backend, in the background, up to the adapter's `max_backends`; one spread of an
adapter runs at a time in a pool, and the queue is woken when it is done. A pool's
`max_loaded_adapters` bounds how many adapters the gateway keeps loaded on one backend: a load
past it first unloads (`POST /v1/unload_lora_adapter`) the least recently used of those the
gateway loaded there that no request holds room with (gateway/admission/adapter_uses.py);
loads and unloads on one backend take turns.
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

from gateway.admission.adapter_uses import AdapterUses, BudgetFull
from gateway.admission.fleet.backends import Backend, Pool
from gateway.clock import Clock
from gateway.config import AdapterSettings
from gateway.errors import BackendUnavailable

log = logging.getLogger("spillgate.adapters")

ATTEMPTS = 3  # on one backend, before the next is asked
LOAD_TIMEOUT_S = 30.0  # one try: an engine reads the adapter's weights from its storage
LOADED_ALREADY = "has already been loaded"
UNKNOWN = "cannot be found"  # vLLM's 404 to the unload of an adapter it does not hold
# told of each load, and each unload, as (pool, adapter, backend, done): the metrics
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
        on_unload: LoadListener | None = None,
        on_room: Callable[[str], None] | None = None,
    ) -> None:
        """`candidates(pool)`: the pool's backends in rotation, least filled first;
        `on_room(backend)`: an adapter was loaded there, so that its waiters look again."""
        self._client = client
        self._clock = clock
        self._candidates = candidates
        self._on_load = on_load
        self._on_unload = on_unload
        self._on_room = on_room
        self.uses = AdapterUses(clock)
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        # loads and unloads on one backend take turns, so that its budget holds
        self._turns: dict[str, asyncio.Lock] = {}

    async def load(self, pool: Pool, adapter: AdapterSettings, *, deadline: float) -> None:
        """Until a backend of `pool` serves `adapter`, loading it on one; raises
        BackendUnavailable when none could, or not before `deadline` (Clock time)."""
        task = self._loading.get((pool.name, adapter.name)) or self._start(
            pool, adapter, self._where_to_load(pool, adapter.name)
        )
        try:
            # shielded: a request that leaves does not cancel a load the others wait on
            async with asyncio.timeout(max(0.0, deadline - self._clock.monotonic())):
                await asyncio.shield(task)
        except TimeoutError:
            raise BackendUnavailable(
                f"The adapter {adapter.name!r} is still loading on pool {pool.name!r}.",
                retry_after=1.0,
            ) from None

    def may_spread(self, pool: Pool, adapter: AdapterSettings) -> bool:
        """Whether `adapter` may be loaded on one more backend of `pool` now: it has a
        `path`, backends serve it already, fewer than its `max_backends`, and no load of it
        runs (that one may be all it needs)."""
        if adapter.path is None or (pool.name, adapter.name) in self._loading:
            return False
        serving = sum(adapter.name in b.adapters for b in pool.backends)
        return serving > 0 and (adapter.max_backends is None or serving < adapter.max_backends)

    def spread(self, pool: Pool, adapter: AdapterSettings) -> None:
        """Load `adapter` on one more backend of `pool`, in the background: the caller saw no
        room for it where it is served, and room elsewhere (see `may_spread` first)."""
        if not self.may_spread(pool, adapter):
            return
        elsewhere = [
            b for b in self._where_to_load(pool, adapter.name) if adapter.name not in b.adapters
        ]
        if elsewhere:
            log.info(
                "spreading adapter %s of pool %s: its backends are full", adapter.name, pool.name
            )
            self._start(pool, adapter, elsewhere)

    def _start(
        self, pool: Pool, adapter: AdapterSettings, backends: list[Backend]
    ) -> asyncio.Task[None]:
        """Start loading `adapter` on the first of `backends` that takes it: the caller
        found no load of it running in `pool`."""
        key = (pool.name, adapter.name)
        task = asyncio.get_running_loop().create_task(self._load(pool, adapter, backends))
        self._loading[key] = task
        task.add_done_callback(lambda done: self._finished(key, done))
        return task

    def loading(self) -> list[tuple[str, str]]:
        """(pool, adapter) of each load running now."""
        return list(self._loading)

    async def aclose(self) -> None:
        """Cancel the loads still running (a spread's has no waiter): at shutdown, before
        the client they use is closed."""
        running = list(self._loading.values())
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _finished(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        """A load is over: the next request for the adapter starts a new one. Its failure
        is taken here too, so that a load every waiter left (past their deadlines) is not
        reported as an exception nobody retrieved; the waiters got it from `load`."""
        self._loading.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _load(self, pool: Pool, adapter: AdapterSettings, backends: list[Backend]) -> None:
        why: list[str] = []
        for backend in backends:
            if adapter.name in backend.adapters:
                return  # loaded meanwhile, by a probe's word or another load
            turn = self._turns.setdefault(backend.name, asyncio.Lock())
            try:
                async with turn:
                    await self._make_room(pool, backend)
                    await self._load_on(backend, adapter)
            except BudgetFull as exc:
                why.append(f"{backend.name}: {exc}")
                continue
            except (_Retryable, _Refused) as exc:
                why.append(f"{backend.name}: {exc}")
                self._told(self._on_load, pool, adapter.name, backend, done=False)
                continue
            backend.adapters = backend.adapters | {adapter.name}
            self._told(self._on_load, pool, adapter.name, backend, done=True)
            log.info("loaded adapter %s on backend %s", adapter.name, backend.name)
            if self._on_room is not None:
                self._on_room(backend.name)
            return
        reasons = "; ".join(why) or "no backend is in rotation"
        raise BackendUnavailable(
            f"No backend of pool {pool.name!r} could load the adapter {adapter.name!r}: {reasons}."
        )

    def _where_to_load(self, pool: Pool, adapter: str) -> list[Backend]:
        """The pool's backends in rotation to ask, in turn: those with a free adapter slot
        (or that do not say) before those whose slots all run other adapters, where the
        adapter's requests would wait for one; then those serving fewer adapters first,
        whose slots the adapters they serve will take less often; each least filled first.
        (A burst's first request for the adapter may come before any other holds a slot
        anywhere: every backend has a free one then, and only what each serves tells where
        the adapter will keep finding one.)"""
        now = self._clock.monotonic()

        def order(backend: Backend) -> tuple[bool, int]:
            return backend.adapter_room(adapter, now) == 2, len(backend.adapters)

        return sorted(self._candidates(pool.name), key=order)

    async def _make_room(self, pool: Pool, backend: Backend) -> None:
        """Unload from `backend` what the gateway loaded there past the pool's budget, least
        recently used first. An unload that fails leaves the adapter served there, and the
        load waits for another backend (BudgetFull)."""
        budget = pool.settings.max_loaded_adapters
        if budget is None:
            return
        for name in self.uses.to_unload(backend, budget):
            # off the backend's list first: no request is routed there for it meanwhile
            backend.adapters = backend.adapters - {name}
            try:
                await self._post(backend, "unload", {"lora_name": name}, gone=UNKNOWN)
            except (_Retryable, _Refused) as exc:
                backend.adapters = backend.adapters | {name}
                self._told(self._on_unload, pool, name, backend, done=False)
                raise BudgetFull(f"unloading the adapter {name!r} failed: {exc}") from None
            self.uses.unloaded(backend.name, name)
            self._told(self._on_unload, pool, name, backend, done=True)
            log.info(
                "unloaded adapter %s from backend %s (max_loaded_adapters)", name, backend.name
            )

    async def _load_on(self, backend: Backend, adapter: AdapterSettings) -> None:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=1.0),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        async for attempt in retrying:
            with attempt:
                if await self._post(backend, "load", body, gone=LOADED_ALREADY):
                    # only what the gateway loaded itself is its to unload
                    self.uses.loaded(backend.name, adapter.name)

    async def _post(
        self, backend: Backend, verb: str, body: dict[str, str | None], *, gone: str
    ) -> bool:
        """POST /v1/{verb}_lora_adapter: True where it was done, False where it needed no
        doing (the engine's error says `gone`: the adapter was there, or was not)."""
        timeout = LOAD_TIMEOUT_S
        try:
            response = await self._client.post(
                f"{backend.url}/v1/{verb}_lora_adapter", json=body, timeout=timeout
            )
        except httpx.TimeoutException:
            raise _Retryable(f"no answer within {timeout:g} s") from None
        except httpx.TransportError as exc:
            raise _Retryable(type(exc).__name__) from None
        if response.status_code == 200:
            return True
        text = response.text[:300]
        if response.status_code in (400, 404) and gone in text:
            return False
        if response.status_code == 404 and "lora" not in text.lower():  # no such route
            raise _Refused(
                "it does not load adapters at run time (vLLM does with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
            )
        if response.status_code >= 500:
            raise _Retryable(f"answered {response.status_code}: {text}")
        raise _Refused(f"answered {response.status_code}: {text}")

    @staticmethod
    def _told(
        listener: LoadListener | None, pool: Pool, adapter: str, backend: Backend, *, done: bool
    ) -> None:
        if listener is not None:
            listener(pool.name, adapter, backend.name, done)
