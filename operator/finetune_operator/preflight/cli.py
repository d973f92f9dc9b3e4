"""`finetune preflight`: read the cluster (controller/k8s.py), check it (preflight/checks.py),
print a checklist with fixes; exit 1 if anything must be fixed before the first FinetuneJob."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

APPS_DEPLOYMENTS = ("apps", "v1", "deployments")
CRDS = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
SARS = ("authorization.k8s.io", "v1", "subjectaccessreviews")
# What the operator's ServiceAccount must be allowed (deploy/rbac.yaml), as (verb, group, resource).
OPERATOR_NEEDS = [("watch", "finetune.dev", "finetunejobs"), ("patch", "finetune.dev", "finetunejobs/status"),
                  ("create", "ray.io", "rayjobs"), ("patch", "ray.io", "rayjobs"), ("watch", "ray.io", "rayclusters"),
                  ("create", "", "configmaps"), ("list", "", "pods"), ("list", "", "nodes"), ("create", "", "events"),
                  ("create", "authentication.k8s.io", "tokenreviews")]


def register(sub: Any) -> None:
    p = sub.add_parser("preflight", help="check a cluster before the first FinetuneJob; print what to fix")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--instance-type", default="g6.12xlarge", help="instance type of the GPU nodes (default g6.12xlarge)")
    p.add_argument("--operator-namespace", default="finetune-system", help="namespace of the operator's ServiceAccount")
    p.add_argument("--operator-service-account", default="finetune-operator")
    p.add_argument("--job", type=Path, help="a FinetuneJob file: also check its tolerations and capacity")
    p.set_defaults(func=main)


def gather(kube: Any, args: argparse.Namespace) -> Any:
    from ..controller.k8s import NODES, ApiError
    from .checks import Facts

    facts = Facts(instance_type=args.instance_type,
                  operator_sa=f"system:serviceaccount:{args.operator_namespace}:{args.operator_service_account}")
    facts.nodes = kube.list_objects(NODES)
    facts.crds = {c["metadata"]["name"] for c in kube.list_objects(CRDS)}
    for dep in kube.list_objects(APPS_DEPLOYMENTS):
        for c in dep["spec"]["template"]["spec"].get("containers") or []:
            if "kuberay/operator" in c.get("image", ""):
                facts.kuberay_images.append(c["image"])
    for verb, group, resource in OPERATOR_NEEDS:
        res, _, sub = resource.partition("/")
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": facts.operator_sa, "groups": ["system:serviceaccounts",
                                                                 f"system:serviceaccounts:{args.operator_namespace}"],
                           "resourceAttributes": {"verb": verb, "group": group, "resource": res,
                                                  **({"subresource": sub} if sub else {})}}}
        try:
            out = kube.create(SARS, None, review, kind="SubjectAccessReview")
        except ApiError as err:
            print(f"preflight: cannot review the operator's RBAC ({err.message}); skipping that check", file=sys.stderr)
            facts.operator_access = {}
            break
        facts.operator_access[(verb, resource)] = bool((out.get("status") or {}).get("allowed"))
    return facts


def main(args: argparse.Namespace) -> int:
    from ..api.validation import SpecError, load_documents, parse_job
    from ..controller.k8s import ApiError, Kube, load_config
    from .checks import evaluate, render

    job = None
    if args.job:
        try:
            job = parse_job(load_documents(args.job.read_text())[0]).spec
        except (OSError, IndexError, SpecError) as err:
            print(f"{args.job}: {err}", file=sys.stderr)
            return 2
    try:
        facts = gather(Kube(load_config(args.kubeconfig)), args)
    except ApiError as err:
        print(f"preflight: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # no cluster reachable, bad kubeconfig: one line, no traceback
        print(f"preflight: cannot reach the cluster: {err}", file=sys.stderr)
        return 2
    facts.job = job
    checks = evaluate(facts)
    sys.stdout.write(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
