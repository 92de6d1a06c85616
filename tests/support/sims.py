"""One simulated vLLM and the official `openai` client on it, for tests of the simulator's
own API (a test module wraps each in a fixture of the scope it needs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai

from loadtest.sim.app import create_sim_app
from loadtest.sim.config import SimConfig
from tests.support.harness import ServerThread


@contextlib.contextmanager
def quick_sim(model: str) -> Iterator[ServerThread]:
    """A simulated vLLM serving `model` at 200x real time: 4,096 KV tokens, a context of
    2,048."""
    config = SimConfig(model=model, kv_tokens=4096, max_model_len=2048, speed=200.0)
    with ServerThread(create_sim_app(config)) as server:
        yield server


@contextlib.contextmanager
def openai_client(sim: ServerThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", timeout=10, max_retries=0) as c:
        yield c
