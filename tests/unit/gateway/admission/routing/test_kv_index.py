"""The KV-events index: blocks stored less removed, keyed by their token ids, scored by the
longest leading run a backend holds; and vLLM 0.32's own batches decoded."""

from __future__ import annotations

from pathlib import Path

from gateway.admission.fleet.kv_events import decode
from gateway.admission.ledger.reservations import InFlight, Reservation
from gateway.admission.routing.kv_index import BackendBlocks, Cleared, Removed, Stored, block_keys
from gateway.admission.routing.route import Candidate

FIXTURE = Path(__file__).parents[4] / "fixtures" / "vllm-0.32-kv-events.bin"


def stored(ids: list[int], *, hashes: list[int], parent: int | None = None, size: int = 4):
    return Stored(block_hashes=hashes, parent=parent, token_ids=ids, block_size=size)


def test_a_prompt_matches_the_blocks_stored_in_a_row():
    blocks = BackendBlocks()
    prompt = list(range(14))  # three whole blocks of 4, and 2 tokens
    blocks.apply(
        [stored(prompt[:8], hashes=[101, 102]), stored(prompt[8:12], hashes=[103], parent=102)]
    )
    keys = block_keys(prompt, 4)
    assert len(keys) == 3
    assert blocks.matched(keys) == 3
    assert blocks.matched(block_keys([*prompt[:8], 99, 99, 99, 99], 4)) == 2
    assert blocks.matched(block_keys([7, *prompt[1:]], 4)) == 0  # first block differs
    assert len(blocks) == 3


def test_removed_blocks_end_the_run_and_cleared_forgets_all():
    blocks = BackendBlocks()
    prompt = list(range(12))
    blocks.apply([stored(prompt, hashes=[1, 2, 3])])
    blocks.apply([Removed([2])])
    assert blocks.matched(block_keys(prompt, 4)) == 1
    blocks.apply([Removed([999])])  # never stored: nothing happens
    assert len(blocks) == 2
    blocks.apply([Cleared()])
    assert blocks.matched(block_keys(prompt, 4)) == 0
    assert len(blocks) == 0


def test_a_block_whose_parent_was_never_seen_matches_nothing_but_is_removed_cleanly():
    blocks = BackendBlocks()
    blocks.apply([stored(list(range(4, 8)), hashes=[2], parent=1)])
    assert len(blocks) == 0
    blocks.apply([stored(list(range(4)), hashes=[1])])
    assert blocks.matched(block_keys(list(range(8)), 4)) == 1  # the orphan stays unkeyed
    blocks.apply([Removed([2, 1])])
    assert len(blocks) == 0


def test_the_same_tokens_after_another_prefix_are_another_block():
    blocks = BackendBlocks()
    blocks.apply([stored([9, 9, 9, 9, 5, 6, 7, 8], hashes=[1, 2])])
    assert blocks.matched(block_keys([1, 1, 1, 1, 5, 6, 7, 8], 4)) == 0


def test_a_block_stored_twice_under_one_hash_counts_once():
    blocks = BackendBlocks()
    blocks.apply([stored([1, 2, 3, 4], hashes=[7]), stored([1, 2, 3, 4], hashes=[7])])
    blocks.apply([Removed([7])])
    assert len(blocks) == 0


def test_two_engine_blocks_with_one_key_stay_until_both_are_removed():
    blocks = BackendBlocks()  # as when the engine hashed an extra key the index leaves out
    blocks.apply([stored([1, 2, 3, 4], hashes=[7]), stored([1, 2, 3, 4], hashes=[8])])
    blocks.apply([Removed([7])])
    assert blocks.matched(block_keys([1, 2, 3, 4], 4)) == 1
    blocks.apply([Removed([8])])
    assert blocks.matched(block_keys([1, 2, 3, 4], 4)) == 0


def frames() -> list[tuple[int, bytes]]:
    data, out, i = FIXTURE.read_bytes(), [], 0
    while i < len(data):
        size = int.from_bytes(data[i : i + 4], "big")
        seq = int.from_bytes(data[i + 4 : i + 12], "big")
        out.append((seq, data[i + 12 : i + 12 + size]))
        i += 12 + size
    return out


