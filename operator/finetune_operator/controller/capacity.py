"""Preflight: are there enough nodes of the requested instance type for the worker pods? Pure.

One worker pod needs one node (it holds the node's GPUs and EFA interfaces), so the question is how
many Ready, schedulable nodes of the instance type have allocatable GPUs/EFA/CPU/memory for one pod.
The answer is a condition, not a gate: capacity can appear later (cluster autoscaler, Karpenter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..api import instance_types as it
from ..api import quantity
from ..api.spec import FinetuneJobSpec
from ..api.validation import Table, worker_resources
from ..render.rayjob import EFA, GPU, HUGEPAGES, INSTANCE_LABEL


@dataclass(frozen=True)
class Capacity:
    fits: bool
    reason: str
    message: str
    fitting_nodes: int


def _ready(node: dict[str, Any]) -> bool:
    if node.get("spec", {}).get("unschedulable"):
        return False
    for cond in node.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _alloc(node: dict[str, Any], resource: str) -> float:
    value = (node.get("status", {}).get("allocatable") or {}).get(resource)
    return float(quantity.parse(str(value))) if value is not None else 0.0


def worker_request(spec: FinetuneJobSpec, table: Table | None = None) -> dict[str, float]:
    """What one worker pod asks for, in plain numbers (CPUs, bytes, devices)."""
    res = worker_resources(spec, table)
    inst = it.lookup(spec.cluster.instance_type, table)
    if res is None or inst is None:
        return {}
    cpu, mem_gib, huge_gib, _ = res
    need = {"cpu": cpu, "memory": mem_gib * 2**30}
    if spec.cluster.workers.gpus_per_worker:
        need[GPU] = float(spec.cluster.workers.gpus_per_worker)
    if spec.network.efa:
        efa = spec.cluster.efa_interfaces_per_worker
        need[EFA] = float(inst.efa_interfaces if efa is None else efa)
        need[HUGEPAGES] = huge_gib * 2**30
    return need


def check_capacity(spec: FinetuneJobSpec, nodes: list[dict[str, Any]], table: Table | None = None) -> Capacity:
    wanted = spec.cluster.workers.replicas
    itype = spec.cluster.instance_type
    need = worker_request(spec, table)
    typed = [n for n in nodes if (n.get("metadata", {}).get("labels") or {}).get(INSTANCE_LABEL) == itype]
    selector = spec.cluster.node_selector
    typed = [n for n in typed if all((n["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
    ready = [n for n in typed if _ready(n)]
    short: dict[str, int] = {}
    fitting = 0
    for node in ready:
        missing = [r for r, amount in need.items() if _alloc(node, r) < amount]
        for r in missing:
            short[r] = short.get(r, 0) + 1
        if not missing:
            fitting += 1
    if fitting >= wanted:
        return Capacity(True, "NodesAvailable", f"{fitting} {itype} node(s) can each hold a worker pod; {wanted} needed", fitting)
    want = ", ".join(f"{_fmt(r, v)} {r}" for r, v in sorted(need.items()))
    detail = f"{len(typed)} {itype} node(s) found, {len(ready)} Ready"
    if short:
        detail += "; too little allocatable " + ", ".join(f"{r} on {c}" for r, c in sorted(short.items()))
    reason = "NoMatchingNodes" if not typed else "InsufficientNodes"
    return Capacity(
        False,
        reason,
        f"{wanted} worker pod(s) need {wanted} {itype} node(s) with {want} allocatable each; "
        f"{fitting} fit ({detail}). Waiting for capacity (e.g. from the cluster autoscaler).",
        fitting,
    )


def _fmt(resource: str, value: float) -> str:
    if resource in ("memory", HUGEPAGES):
        return f"{value / 2**30:g}Gi"
    return f"{value:g}"
