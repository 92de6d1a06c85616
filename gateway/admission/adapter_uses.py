"""Which LoRA adapters the gateway loaded on each backend, when each was last used there, and
which have requests in flight there: what picks the adapters to unload when a backend holds
its pool's `max_loaded_adapters` (gateway/admission/adapters.py does the unloading).

Only an adapter the gateway loaded itself is ever named: one the engine was started with
(or that another client loaded) is the operator's. An adapter is in use on a backend while a
request for it holds a reservation there, or while the engine's last scrape names it among
the adapters its steps run (`vllm:lora_requests_info`: requests another replica sent); it
was last used there when such a reservation ended, or when it was loaded. Pure
bookkeeping: the clock is injected, no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable

from gateway.admission.fleet.backends import Backend
from gateway.admission.ledger.held import HeldReservation, Releases
from gateway.admission.ledger.reservations import Reservation
from gateway.clock import Clock


class BudgetFull(Exception):
    """A backend holds its budget of adapters the gateway loaded, and too few of them are
    idle to make room for one more (almost always: every one is busy)."""


class AdapterUses:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        # backend → the adapters the gateway loaded there → when each was last used there
        self._loaded: dict[str, dict[str, float]] = {}
        # adapter → the reservations of the requests for it now in the pipeline
        self._held: dict[str, set[HeldReservation]] = {}

    def loaded(self, backend: str, adapter: str) -> None:
        """The gateway loaded `adapter` on `backend`: its to unload, and as if just used."""
        self._loaded.setdefault(backend, {})[adapter] = self._clock.monotonic()

    def unloaded(self, backend: str, adapter: str) -> None:
        self._loaded.get(backend, {}).pop(adapter, None)

    def held(self, releases: Releases, adapter: str) -> HeldReservation:
        """The reservation a request for `adapter` holds: when it is given back, the adapter
        was used where it was held."""
        return HeldReservation(_Stamped(releases, self, adapter))

    def watch(self, adapter: str, held: HeldReservation) -> None:
        """Until `done`: where `held` holds room, `adapter` is in use."""
        self._held.setdefault(adapter, set()).add(held)

    def done(self, adapter: str, held: HeldReservation) -> None:
        """The request is over (its reservation given back): no longer watched."""
        holders = self._held.get(adapter)
        if holders is not None:
            holders.discard(held)
            if not holders:
                del self._held[adapter]

    def busy(self, backend: str, adapter: str) -> bool:
        """Whether a request for `adapter` holds a reservation on `backend` now."""
        return any(h.backend == backend for h in self._held.get(adapter, ()))

    def to_unload(self, backend: Backend, budget: int) -> list[str]:
        """The adapters to unload from `backend` before the gateway loads one more there,
        least recently used first, so that it then holds `budget` of its own at most.
        Raises BudgetFull when too few of them are idle."""
        mine = self._loaded.get(backend.name, {})
        for gone in mine.keys() - backend.adapters:  # unloaded by other means: not counted
            del mine[gone]
        excess = len(mine) - budget + 1
        if excess <= 0:
            return []
        # the engine's own word counts too: requests another replica (or a client past the
        # gateway) sent for an adapter run there without a reservation of this process
        load = backend.reported_load(self._clock.monotonic())
        active = frozenset() if load is None else load.active_adapters
        idle = sorted(
            (used, a)
            for a, used in mine.items()
            if a not in active and not self.busy(backend.name, a)
        )
        if len(idle) < excess:
            raise BudgetFull(
                "every adapter the gateway loaded there has requests in flight "
                f"(max_loaded_adapters: {budget})"
            )
        return [adapter for _, adapter in idle[:excess]]

    def used(self, backend: str, adapter: str) -> None:
        """A request for `adapter` gave back its room on `backend`."""
        mine = self._loaded.get(backend)
        if mine is not None and adapter in mine:
            mine[adapter] = self._clock.monotonic()


class _Stamped:
    """The router's releases, noting when a request for `adapter` gives back its room."""

    __slots__ = ("_adapter", "_releases", "_uses")

    def __init__(self, releases: Releases, uses: AdapterUses, adapter: str) -> None:
        self._releases = releases
        self._uses = uses
        self._adapter = adapter

    def release(self, reservation: Reservation) -> Awaitable[None]:
        self._uses.used(reservation.backend, self._adapter)
        return self._releases.release(reservation)

    async def extend(self, reservation: Reservation, tokens: int) -> Reservation:
        return await self._releases.extend(reservation, tokens)