def test_vllm_batches_decode_and_replay_into_the_blocks_it_holds():
    """Captured from vLLM 0.32 (CPU build, 15 usable blocks of 128): a prefix cache reset,
    then eight prompts of three blocks each, the oldest evicted as the cache fills."""
    batches = frames()
    assert [seq for seq, _ in batches] == list(range(1, 10))
    first = decode(batches[0][1])
    assert isinstance(first[0], Cleared)
    assert isinstance(first[1], Stored)
    assert first[1].block_size == 128
    assert len(first[1].token_ids) == 3 * 128
    assert first[1].parent is None
    blocks = BackendBlocks()
    prompts = []
    for _, payload in batches:
        events = decode(payload)
        prompts += [e.token_ids for e in events if isinstance(e, Stored)]
        blocks.apply(events)
    assert blocks.block_size == 128
    assert len(prompts) == 8
    # 24 blocks stored, 10 removed, the least recently used first: 14 held
    assert len(blocks) == 14
    assert blocks.matched(block_keys(list(prompts[-1]), 128)) == 3
    assert blocks.matched(block_keys(list(prompts[0]), 128)) == 0


def test_blocks_an_engine_reports_holding_do_not_count_against_the_herding_guard() -> None:
    """A tenant's requests in flight on the backend that caches its prompt put it over the
    guard's bound only by what they would allocate: with the prompt cached, nothing."""
    from types import SimpleNamespace

    from gateway.admission.fleet.kv_events import EventsView
    from gateway.admission.routing.prefix_index import PrefixIndex
    from gateway.admission.routing.prefix_route import GroupLoads, Held, by_prefix

    prompt = list(range(400))  # 25 blocks of 16
    holder, empty = EventsView(connected=True), EventsView(connected=True)
    holder.blocks.apply([stored(prompt, hashes=list(range(25)), size=16)])
    a, b = SimpleNamespace(name="a", block_size=16), SimpleNamespace(name="b", block_size=16)
    prefix = [b"first-block"]
    loads = GroupLoads()
    # the tenant's earlier request, in flight on a
    loads.add(InFlight(reservation=Reservation("a", 200, "earlier"), at=0.0), prefix[0])

    def pick(events: dict[str, EventsView]) -> str:
        ranked = [candidate(0.0, 1, b), candidate(0.2, 0, a)]
        held = Held(PrefixIndex(), prefix, events=events, token_ids=prompt)
        best = by_prefix(ranked, tokens=400, prefix=prefix, session=None, held=held, loads=loads,
                  target_fill=0.9)  # fmt: skip
        return str(ranked[best].backend.name)

    assert pick({"a": holder, "b": empty}) == "a"
    # the same load without a view of a's cache: its 600 tokens of the prefix pass it over
    assert pick({}) == "b"


def test_a_prompt_held_nowhere_goes_where_it_was_cached_last() -> None:
    """Evicted everywhere, a prompt returns to the backend that last cached its first block
    (traffic the gateway does not route keeps bringing it there), not to its two homes."""
    from types import SimpleNamespace

    from gateway.admission.fleet.kv_events import EventsView
    from gateway.admission.routing.prefix_index import PrefixIndex
    from gateway.admission.routing.prefix_route import GroupLoads, Held, by_prefix

    prompt = list(range(64))
    views = {name: EventsView(connected=True) for name in "abcd"}
    for at, name in ((1.0, "c"), (2.0, "b")):  # cached on c, then on b; then evicted from both
        views[name].blocks.apply([stored(prompt, hashes=[10, 11, 12, 13], size=16)], at=at)
        views[name].blocks.apply([Removed([10, 11, 12, 13])], at=at + 5)
    assert (
        len(views["b"].blocks) == 0
        and views["b"].blocks.stored_at(block_keys(prompt, 16)[0]) == 2.0
    )
    backends = [SimpleNamespace(name=name, block_size=16) for name in "abcd"]

    def pick(events: dict[str, EventsView]) -> str:
        ranked = [candidate(0.0, i, b) for i, b in enumerate(backends)]
        held = Held(PrefixIndex(), [b"first"], events=events, token_ids=prompt)
        best = by_prefix(ranked, tokens=64, prefix=[b"first"], session=None, held=held,
                  loads=GroupLoads(), target_fill=0.9)  # fmt: skip
        return str(ranked[best].backend.name)

    assert pick(views) == "b"
    assert pick({"a": views["a"], "c": views["c"], "d": views["d"]}) == "c"


