"""Generate the FinetuneJob CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema 2020-12 with `$ref`s; a CRD needs a *structural* OpenAPI v3.0 schema:
everything inlined, `type` on every node, no `anyOf` for optionals, boolean `exclusiveMinimum`,
no `additionalProperties` beside `x-kubernetes-preserve-unknown-fields`. The output is deterministic
(sorted keys) so `finetune crd | diff - crds/finetune.dev_finetunejobs.yaml` detects drift.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from . import spec as s
from .status import FinetuneJobStatus

CRD_FILENAME = "finetune.dev_finetunejobs.yaml"

Schema = dict[str, Any]


def _resolve(node: Any, defs: dict[str, Schema]) -> Any:
    if isinstance(node, list):
        return [_resolve(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = node["allOf"][0]
        merged = {**_resolve(inner, defs), **{k: v for k, v in node.items() if k != "allOf"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Any, *, keep_defaults: bool) -> Any:
    if isinstance(node, list):
        return [_structural(x, keep_defaults=keep_defaults) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    node.pop("title", None)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        options = [o for o in any_of if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {any_of!r} structurally")
        node = {**options[0], **node}
        node.pop("title", None)
        if node.get("default", "absent") is None:
            node.pop("default")
    if node.get("default", "absent") is None:
        node.pop("default")
    if not keep_defaults:
        node.pop("default", None)
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node.pop("additionalProperties", None)
        node.pop("properties", None)
    if node.get("additionalProperties") is False:
        # extra="forbid": structural schemas may not say so; the API server prunes unknown fields and
        # kubectl's strict field validation reports them. `finetune validate` rejects them outright.
        node.pop("additionalProperties")
    if node.get("additionalProperties") is True:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {p: _structural(v, keep_defaults=keep_defaults) for p, v in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, keep_defaults=keep_defaults)
        else:
            out[key] = value
    # A nested object whose fields all have defaults gets a default of its own (pydantic emits none for
    # default_factory fields), so the API server fills it in when the user omits it. The default is
    # written out in full, not `{}`: CEL rules on the object are checked against the default itself.
    if keep_defaults and out.get("properties"):
        for name, prop in out["properties"].items():
            if (
                prop.get("type") == "object"
                and "properties" in prop
                and "default" not in prop
                and not prop.get("required")
                and name not in out.get("required", [])
            ):
                prop["default"] = {
                    k: copy.deepcopy(v["default"]) for k, v in sorted(prop["properties"].items()) if "default" in v
                }
    return out


def _schema_of(model: type, *, keep_defaults: bool) -> Schema:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs), keep_defaults=keep_defaults)  # type: ignore[no-any-return]


def spec_schema() -> Schema:
    return _schema_of(s.FinetuneJobSpec, keep_defaults=True)


def status_schema() -> Schema:
    schema = _schema_of(FinetuneJobStatus, keep_defaults=False)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {"name": "Step", "type": "string", "jsonPath": ".status.step", "description": "Training step (n/total)."},
    {"name": "Loss", "type": "number", "jsonPath": ".status.training.loss", "description": "Training loss."},
    {
        "name": "Network",
        "type": "string",
        "jsonPath": ".status.network.transport",
        "description": "What carries inter-node collectives (efa, socket, gloo).",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


# metadata.name becomes the RayJob's name, and KubeRay derives Service and pod names from it: it must be
# a DNS-1035 label (no dots, starts with a letter), and at most 47 characters (KubeRay's RayJob limit).
# The API server only checks the generic DNS-1123 subdomain rule for custom resources.
NAME_RULES = [
    {
        "rule": f"self.metadata.name.matches('{s.DNS1035}')",
        "message": (
            "metadata.name: must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter "
            "and ending with a letter or digit; no '.'), because it names the RayJob and its Services"
        ),
    },
    {
        "rule": "self.metadata.name.size() <= 47",
        "message": "metadata.name: at most 47 characters (KubeRay's RayJob name limit)",
    },
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{s.PLURAL}.{s.GROUP}",
            "labels": {"app.kubernetes.io/name": "finetune-operator", "app.kubernetes.io/part-of": "finetune-operator"},
        },
        "spec": {
            "group": s.GROUP,
            "names": {
                "kind": s.KIND,
                "listKind": f"{s.KIND}List",
                "plural": s.PLURAL,
                "singular": s.SINGULAR,
                "shortNames": list(s.SHORT_NAMES),
                "categories": ["all", "finetune"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": s.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": (
                                "FinetuneJob fine-tunes a language model with PyTorch FSDP on a KubeRay cluster "
                                "of EFA-connected GPU nodes."
                            ),
                            "required": ["spec"],
                            "x-kubernetes-validations": NAME_RULES,
                            "properties": {
                                "apiVersion": {"type": "string", "description": "finetune.dev/v1alpha1"},
                                "kind": {"type": "string", "description": "FinetuneJob"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `finetune crd` from operator/finetune_operator/api/*.py. Do not edit.\n"
    return header + str(yaml.safe_dump(build_crd(), sort_keys=True, width=120))
