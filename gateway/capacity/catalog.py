"""Models and GPUs as data: the packaged catalog.yaml, or a Hugging Face config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


class CapacityError(ValueError):
    """A plan that cannot be made: unknown name, bad input, a model that does not fit."""


@dataclass(frozen=True, kw_only=True)
class MlaSpec:
    """Multi-head latent attention: each layer caches one latent of kv_lora_rank + rope dims."""

    kv_lora_rank: int
    qk_rope_head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    params: int
    active_params: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    experts_per_token: int = 1
    dtype: str = "bf16"
    weight_dtype: str = "bf16"
    sliding_window: int | None = None
    hybrid: bool = False
    mla: MlaSpec | None = None


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    memory_gib: float
    bandwidth_gb_s: float
    bf16_tflops: float


def _key(name: str) -> str:
    return name.strip().lower()


@dataclass(frozen=True)
class Catalog:
    models: Mapping[str, ModelSpec]
    gpus: Mapping[str, GpuSpec]
    aliases: Mapping[str, str] = field(default_factory=dict)

    def model(self, name: str) -> ModelSpec:
        found = self.models.get(self.aliases.get(_key(name), _key(name)))
        if found is None:
            known = ", ".join(sorted(self.models))
            raise CapacityError(f"unknown model {name!r}; known models: {known}")
        return found

    def gpu(self, name: str) -> GpuSpec:
        found = self.gpus.get(self.aliases.get(_key(name), _key(name)))
        if found is None:
            known = ", ".join(sorted(self.gpus))
            raise CapacityError(f"unknown GPU {name!r}; known GPUs: {known}")
        return found


def _model_from_entry(name: str, entry: Mapping[str, Any]) -> ModelSpec:
    fields = {k: v for k, v in entry.items() if k != "aliases"}
    mla = fields.pop("mla", None)
    fields.setdefault("active_params", fields["params"])
    return ModelSpec(name=name, mla=MlaSpec(**mla) if mla else None, **fields)


def load_catalog(path: Path | None = None) -> Catalog:
    """The packaged catalog, or one in the same shape at `path`."""
    if path is None:
        text = resources.files("gateway.capacity").joinpath("catalog.yaml").read_text("utf-8")
    else:
        text = path.read_text("utf-8")
    raw: dict[str, Any] = yaml.safe_load(text)
    models: dict[str, ModelSpec] = {}
    gpus: dict[str, GpuSpec] = {}
    aliases: dict[str, str] = {}
    for name, entry in raw["models"].items():
        models[_key(name)] = _model_from_entry(_key(name), entry)
        aliases.update({_key(a): _key(name) for a in entry.get("aliases", [])})
    for name, entry in raw["gpus"].items():
        fields = {k: v for k, v in entry.items() if k != "aliases"}
        gpus[_key(name)] = GpuSpec(name=_key(name), **fields)
        aliases.update({_key(a): _key(name) for a in entry.get("aliases", [])})
    return Catalog(models=models, gpus=gpus, aliases=aliases)
