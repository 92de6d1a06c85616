"""A pool's routing profile, built from its settings by the one registry of plug-ins."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.admission.fleet.backends import Backend, Pool
from gateway.admission.routing.plugins import (
    FILTERS,
    AdapterScorer,
    BestPicker,
    FillScorer,
    Picker,
    PrefixScorer,
    Scorer,
    WaitingScorer,
)
from gateway.admission.routing.prefix_route import GroupLoads
from gateway.admission.routing.route import Candidate, Route

# builds a scorer for one pool; `groups` is the router's count of what each prefix holds
ScorerFactory = Callable[[Pool, GroupLoads], Scorer]


def scorers() -> dict[str, ScorerFactory]:
    """Every scorer a profile may name (gateway/config/routing.py, ScorerName)."""
    return {
        FillScorer.name: lambda pool, groups: FillScorer(),
        PrefixScorer.name: lambda pool, groups: PrefixScorer(pool, groups=groups),
        AdapterScorer.name: lambda pool, groups: AdapterScorer(),
        WaitingScorer.name: lambda pool, groups: WaitingScorer(),
    }


def pickers() -> dict[str, Callable[[], Picker]]:
    """Every picker a profile may name (gateway/config/routing.py, PickerName)."""
    return {BestPicker.name: BestPicker}


class RoutingProfile:
    """One pool's filters, weighed scorers and picker."""

    def __init__(self, pool: Pool, *, groups: GroupLoads) -> None:
        settings = pool.routing
        built = scorers()
        self.filters = FILTERS
        # the filters a request that names no backends to exclude and no adapter meets
        self.plain_filters = tuple(f for f in FILTERS if not f.conditional)
        made = [(s.weight, built[s.plugin](pool, groups)) for s in settings.scorers]
        # those whose scores alone keep the candidates' order (fill) are only worked out
        # when another scorer has something to say about a request
        self._deciding = [(w, s) for w, s in made if not s.follows_fill]
        self._following = [(w, s) for w, s in made if s.follows_fill]
        self.picker = pickers()[settings.picker]()
        # the metrics its scorers read from each backend's scrape
        self.signals = frozenset(n for _, scorer in made for n in scorer.signals)

    def keeps(self, backend: Backend, route: Route, now: float) -> bool:
        """Whether every filter lets `backend` take `route`'s request."""
        return all(f.keeps(backend, route, now) for f in self.filters)

    def order(
        self, route: Route, candidates: Sequence[Candidate], now: float
    ) -> Sequence[Candidate]:
        """`candidates` (least filled first) in the order reserving tries them."""
        if len(candidates) < 2:
            return candidates
        weighed = []
        for weight, scorer in self._deciding:
            scores = scorer.score(route, candidates, now)
            if scores is not None:
                weighed.append((weight, scores))
        if not weighed:
            return candidates
        for weight, scorer in self._following:
            scores = scorer.score(route, candidates, now)
            if scores is not None:
                weighed.append((weight, scores))
        return self.picker.order(candidates, weighed)
