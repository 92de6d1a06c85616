"""The load generator's HTTP client: chunked bodies taken apart in pieces of any size."""

from __future__ import annotations

import pytest

from loadtest.loadgen.http import Dechunker, HttpError

BODY = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n"


def test_a_body_fed_at_once_or_a_byte_at_a_time_decodes_the_same() -> None:
    whole = Dechunker()
    assert whole.feed(BODY) == b"hello, world" and whole.done and not whole.leftover
    bytewise = Dechunker()
    pieces = [bytewise.feed(BODY[i : i + 1]) for i in range(len(BODY))]
    assert b"".join(pieces) == b"hello, world" and bytewise.done
    # each piece gives what it completed: the payload as it arrives, nothing held back
    assert pieces[:8] == [b"", b"", b"", b"h", b"e", b"l", b"l", b"o"]


def test_the_end_of_the_body_is_found_and_bytes_after_it_are_noted() -> None:
    decoder = Dechunker()
    assert decoder.feed(b"3\r\nabc\r\n") == b"abc" and not decoder.done
    assert decoder.feed(b"0\r\n\r\nHTTP/1.1") == b"" and decoder.done and decoder.leftover


def test_a_malformed_body_is_an_http_error() -> None:
    with pytest.raises(HttpError, match="bad chunk size line"):
        Dechunker().feed(b"zz\r\n")
    with pytest.raises(HttpError, match="did not end with CRLF"):
        Dechunker().feed(b"1\r\naXY")
