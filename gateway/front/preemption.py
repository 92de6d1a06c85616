"""Preemption: a waiter of a higher class never waits behind lower-class work already running.

Every stream a pool serves whose class its pool lets be preempted (`preempt`, sheddable by
default, critical never) is entered here while it runs on the pool, with the handle that
stops its answer at the upstream (gateway/upstream/stop.py). When the head of a pool's queue
does not fit, the queue asks `make_room` (policies/queue/policy.py): the fewest requests of
a lower class on one backend whose release lets it fit are stopped, the cheapest losses
first (`Running.loss`): the lowest class; then those whose upstream answer has begun (its
head came), as closing the connection stops them at once, while one still waiting for its
head holds its room until the engine sends it; then those whose client has no byte yet;
then those that sent the fewest events; then the newest. Each request is stopped at most
once, and never for a waiter of its own class; while stopped requests have yet to release,
the room they free counts as coming, so one shortfall stops no more than it needs.

A stream whose backend broke off and goes on elsewhere (gateway/upstream/resume.py) leaves
the register: it has paused once already, and its further legs carry no stop. What becomes
of a stopped request is its legs' business (gateway/front/legs.py): it waits in its pool's
queue at its own place and goes on where it was, its client seeing a later first token or
a stream that paused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gateway.admission.ledger.held import HeldReservation
from gateway.admission.routing.route import Route
from gateway.admission.routing.router import Router
from gateway.clock import Clock
from gateway.config import PRIORITIES, Priority
from gateway.request import InferenceRequest
from gateway.upstream.stop import Stop


@dataclass(eq=False, slots=True)
class Running:
    """One preemptible request in flight: its class, the room it holds, its stop."""

    request: InferenceRequest
    held: HeldReservation
    started: float  # Clock time
    stop: Stop = field(default_factory=Stop)

    def loss(self) -> tuple[int, bool, bool, int, float]:
        """What stopping it costs, smallest first (see the module's docstring)."""
        rank = -PRIORITIES.index(self.request.priority)  # the lowest class first
        stop = self.stop
        return rank, not stop.stoppable, stop.streaming, stop.events, -self.started


class Preemptions:
    """The preemptible requests in flight, by pool; one per gateway process."""

    def __init__(
        self, router: Router, *, preempt: Mapping[str, Collection[Priority]], clock: Clock
    ) -> None:
        """`preempt`: each pool's classes that may be preempted."""
        self._router = router
        self._clock = clock
        self._preempt = {pool: frozenset(classes) for pool, classes in preempt.items()}
        self._running: dict[str, set[Running]] = {pool: set() for pool in preempt}

    def enter(self, request: InferenceRequest, held: HeldReservation) -> Running | None:
        """Enter `request`, a stream now served by its pool on `held`, if it may be
        preempted; leave it (`leave`) when it ends."""
        if request.priority not in self._preempt.get(request.pool, ()):
            return None
        running = Running(request, held, self._clock.monotonic())
        self._running[request.pool].add(running)
        return running

    def leave(self, running: Running) -> None:
        self._running[running.request.pool].discard(running)

    def make_room(self, route: Route, priority: Priority) -> bool:
        """Stop the fewest requests of a class below `priority` in the route's pool whose
        room lets the route fit on one backend; whether room is made or coming (stopped
        now, or before and not yet released). False: nothing here would make room."""
        victims = self._victims(route, priority)
        if victims is None:
            return False
        for running in victims:
            stopped = running.request
            running.stop.fire(
                retry_after=self._router.retry_after(
                    stopped.pool, stopped.sequence_tokens, sequences=stopped.n
                )
            )
        return True

    def could_make_room(self, route: Route, priority: Priority) -> bool:
        """Whether `make_room` would stop any request here now."""
        return bool(self._victims(route, priority))

    def _victims(self, route: Route, priority: Priority) -> list[Running] | None:
        """The requests to stop for `route` ([]: none, room is coming where it fits);
        None where the requests here would not make room."""
        entries = self._running.get(route.pool)
        if not entries:
            return None
        rank = PRIORITIES.index(priority)
        coming: dict[str, int] = {}  # room stopped requests have yet to release
        victims: dict[str, list[Running]] = {}
        for running in entries:
            reservation = running.held.reservation
            if reservation is None:  # between legs: it holds nothing to give
                continue
            if running.stop.fired:
                coming[reservation.backend] = coming.get(reservation.backend, 0) + (
                    reservation.own_tokens
                )
            elif PRIORITIES.index(running.request.priority) > rank:
                victims.setdefault(reservation.backend, []).append(running)
        best: list[Running] | None = None
        for backend, short in self._router.shortfalls(route):
            short -= coming.get(backend, 0)
            if short <= 0:
                return []  # it fits there, or will once what was stopped is released
            chosen, freed = [], 0
            for running in sorted(victims.get(backend, ()), key=Running.loss):
                chosen.append(running)
                freed += _own_tokens(running)
                if freed >= short:
                    break
            if freed >= short and (best is None or len(chosen) < len(best)):
                best = chosen
        return best


def _own_tokens(running: Running) -> int:
    reservation = running.held.reservation
    return 0 if reservation is None else reservation.own_tokens
