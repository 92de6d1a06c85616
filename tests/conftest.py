from collections.abc import Iterator

import pytest

from loadtest.harness import RedisProcess


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    """A private redis-server on a free port, for one test."""
    with RedisProcess() as proc:
        yield proc
