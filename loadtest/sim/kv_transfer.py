"""Disaggregated prefill/decode as vLLM 0.32's KV connectors play it, without moving any KV.

Two connectors, chosen by `SimConfig.kv_transfer`:

- `params`, as NixlConnector. A request whose `kv_transfer_params` has `do_remote_decode`
  is a prefill leg: when it stops by length, its (unstreamed) answer carries the params its
  decode leg is to bring: `do_remote_prefill`, `remote_block_ids` (the blocks of the
  prompt's full blocks), `remote_engine_id`, `remote_request_id`, `remote_host` and
  `remote_port` (here the prefiller's own HTTP address, its side channel) and `tp_size`.
  A request that brings `do_remote_prefill` with `remote_block_ids` is a decode leg: the
  decoder asks the prefiller at `remote_host:remote_port` for its engine id (the side
  channel's handshake, `GET /sim/kv_engine`), and loads the prompt's full blocks short of
  its last token, at most `remote_block_ids` of them: no prefill for those tokens. The
  transfer fails when nothing answers there, or an engine of another id does: a test makes
  one fail by naming a `remote_engine_id` the prefiller does not have, or a port nothing
  listens on. Params that lack one of those keys are ignored and the prompt computed
  locally, as vLLM ignores them with a warning; params that are not an object are a 400.
- `shared`, as ExampleConnector. Every engine saves the KV of each prompt it computed into
  `kv_shared_path`: one entry per prompt, a folder named by a digest of the token ids of
  the prompt's full blocks (chained block by block, model and block size included), that
  holds `kv.json`. A prompt loads the longest entry whose blocks begin it, short of its
  last token; as in ExampleConnector, a prompt of a whole number of blocks stores them all
  but looks for one block fewer. Nothing passes between the legs. An entry whose folder is
  there but whose `kv.json` is missing or unreadable (a test deletes it) is a partial
  transfer, a failed load.

A failed load does what `kv_load_failure_policy` says: `recompute` computes the prompt
locally; `fail`, vLLM's default, kills the engine: the request gets vLLM's dead-engine error
and the replica serves no more (loadtest/sim/shutdown.py).

Not mimicked: the prefiller keeps no blocks back for its decoder (vLLM holds them until the
decoder reads them or VLLM_NIXL_ABORT_REQUEST_TIMEOUT passes), and a load costs the
handshake's round trip, not the transfer of the bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from array import array
from collections.abc import Sequence as TokenIds
from pathlib import Path
from typing import Protocol

import httpx
import orjson

from loadtest.sim.engine import LiveSequence
from loadtest.sim.scheduler import SeqState

ENGINE_ROUTE = "/sim/kv_engine"
ENTRY_FILE = "kv.json"
# vLLM's NIXL side channel when the server's own address is not known
DEFAULT_SIDE_CHANNEL = ("localhost", 5600)
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class KvLoadError(Exception):
    """A load that began and failed: what `kv_load_failure_policy` rules on."""


class KvConnector(Protocol):
    """A replica's connector, asked by the completion endpoints around each request."""

    async def matched_tokens(
        self, *, params: dict[str, object] | None, token_ids: TokenIds[int] | None, prompt: int
    ) -> int:
        """How many of the prompt's first tokens it loads instead of their prefill; raises
        KvLoadError when the load fails."""
        ...

    def request_finished(
        self,
        *,
        params: dict[str, object] | None,
        seq: LiveSequence,
        token_ids: TokenIds[int] | None,
        server: tuple[str, int] | None,
    ) -> dict[str, object] | None:
        """Called once the request is answered; returns the answer's `kv_transfer_params`."""
        ...


def loadable_tokens(prompt: int, block_size: int) -> int:
    """The prompt's full blocks short of its last token, whose logits the first sample needs."""
    return (prompt - 1) // block_size * block_size


