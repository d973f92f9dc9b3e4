"""Is the installed KubeRay new enough for the RayJobs the operator renders? Checked once at start.

What is checked is the RayJob CRD the API server serves (`rayjobs.ray.io`, version v1), not KubeRay's
Deployment: the CRD is what every RayJob is validated and pruned against, it is cluster-scoped under one
well-known name (the operator may already read CRDs: kopf needs that), while the Deployment's namespace,
name, labels and image tag depend on how KubeRay was installed (Helm release names, mirrored images,
digests) and reading it would need RBAC in a namespace the operator does not know. A CRD older than the
render loses the fields it does not know (the API server prunes them): with KubeRay < v1.5.0,
`spec.deletionStrategy` arrives empty and KubeRay fails every RayJob (`ValidationFailed`).
"""

from __future__ import annotations

from typing import Any

from .k8s import Kube

Obj = dict[str, Any]
CRDS = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
RAYJOB_CRD = "rayjobs.ray.io"
MIN_KUBERAY = "v1.5.0"  # spec.deletionStrategy.deletionRules (the render's TTL and cleanup rules)
# Every RayJob field the render sets (render/rayjob.py; tests/unit/test_kuberay_version.py checks the
# golden RayJobs use no other top-level spec field), with the deletion rules' own fields.
RENDERED_FIELDS = (
    "spec.entrypoint",
    "spec.runtimeEnvYAML",
    "spec.submissionMode",
    "spec.shutdownAfterJobFinishes",
    "spec.ttlSecondsAfterFinished",
    "spec.activeDeadlineSeconds",
    "spec.backoffLimit",
    "spec.suspend",
    "spec.submitterPodTemplate",
    "spec.rayClusterSpec",
    "spec.deletionStrategy.deletionRules",
)


def missing_fields(crd: Obj, version: str = "v1") -> list[str]:
    """The RENDERED_FIELDS the CRD's schema for `version` does not have (all of them if it has no such
    version); none below a field that keeps unknown fields."""
    served = next((v for v in (crd.get("spec") or {}).get("versions") or [] if v.get("name") == version), None)
    if served is None:
        return list(RENDERED_FIELDS)
    root = ((served.get("schema") or {}).get("openAPIV3Schema")) or {}
    missing = []
    for path in RENDERED_FIELDS:
        node: Obj | None = root
        for part in path.split("."):
            if node is None or node.get("x-kubernetes-preserve-unknown-fields"):
                break
            if node.get("type") == "array":
                node = node.get("items") or {}
            node = (node.get("properties") or {}).get(part)
        if node is None:
            missing.append(path)
    return missing


def check(kube: Kube) -> tuple[bool | None, str]:
    """(True: new enough / False: too old / None: could not tell, what to log). Never raises."""
    try:
        crd = kube.get(CRDS, None, RAYJOB_CRD)
    except Exception as err:  # an API error, a connection refused: the check could not tell
        return None, f"could not read CRD {RAYJOB_CRD} to check KubeRay's version: {err}"
    if crd is None:
        return False, (f"CRD {RAYJOB_CRD} is not installed: install KubeRay {MIN_KUBERAY} or newer "
                       "(its CRDs and its operator)")
    missing = missing_fields(crd)
    if missing:
        return False, (f"the installed KubeRay is older than {MIN_KUBERAY}: its RayJob CRD ({RAYJOB_CRD}, v1) "
                       f"lacks {', '.join(missing)}, which every RayJob this operator renders sets (the API "
                       f"server drops them and KubeRay rejects the RayJob); upgrade KubeRay's CRDs and operator "
                       f"to {MIN_KUBERAY} or newer")
    return True, f"KubeRay's RayJob CRD has every field the operator renders (KubeRay {MIN_KUBERAY} or newer)"
