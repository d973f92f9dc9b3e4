"""Rendering the shipped examples as the operator does (the golden files, test_render.py; the CRD's
examples, test_crd.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune_operator.api import instance_types as it
from finetune_operator.api.validation import parse_job
from finetune_operator.render.config import RenderConfig
from finetune_operator.render.rayjob import render_children

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# A fixed stand-in for the training source so golden files do not churn with every runtime edit;
# the real bundle is tested in test_bundle.py.
FAKE_RUNTIME = {"finetune_training/__init__.py": "# runtime\n", "finetune_operator/api/spec.py": "# api\n"}
CFG = RenderConfig(progress_url="http://finetune-operator.finetune-system.svc:8080")

# examples/local-cluster.yaml runs on the dev cluster's real node, whose instance type the operator takes
# from the node itself (a 2-core, 24 GiB machine with the simulated GPUs/EFA of the fake device plugin).
REAL_NODE = {
    "metadata": {"name": "real-node-0", "labels": {"node.kubernetes.io/instance-type": "local-real"}},
    "status": {"allocatable": {"cpu": "2", "memory": "24Gi", "nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"}},
}


def render_example(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """An example's children as the operator renders them (with CFG); the real node's `local-real` type
    gets the figures the operator would take from that node."""
    cfg = CFG
    if doc["spec"].get("cluster", {}).get("instanceType") == "local-real":
        real = it.from_node(REAL_NODE)
        assert real is not None
        cfg = RenderConfig(progress_url=CFG.progress_url, instance_types=it.merged(it.INSTANCE_TYPES, {"local-real": real}))
    return render_children(parse_job(doc, cfg.instance_types), FAKE_RUNTIME, cfg)
