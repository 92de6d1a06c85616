"""The waiters at the other replicas, as one replica's queue weighs its own turns against
them (shared mode, gateway/shared/service_feed.py).

Every replica orders by the fleet's attained service; what it learns of the others' queues
comes two ways: every feed pass reads each replica's waiting tenants (as that replica last
wrote them), and between passes a replica whose waiting tenants change announces them at
once. An announcement is newer than what the passes read of that replica until they have
caught up with it: for HEARD_S, longer than two passes.

A waiter elsewhere goes before the turn here (the arrival check and the drain both ask
`ahead_of`) when it is of a higher class and its request could fit in the room the pool
frees as its answers end: while it waits, no lower class here takes room, as on one replica,
where a lower class is never admitted while a higher one waits and the waiter whose turn it
is is never overtaken. Or when it is of the same class with clearly less service (the
give-way) and its request fits the room free now: room it could not take yet is not held
back from the turn here, where it would sit idle. A give-way lasts at most `give_way_s` from
when this replica first let room go, then the turn here takes it; a rival that stops
waiting says so at once, and the turn here takes the room then.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.clock import Clock, Timer
from gateway.config import PRIORITIES, Priority
from gateway.overflow import PoolRoom, Rival, Route

HEARD_S = 0.5  # an announcement outranks the passes' view of its replica this long
# a tenant waiting elsewhere with at most this share of the service of the tenant whose turn
# it is here has clearly less: between tenants of about the same service the replicas do
# not hand room back and forth
CLEARLY_LESS = 0.5


class FleetWaiters:
    """The tenants waiting at the other replicas for one pool, and whether they go first."""

    def __init__(
        self,
        *,
        pool: str,
        room: PoolRoom,
        clock: Clock,
        service: Callable[[str], float],
        give_way_s: float,
    ) -> None:
        self._pool = pool
        self._room = room
        self._clock = clock
        self._service = service
        self._give_way_s = give_way_s
        self._passed: list[Rival] = []  # as the last pass read them
        self._heard: dict[str, tuple[float, list[Rival]]] = {}  # replica → (when, waiters)
        self.rivals: list[Rival] = []  # both, the announcements first
        self._giving_way_since: float | None = None
        self._look_again: Timer | None = None

    def seen(self, rivals: list[Rival]) -> None:
        """What a pass read ([]: none, or unknown)."""
        self._passed = rivals
        self._merge()

    def heard(self, replica: str, rivals: list[Rival]) -> None:
        """What `replica` announced between passes."""
        self._heard[replica] = (self._clock.monotonic(), rivals)
        self._merge()

    def _merge(self) -> None:
        since = self._clock.monotonic() - HEARD_S
        heard = {r: entry for r, entry in self._heard.items() if entry[0] >= since}
        self._heard = heard
        self.rivals = [r for _, rivals in heard.values() for r in rivals]
        self.rivals += [r for r in self._passed if r.replica not in heard]

    def ahead_of(self, priority: Priority, tenant: str) -> Rival | None:
        """A waiter elsewhere that goes before `tenant` of class `priority`."""
        rank = PRIORITIES.index(priority)
        mine = None
        for rival in self.rivals:
            theirs = PRIORITIES.index(rival.priority)
            if theirs > rank or rival.tenant == tenant:
                continue
            if theirs < rank:
                if self._room.fits_ever(Route(self._pool, rival.tokens, rival.sequences)):
                    return rival
                continue
            mine = self._service(tenant) if mine is None else mine
            if self._service(rival.tenant) > CLEARLY_LESS * mine:
                continue
            if self._room.has_room(Route(self._pool, rival.tokens, rival.sequences)):
                return rival
        return None

    def gives_way(self, priority: Priority, tenant: str, look_again: Callable[[], None]) -> bool:
        """Whether the turn here (`tenant` of class `priority`) leaves free room to a waiter
        elsewhere: to a higher class for as long as it waits; to a lighter tenant for at
        most give_way_s, after which `look_again()` is called."""
        rival = self.ahead_of(priority, tenant)
        if rival is None:
            self._giving_way_since = None
            return False
        if rival.priority != priority:
            return True
        if self._give_way_s <= 0:
            return False
        now = self._clock.monotonic()
        if self._giving_way_since is None:
            self._giving_way_since = now
        left = self._giving_way_since + self._give_way_s - now
        if left <= 0:
            return False
        if self._look_again is None:
            self._look_again = self._clock.call_later(left, lambda: self._looked(look_again))
        return True

    def _looked(self, look_again: Callable[[], None]) -> None:
        self._look_again = None
        look_again()

    def served(self) -> None:
        """The turn here took room: a later give-way counts from its own start."""
        self._giving_way_since = None
