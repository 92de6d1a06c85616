"""LiteLLM's proxy as a bench arm, installed into its own throwaway virtualenv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from loadtest.procs import free_port

VENV = Path(os.environ.get("SPILLGATE_LITELLM_VENV", "/tmp/spillgate-litellm-venv"))


def _install() -> Path:
    python = VENV / "bin" / "python"
    if not (VENV / "bin" / "litellm").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "litellm[proxy]"], check=True, timeout=1200
        )
    return VENV / "bin" / "litellm"


def litellm_arm(backend: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start LiteLLM's proxy in front of `backend`: one worker, no database, no callbacks."""
    litellm = _install()
    config = {
        "model_list": [
            {
                "model_name": "bench",
                "litellm_params": {
                    "model": "openai/bench-model",
                    "api_base": f"{backend}/v1",
                    "api_key": "unused",
                },
            }
        ],
        "litellm_settings": {"callbacks": [], "success_callback": [], "failure_callback": []},
        "general_settings": {"master_key": "sk-bench-key"},
    }
    path = tmp / "litellm.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    prefix = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cmd = [*prefix, str(litellm), "--config", str(path), "--port", str(port), "--num_workers", "1"]
    env = {**os.environ, "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"
