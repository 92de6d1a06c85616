"""Render a kustomization without kubectl: the subset of kustomize the manifests use.

Supported: `resources` (files and directories with their own kustomization), `namespace`,
`patches` (strategic-merge patch files, matched to a resource by kind and name) and
`images` (newName, newTag). Anything else in a kustomization is an error, so that the
manifests cannot start relying on a feature this renderer would silently ignore.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
# Strategic-merge keys of the lists the patches touch; other lists are replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


class KustomizeError(Exception):
    pass


def load_documents(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: Path) -> list[Resource]:
    """Every object the kustomization in `directory` produces, in resource order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        resources += render(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        _apply_patch(resources, directory / patch["path"], patch.get("target"), directory)
    for image in kustomization.get("images", []):
        for resource in resources:
            _set_image(resource, image)
    namespace = kustomization.get("namespace")
    if namespace:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = namespace
    return resources


def _apply_patch(
    resources: list[Resource], path: Path, target: dict[str, str] | None, directory: Path
) -> None:
    (patch,) = load_documents(path)
    kind = (target or {}).get("kind", patch["kind"])
    name = (target or {}).get("name", patch["metadata"]["name"])
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    if len(matches) != 1:
        raise KustomizeError(f"{directory}: patch {path.name} matches {len(matches)} resources")
    merged = strategic_merge(matches[0], patch)
    matches[0].clear()
    matches[0].update(merged)


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    merge_key = MERGE_KEYS.get(key)
    if merge_key and isinstance(base, list) and isinstance(patch, list):
        out_list = [copy.deepcopy(item) for item in base]
        index = {item.get(merge_key): i for i, item in enumerate(out_list)}
        for item in patch:
            if item.get(merge_key) in index:
                i = index[item[merge_key]]
                out_list[i] = strategic_merge(out_list[i], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def pod_spec(resource: Resource) -> dict[str, Any] | None:
    if resource["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        spec: dict[str, Any] = resource["spec"]["template"]["spec"]
        return spec
    return None


def _set_image(resource: Resource, image: dict[str, str]) -> None:
    spec = pod_spec(resource)
    if spec is None:
        return
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, tag = _split_image(container["image"])
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        tag = image.get("newTag", tag)
        container["image"] = f"{name}:{tag}" if tag else name


def _split_image(ref: str) -> tuple[str, str]:
    head, sep, tail = ref.rpartition(":")
    return (head, tail) if sep and "/" not in tail else (ref, "")
