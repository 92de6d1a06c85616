"""A real vLLM (the CPU build, a tiny random Llama) started by this folder's scripts.

`setup.sh` builds its virtualenv (minutes, once); `serve.sh` starts the server and prints
its PID once `/v1/models` answers. Used by `make test-vllm` and
`spillgate bench admission --real-vllm`; never by `make test`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

SCRIPTS = Path(__file__).resolve().parent
MODEL = "tiny"
BYTES_PER_TOKEN = 1024  # the tiny Llama's KV in bf16: 2 layers x 2 heads x 64 dims x K,V x 2 B
# Random weights almost never emit EOS. Sixteen ids of the ~4,096-token vocabulary stop each
# token with a chance of about 1/256: answers of geometric length (mean ~260, p50 ~170,
# p90 ~530 tokens under max_tokens 2048), the same ones again for the same `seed`.
STOP_TOKEN_IDS = tuple(range(8, 24))
MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", "/tmp/spillgate-tiny-llama"))
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
SETUP_TIMEOUT_S = 3600.0
START_TIMEOUT_S = 420.0


@dataclass(frozen=True, kw_only=True)
class RealVllm:
    port: int = 8101
    kv_tokens: int = 16_384
    max_model_len: int = 4096
    # the core its CPU worker is bound to: vLLM binds every server to core 0, so a second
    # server on the same machine needs another (VLLM_CPU_OMP_THREADS_BIND)
    cores: str | None = None
    # the whole server on `cores`, not only its worker: its engine process polls the worker
    # flat out while it generates, and would otherwise take the other cores' time
    confined: bool = False
    # more of vLLM's options (serve.sh passes them on), such as `--enable-lora ...`
    args: tuple[str, ...] = ()
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: /v1/load_lora_adapter and its unload are served
    runtime_lora: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KV_CACHE_BYTES": str(self.kv_tokens * BYTES_PER_TOKEN),
            "MAX_MODEL_LEN": str(self.max_model_len),
            "SERVED_MODEL_NAME": MODEL,
            **({"VLLM_CPU_OMP_THREADS_BIND": self.cores} if self.cores else {}),
            **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if self.runtime_lora else {}),
        }


def install() -> None:
    """Build the vLLM virtualenv unless it is there already (minutes the first time)."""
    subprocess.run(["bash", str(SCRIPTS / "setup.sh")], check=True, timeout=SETUP_TIMEOUT_S)


def has_model(directory: Path) -> bool:
    """Whether `directory` holds every file serve.sh needs of the tiny model."""
    return all((directory / name).is_file() and (directory / name).stat().st_size
               for name in MODEL_FILES)  # fmt: skip


def model_dir(directory: Path = MODEL_DIR) -> Path:
    """The tiny model's files in `directory`, made as serve.sh makes them when some are
    missing (tiny_model.py needs only `tokenizers`): what tokenizes as the server does needs
    them before a server starts."""
    if has_model(directory):
        return directory
    from loadtest.real_vllm import tiny_model

    directory.parent.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(prefix=f"{directory.name}.tmp.", dir=directory.parent))
    try:
        tiny_model.main(str(made))
    except BaseException:  # a half-made model must not be left beside the real one
        shutil.rmtree(made, ignore_errors=True)
        raise
    shutil.rmtree(directory, ignore_errors=True)
    made.rename(directory)
    return directory


def is_up(server: RealVllm) -> bool:
    status = subprocess.run(
        ["bash", str(SCRIPTS / "serve.sh"), "status", str(server.port)],
        capture_output=True,
        timeout=30,
        env=server.env(),
    )
    return status.returncode == 0


@contextlib.contextmanager
def running(server: RealVllm) -> Iterator[str]:
    """The server's URL, started by serve.sh unless it runs already; stopped after only
    when this call started it."""
    started = not is_up(server)
    serve = ["bash", str(SCRIPTS / "serve.sh")]
    if started:
        confine = ["taskset", "-c", server.cores] if server.confined and server.cores else []
        subprocess.run(
            [*confine, *serve, str(server.port), *server.args],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=START_TIMEOUT_S,
            env=server.env(),
        )
    try:
        yield server.url
    finally:
        if started:
            subprocess.run([*serve, "stop", str(server.port)], timeout=60, env=server.env())


def reset_prefix_cache(url: str) -> bool:
    """Empty the server's prefix cache (serve.sh runs it in dev mode); False when refused."""
    try:
        response = httpx.post(f"{url}/reset_prefix_cache", timeout=10)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