class ParamsConnector:
    """NixlConnector's handshake: `kv_transfer_params` out of the prefill leg, into the
    decode leg."""

    def __init__(self, *, engine_id: str, block_size: int, client: httpx.AsyncClient) -> None:
        self.engine_id = engine_id
        self._block_size = block_size
        self._client = client

    async def matched_tokens(
        self, *, params: dict[str, object] | None, token_ids: TokenIds[int] | None, prompt: int
    ) -> int:
        blocks = _remote_blocks(params)
        if params is None or not blocks:
            return 0
        host, port, engine = (
            params["remote_host"],
            params["remote_port"],
            params["remote_engine_id"],
        )
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(engine, str):
            raise KvLoadError(f"cannot reach a remote engine at {host!r}:{port!r}")
        try:
            answer = await self._client.get(f"http://{host}:{port}{ENGINE_ROUTE}")
            found = answer.json().get("engine_id") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            raise KvLoadError(f"handshake with {host}:{port} failed: {exc!r}") from None
        if found != engine:
            raise KvLoadError(f"the engine at {host}:{port} is {found!r}, not {engine!r}")
        return min(blocks * self._block_size, loadable_tokens(prompt, self._block_size))

    def request_finished(
        self,
        *,
        params: dict[str, object] | None,
        seq: LiveSequence,
        token_ids: TokenIds[int] | None,
        server: tuple[str, int] | None,
    ) -> dict[str, object] | None:
        # vLLM offers the blocks only to a prefill leg that stopped by length: an answer
        # that ended by itself has nothing left to decode
        if not params or not params.get("do_remote_decode") or seq.state is not SeqState.FINISHED:
            return None
        if seq.finish_reason != "length":
            return None
        host, port = server or DEFAULT_SIDE_CHANNEL
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": seq.prompt_block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"sim-{uuid.uuid4().hex}",
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
        }


def _remote_blocks(params: dict[str, object] | None) -> int:
    """How many blocks a decode leg's params offer; 0 where they ask no load or lack a key
    (vLLM then computes locally)."""
    if not params or not params.get("do_remote_prefill"):
        return 0
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not blocks:
        return 0
    if not all(key in params for key in REMOTE_KEYS):
        return 0
    return len(blocks)


class SharedStorageConnector:
    """ExampleConnector's folder: prompts' KV saved and loaded by their tokens."""

    def __init__(self, *, path: str, model: str, block_size: int) -> None:
        self._path = Path(path)
        self._path.mkdir(parents=True, exist_ok=True)
        self._root = hashlib.blake2b(f"{model}\0{block_size}".encode(), digest_size=16).digest()
        self._block_size = block_size

    def entry_names(self, token_ids: TokenIds[int]) -> list[str]:
        """The entry name of each run of the prompt's full blocks from its start."""
        names: list[str] = []
        parent = self._root
        bs = self._block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = array("q", token_ids[start : start + bs]).tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            names.append(parent.hex())
        return names

    async def matched_tokens(
        self, *, params: dict[str, object] | None, token_ids: TokenIds[int] | None, prompt: int
    ) -> int:
        if not token_ids:
            return 0
        bs = self._block_size
        names = self.entry_names(token_ids[: loadable_tokens(prompt, bs)])
        for blocks in range(len(names), 0, -1):
            entry = self._path / names[blocks - 1]
            if entry.is_dir():
                self._load(entry, tokens=blocks * bs)
                return blocks * bs
        return 0

    def _load(self, entry: Path, *, tokens: int) -> None:
        try:
            stored = orjson.loads((entry / ENTRY_FILE).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise KvLoadError(f"incomplete KV entry {entry.name}: {exc}") from None
        if not isinstance(stored, dict) or stored.get("tokens") != tokens:
            raise KvLoadError(f"KV entry {entry.name} does not hold {tokens} tokens")

    def request_finished(
        self,
        *,
        params: dict[str, object] | None,
        seq: LiveSequence,
        token_ids: TokenIds[int] | None,
        server: tuple[str, int] | None,
    ) -> dict[str, object] | None:
        # saved once the prompt was computed, whatever became of the answer after
        if token_ids and seq.generated > 0:
            self._save(token_ids)
        return None

    def _save(self, token_ids: TokenIds[int]) -> None:
        names = self.entry_names(token_ids)
        if not names or (self._path / names[-1]).is_dir():
            return
        # written aside then renamed, so a reader never finds an entry half written
        staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=self._path))
        body = {"tokens": len(names) * self._block_size, "blocks": len(names)}
        (staging / ENTRY_FILE).write_bytes(orjson.dumps(body))
        try:
            os.rename(staging, self._path / names[-1])
        except OSError:  # another engine saved it first
            (staging / ENTRY_FILE).unlink()
            staging.rmdir()
