from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness import RedisProcess


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    """A private redis-server on a free port, for one test."""
    with RedisProcess() as proc:
        yield proc


# Output captured from a real vLLM 0.32 server (the CPU build, a tiny model).
VLLM_FIXTURES = Path(__file__).resolve().parent / "fixtures"