def test_a_prompt_held_nowhere_follows_a_request_of_it_in_flight() -> None:
    """A request of the prompt in flight on a backend is prefilling it there, before the
    engine reports the blocks: the next one goes along, not to where it was cached last,
    so the prompt is computed and cached once."""
    from types import SimpleNamespace

    from gateway.admission.fleet.kv_events import EventsView
    from gateway.admission.routing.prefix_index import PrefixIndex
    from gateway.admission.routing.prefix_route import GroupLoads, Held, by_prefix

    prompt = list(range(64))
    views = {name: EventsView(connected=True) for name in "abcd"}
    views["b"].blocks.apply([stored(prompt, hashes=[10, 11, 12, 13], size=16)], at=2.0)
    views["b"].blocks.apply([Removed([10, 11, 12, 13])], at=7.0)
    backends = [SimpleNamespace(name=name, block_size=16) for name in "abcd"]
    loads = GroupLoads()

    def pick() -> str:
        # a backend's fill counts what is in flight there
        fills = {b.name: loads.held(b.name, b"first") / 1000 for b in backends}
        ranked = [candidate(fills[b.name], i, b) for i, b in enumerate(backends)]
        held = Held(PrefixIndex(), [b"first"], events=views, token_ids=prompt)
        best = by_prefix(ranked, tokens=64, prefix=[b"first"], session=None, held=held, loads=loads,
                  target_fill=0.9)  # fmt: skip
        return str(ranked[best].backend.name)

    assert pick() == "b"
    loads.add(InFlight(reservation=Reservation("d", 64, "first-request"), at=0.0), b"first")
    assert pick() == "d"
    loads.remove("first-request")  # served, and its blocks reported: the view decides again
    assert pick() == "b"


def test_a_well_filled_backend_that_reports_the_prompt_keeps_it() -> None:
    """Past the floor a backend's load passes it over, as far as the gateway's index
    guesses it holds the prompt; where its engine reports holding it, another backend
    would prefill it whole, so only the prefix's own load there counts."""
    from types import SimpleNamespace

    from gateway.admission.fleet.kv_events import EventsView
    from gateway.admission.routing.prefix_index import PrefixIndex
    from gateway.admission.routing.prefix_route import GroupLoads, Held, by_prefix

    prompt = list(range(400))  # 25 blocks of 16
    holder = EventsView(connected=True)
    holder.blocks.apply([stored(prompt, hashes=list(range(25)), size=16)])
    a, b = SimpleNamespace(name="a", block_size=16), SimpleNamespace(name="b", block_size=16)

    def pick(events: dict[str, EventsView]) -> str:
        # a is 70% full of other tenants' requests, b idle: past the floor, over the mean
        ranked = [candidate(0.0, 1, b), candidate(0.7, 0, a)]
        held = Held(PrefixIndex(), [b"first"], events=events, token_ids=prompt)
        best = by_prefix(ranked, tokens=420, prefix=[b"first"], session=None, held=held,
                  loads=GroupLoads(), target_fill=0.9)  # fmt: skip
        return str(ranked[best].backend.name)

    assert pick({"a": holder, "b": EventsView(connected=True)}) == "a"
    holder.blocks.apply([Removed(list(range(5, 25)))])  # a fifth of it left: a prefill
    assert pick({"a": holder, "b": EventsView(connected=True)}) == "b"


def candidate(fill: float, place: int, backend: object) -> Candidate:
    """A backend of capacity 1,000 and limit 900 at `fill`, as routing weighs it."""
    return Candidate(fill, place, backend, 900, 1000, fill, 0, 0)  # type: ignore[arg-type]
