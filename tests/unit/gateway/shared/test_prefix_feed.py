"""What replicas tell each other of their prefix indexes (gateway/shared/prefix_feed.py):
only the blocks a route taught the index, in batches that survive the trip and are checked
on the way in."""

from collections.abc import Sequence

from gateway.admission.routing.prefix_index import CHARS_PER_TOKEN, PrefixIndex, block_keys
from gateway.shared.prefix_feed import PrefixFeed, decode, encode

BLOCK = 16


def keys_of(text: str) -> tuple[bytes, ...]:
    return block_keys(text.encode(), block_size=BLOCK)


SYSTEM = "s" * (BLOCK * CHARS_PER_TOKEN * 4)  # four whole blocks


def test_routing_returns_only_the_blocks_the_index_did_not_expect_there() -> None:
    index = PrefixIndex()
    first = keys_of(SYSTEM + "a" * BLOCK * CHARS_PER_TOKEN)
    assert index.routed("b0", first, session=None) == first
    second = keys_of(SYSTEM + "b" * BLOCK * CHARS_PER_TOKEN)
    assert index.routed("b0", second, session=None) == second[4:]  # the system prompt is known
    assert index.routed("b1", second, session=None) == second  # not on another backend
    assert index.routed("b0", second, session=None) == ()


def test_learned_blocks_match_but_count_in_no_hit_rate() -> None:
    index = PrefixIndex()
    keys = keys_of(SYSTEM)
    index.learn("b0", keys)
    assert (index.matched("b0", keys), index.matched("b1", keys)) == (4, 0)
    assert index.hit_rate("b0") is None


def test_a_batch_survives_encoding_and_bad_ones_are_refused() -> None:
    keys = list(keys_of(SYSTEM))
    data = encode("r1", {("chat", "b0"): keys, ("chat", "b1"): keys[:1]})
    assert decode(data) == ("r1", [("chat", "b0", keys), ("chat", "b1", keys[:1])])
    assert b"sss" not in data  # digests of the prompt travel, never its text
    for bad in (b"", b"{}", b"[1]", b'{"replica": "r", "groups": [["p", "b", "abc"]]}',
                b'{"replica": "r", "groups": [["p", "b", "zz"]]}', b"\xff"):  # fmt: skip
        assert decode(bad) is None


class Recorder:
    def __init__(self) -> None:
        self.heard: list[tuple[str, str, list[bytes]]] = []

    def prefix_routed_elsewhere(self, pool: str, backend: str, keys: Sequence[bytes]) -> None:
        self.heard.append((pool, backend, list(keys)))


def test_a_replica_learns_from_the_others_and_skips_its_own() -> None:
    recorder = Recorder()
    feed = PrefixFeed(None, learner=recorder, replica_id="me", timeout_s=1)  # type: ignore[arg-type]
    keys = list(keys_of(SYSTEM))
    feed.deliver(encode("me", {("chat", "b0"): keys}))
    feed.deliver(b"not json")
    assert recorder.heard == []
    feed.deliver(encode("other", {("chat", "b0"): keys}))
    assert recorder.heard == [("chat", "b0", keys)]
