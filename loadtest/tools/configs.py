"""The tools' configs for one arm: the templates in `configs/` with the target filled in.

Each template is a complete workload a user can run by hand; the runner changes only what
differs between arms (where to send, the model's name there, the key, the seed, where the
results go) and, when asked, the rate and the duration.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.real_vllm import MODEL_DIR
from loadtest.tools import CONFIGS, venv

WORKLOADS = ("steady", "shared-prefix")


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where an arm sends: a backend (its served model name, no key) or the gateway (a pool
    name and a tenant's key)."""

    url: str
    model: str
    api_key: str | None = None


def template(tool: str, workload: str) -> dict[str, Any]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; one of {', '.join(WORKLOADS)}")
    data = yaml.safe_load((CONFIGS / f"{tool}-{workload}.yaml").read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{tool}-{workload}.yaml is not a mapping")
    return data


def guidellm_scenario(
    base: dict[str, Any],
    target: Target,
    *,
    out: Path,
    seed: int,
    rate: float | None = None,
    duration_s: int | None = None,
    tokenizer: Path = MODEL_DIR,
) -> dict[str, Any]:
    scenario = copy.deepcopy(base)
    spec = scenario["spec"]
    spec["backend"].update(target=target.url, model=target.model)
    spec["backend"].pop("api_key", None)
    if target.api_key is not None:
        spec["backend"]["api_key"] = target.api_key
    spec["tokenizer"]["model"] = str(tokenizer)
    spec["seed"] = {"kind": "static", "value": seed}
    spec["outputs"] = [{"kind": "json", "path": str(out / "guidellm.json")}]
    if rate is not None:
        spec["profile"]["rate"] = [rate]
    if duration_s is not None:
        for constraint in spec["constraints"]:
            if constraint["kind"] == "max_duration":
                constraint["seconds"] = duration_s
    return scenario


def inference_perf_config(
    base: dict[str, Any],
    target: Target,
    *,
    out: Path,
    seed: int,
    rate: float | None = None,
    duration_s: int | None = None,
    tokenizer: Path = MODEL_DIR,
) -> dict[str, Any]:
    config = copy.deepcopy(base)
    config["server"].update(base_url=target.url, model_name=target.model)
    config["server"].pop("api_key", None)
    if target.api_key is not None:
        config["server"]["api_key"] = target.api_key
    config["tokenizer"]["pretrained_model_name_or_path"] = str(tokenizer)
    config["load"]["base_seed"] = seed
    if "shared_prefix" in config["data"]:
        config["data"]["shared_prefix"]["seed"] = seed
    config["storage"] = {"local_storage": {"path": str(out / "inference-perf")}}
    for stage in config["load"]["stages"]:
        if rate is not None:
            stage["rate"] = rate
        if duration_s is not None:
            stage["duration"] = duration_s
    return config


def write(
    tool: str,
    workload: str,
    target: Target,
    *,
    out: Path,
    seed: int,
    rate: float | None = None,
    duration_s: int | None = None,
    tokenizer: Path = MODEL_DIR,
) -> list[str]:
    """Write the arm's config into `out`; return the command that runs the tool on it."""
    out.mkdir(parents=True, exist_ok=True)
    base = template(tool, workload)
    options: dict[str, Any] = dict(
        out=out, seed=seed, rate=rate, duration_s=duration_s, tokenizer=tokenizer
    )
    if tool == "guidellm":
        path = out / "guidellm-scenario.yaml"
        path.write_text(yaml.safe_dump(guidellm_scenario(base, target, **options)))
        bin_ = venv(tool) / "bin" / "guidellm"
        return [str(bin_), "run", "--scenario", str(path), "--disable-console-interactive"]
    if tool == "inference-perf":
        path = out / "inference-perf.yaml"
        path.write_text(yaml.safe_dump(inference_perf_config(base, target, **options)))
        return [str(venv(tool) / "bin" / "inference-perf"), "--config_file", str(path)]
    raise ValueError(f"unknown tool {tool!r}")
