"""A renderer of the kustomize features deploy/kubernetes uses, for machines without kubectl: resources (files
and folders), components, `labels` (metadata only), `images` and JSON 6902 patches with a kind/name target.
Anything else in a kustomization is refused, so that a manifest cannot quietly need more than this renders.
Where kubectl is installed, a test checks that both render the same objects."""

from __future__ import annotations

import copy
import os

import jsonpatch
import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "labels", "images", "patches"}


def render(folder: str) -> list[dict]:
    """The objects `kubectl kustomize folder` prints."""
    return _build(folder, component=False)


def _build(folder: str, component: bool, objects: list[dict] | None = None) -> list[dict]:
    kustomization = _load_kustomization(folder)
    expected = "Component" if component else "Kustomization"
    if kustomization.get("kind", "Kustomization") != expected:
        raise ValueError(f"{folder}: a {kustomization.get('kind')} where a {expected} belongs")
    own = []
    for entry in kustomization.get("resources", []):
        path = os.path.normpath(os.path.join(folder, entry))
        own += _build(path, component=False) if os.path.isdir(path) else _load_objects(path)
    for label in kustomization.get("labels", []):  # without includeSelectors/includeTemplates: metadata only
        if set(label) - {"pairs"}:
            raise ValueError(f"{folder}: labels options {set(label) - {'pairs'}} are not rendered here")
        for obj in own:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    objects = (objects or []) + own
    for entry in kustomization.get("components", []):
        objects = _build(os.path.normpath(os.path.join(folder, entry)), component=True, objects=objects)
    for patch in kustomization.get("patches", []):
        objects = [_patched(obj, patch, folder) for obj in objects]
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _load_kustomization(folder: str) -> dict:
    with open(os.path.join(folder, "kustomization.yaml"), encoding="utf-8") as f:
        kustomization = yaml.safe_load(f)
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{folder}/kustomization.yaml: {sorted(unknown)} are not rendered here")
    return kustomization


def _load_objects(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [obj for obj in yaml.safe_load_all(f) if obj]


def _patched(obj: dict, patch: dict, folder: str) -> dict:
    target = patch["target"]
    if set(target) - {"kind", "name"} or "path" in patch:
        raise ValueError(f"{folder}: only inline patches with a kind/name target are rendered here")
    if obj.get("kind") != target.get("kind", obj.get("kind")) or \
            obj["metadata"]["name"] != target.get("name", obj["metadata"]["name"]):
        return obj
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise ValueError(f"{folder}: only JSON 6902 patches (a list of operations) are rendered here")
    return jsonpatch.apply_patch(copy.deepcopy(obj), ops)


def _set_image(obj: dict, image: dict) -> None:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
