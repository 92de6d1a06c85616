import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.procs import RedisProcess

# tests/vllm/ runs against a real vLLM (`make test-vllm` starts one and names its URL here);
# without one it is not collected, so the default run never needs vLLM
collect_ignore = [] if os.environ.get("SPILLGATE_VLLM_URL") else ["vllm"]


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    """A private redis-server on a free port, for one test."""
    with RedisProcess() as proc:
        yield proc


# Output captured from a real vLLM 0.32 server (the CPU build, a tiny model).
VLLM_FIXTURES = Path(__file__).resolve().parent / "fixtures"
