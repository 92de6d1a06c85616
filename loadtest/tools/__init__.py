"""Other people's load-testing tools, guidellm and inference-perf, run against Spillgate.

`setup.sh` installs each into a virtualenv of its own (never Spillgate's); `configs/` holds
their workloads; `spillgate bench tools demo|vllm|prefix` runs them direct and
through the gateway and prints one table per run from the tools' own result files
(`results.py`). Results go in BENCHMARKS.md ("Measured with guidellm and inference-perf").
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
TOOLS = ("guidellm", "inference-perf")


def venv(tool: str) -> Path:
    """Where setup.sh installs `tool` (the same environment variables)."""
    root = Path(os.environ.get("TOOLS_VENVS", "/tmp/spillgate-tools"))
    override = {"guidellm": "GUIDELLM_VENV", "inference-perf": "INFERENCE_PERF_VENV"}[tool]
    return Path(os.environ.get(override, root / tool))
