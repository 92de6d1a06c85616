"""What routing is asked and what it weighs: a request's `Route`, and each backend that
may take it as a `Candidate`."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NamedTuple

from gateway.request import SharedBlocks

if TYPE_CHECKING:
    from gateway.admission.fleet.backends import Backend
    from gateway.request import InferenceRequest


class Route(NamedTuple):
    """What a request asks of its pool's backends: room for `sequences` sequences of up to
    `tokens` tokens each, of which `shared` are prompt blocks other requests may hold with
    it, for the LoRA `adapter` when one is named, never on a backend in `exclude` (tried
    already, or avoided: a Responses continuation goes only where its previous response is
    stored). `prefix` (the keys of its prompt's leading blocks), `session` and `token_ids`
    (the prompt as the engine's tokens) are what prefix routing goes by. A `running`
    request (a stream continued from a backend that failed) was admitted already: it may
    fill a backend past its target fill, as a stream that grows does. A `prefill` route is
    a prefill leg's: it goes to the pool's prefill backends (Pool.prefillers) alone. (A
    NamedTuple: one is built for every admission, and a frozen dataclass costs several
    times as much.)"""

    pool: str
    tokens: int
    sequences: int = 1
    exclude: Collection[str] = ()
    prefix: Sequence[bytes] = ()
    session: str | None = None
    token_ids: Sequence[int] = ()
    shared: Sequence[SharedBlocks] = ()
    adapter: str | None = None
    running: bool = False
    prefill: bool = False

    @classmethod
    def of(
        cls,
        request: InferenceRequest,
        *,
        pool: str | None = None,
        exclude: Collection[str] = (),
        running: bool = False,
    ) -> Route:
        """The route of `request` (in `pool`, when another than its own: `degrade`'s)."""
        avoid = request.avoid
        # built as NamedTuple._make builds one: the generated __new__ binds its eleven
        # parameters one by one, and a Route is built for every admission
        return tuple.__new__(
            cls,
            (
                pool or request.pool,
                request.sequence_tokens,
                request.n,
                avoid.union(exclude) if avoid else exclude,
                request.prefix,
                request.session,
                request.token_ids,
                request.shared,
                request.adapter,
                running,
                False,
            ),
        )


class Candidate(NamedTuple):
    """A backend that may take the request, as the filters left it and the scorers weigh
    it. Candidates sort least filled first: by `after`, the fill the backend would have
    once it holds the request, then by the backend's place in its pool."""

    after: float  # (tokens held + what the request adds there) / capacity
    place: int  # the backend's place in its pool's list
    backend: Backend
    limit: int  # the tokens the ledger may hold on it (Router.limit)
    capacity: int
    fill: float  # tokens held / capacity, before the request
    need: int  # the request's KV tokens there, in whole blocks of its block size
    cost: int  # what it would add to the backend's tokens in flight: `need` less shared blocks
