"""Turn a FinetuneJob document into a validated model, or into one clear line per problem.

Three layers, all pure:
1. the pydantic model (types, bounds, enums, unknown fields, cross-field rules mirrored in CEL);
2. `fit_issues`: does the spec fit the instance type (GPUs, EFA interfaces, CPU/memory allocatable)?
3. warnings for things that only work for `finetune run` (relative paths).
Every message starts with the field path (`spec.cluster.workers.gpusPerWorker: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from .. import instance_types as it
from . import quantity
from .spec import FinetuneJob, FinetuneJobSpec
from .storage import is_local_path


@dataclass(frozen=True)
class Issue:
    path: str
    message: str
    severity: str = "error"  # or "warning"

    def __str__(self) -> str:
        prefix = "" if self.severity == "error" else "warning: "
        return f"{prefix}{self.path}: {self.message}"


class SpecError(Exception):
    """A FinetuneJob that cannot be accepted; `issues` holds one entry per problem."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        super().__init__("; ".join(str(i) for i in issues))


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_FRIENDLY = {
    "extra_forbidden": "unknown field (check the spelling; see `kubectl explain ftj.spec`)",
    "missing": "required field is missing",
}


def issues_from_validation_error(err: ValidationError, root: str = "") -> list[Issue]:
    issues = []
    for e in err.errors(include_url=False):
        path = _loc(tuple(e["loc"]))
        msg = _FRIENDLY.get(e["type"], e["msg"])
        if e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            # Cross-field validators name the field relative to where they sit: "sub.field: rule".
            head, sep, rest = msg.partition(": ")
            if sep and " " not in head:
                path = f"{path}.{head}" if path else head
                msg = rest
        elif e["type"] == "enum":
            msg = f"{msg} (got {e.get('input')!r})"
        full = ".".join(p for p in (root, path) if p)
        issues.append(Issue(full or "(document)", msg))
    return issues


def fit_issues(spec: FinetuneJobSpec) -> list[Issue]:
    """Rules that need the instance-type table (the API server cannot check these)."""
    c = spec.cluster
    w = c.workers
    out: list[Issue] = []
    inst = it.lookup(c.instance_type)
    if inst is None:
        known = ", ".join(sorted(it.INSTANCE_TYPES))
        return [Issue("spec.cluster.instanceType", f"unknown instance type {c.instance_type!r} (known: {known})")]
    if w.gpus_per_worker > inst.gpus:
        have = f"{inst.gpus} x {inst.gpu_model}" if inst.gpus else "no GPUs"
        out.append(
            Issue(
                "spec.cluster.workers.gpusPerWorker",
                f"{w.gpus_per_worker} GPUs per worker do not fit {inst.name} ({have}); one worker pod runs on one node",
            )
        )
    if spec.network.efa and inst.efa_interfaces == 0:
        out.append(Issue("spec.network.efa", f"{inst.name} has no EFA interfaces; set network.efa: false"))
    if c.efa_interfaces_per_worker is not None:
        if not spec.network.efa and c.efa_interfaces_per_worker > 0:
            out.append(Issue("spec.cluster.efaInterfacesPerWorker", "has no effect with network.efa: false"))
        elif c.efa_interfaces_per_worker > inst.efa_interfaces:
            out.append(
                Issue(
                    "spec.cluster.efaInterfacesPerWorker",
                    f"{c.efa_interfaces_per_worker} EFA interfaces do not fit {inst.name} ({inst.efa_interfaces})",
                )
            )
        elif spec.network.efa and c.efa_interfaces_per_worker == 0:
            out.append(
                Issue("spec.cluster.efaInterfacesPerWorker", "must be at least 1 with network.efa: true")
            )
    res = worker_resources(spec)
    if res is not None:
        cpu, mem_gib, huge_gib, shm_gib = res
        alloc_cpu = inst.allocatable_cpu_millis / 1000
        alloc_mem = inst.allocatable_memory_mib / 1024
        if cpu > alloc_cpu:
            out.append(
                Issue("spec.cluster.workers.cpu", f"{cpu:g} CPUs exceed {inst.name}'s allocatable {alloc_cpu:g}")
            )
        if mem_gib + huge_gib > alloc_mem:
            out.append(
                Issue(
                    "spec.cluster.workers.memory",
                    f"{mem_gib:g}Gi (+{huge_gib:g}Gi hugepages) exceeds {inst.name}'s allocatable {alloc_mem:.1f}Gi",
                )
            )
        if shm_gib > mem_gib:
            out.append(
                Issue("spec.cluster.workers.shmSize", f"{shm_gib:g}Gi exceeds the worker memory {mem_gib:g}Gi")
            )
    return out


def worker_resources(spec: FinetuneJobSpec) -> tuple[float, float, float, float] | None:
    """(cpu, memory GiB, hugepages GiB, /dev/shm GiB) of one worker pod, defaults resolved."""
    inst = it.lookup(spec.cluster.instance_type)
    if inst is None:
        return None
    w = spec.cluster.workers
    cpu = float(quantity.parse(w.cpu)) if w.cpu else float(inst.default_worker_cpu)
    mem = quantity.gib(w.memory) if w.memory else float(inst.default_worker_memory_gib)
    huge = quantity.gib(w.hugepages2_mi) if spec.network.efa else 0.0
    shm = quantity.gib(w.shm_size) if w.shm_size else min(mem / 4, 64.0)
    return cpu, mem, huge, shm


def local_only_warnings(spec: FinetuneJobSpec) -> list[Issue]:
    out = []
    for path, value in (
        ("spec.model.source", spec.model.source),
        ("spec.dataset.source", spec.dataset.source),
        ("spec.training.checkpoint.storageUri", spec.training.checkpoint.storage_uri),
    ):
        if value and is_local_path(value) and not value.startswith("/"):
            out.append(
                Issue(
                    path,
                    "relative path: only `finetune run` on this machine can use it; Ray pods cannot "
                    "(use s3://, pvc:// or an absolute path the pods mount)",
                    severity="warning",
                )
            )
    return out


def parse_job(doc: Any) -> FinetuneJob:
    """Validate one document; raises SpecError listing every problem."""
    if not isinstance(doc, dict):
        raise SpecError([Issue("(document)", "expected a mapping with apiVersion, kind, metadata and spec")])
    try:
        job = FinetuneJob.model_validate(doc)
    except ValidationError as err:
        raise SpecError(issues_from_validation_error(err)) from None
    errors = fit_issues(job.spec)
    if errors:
        raise SpecError(errors)
    return job


def check(doc: Any) -> tuple[FinetuneJob | None, list[Issue]]:
    """Everything `finetune validate` reports: (job or None, errors + warnings)."""
    try:
        job = parse_job(doc)
    except SpecError as err:
        return None, err.issues
    return job, local_only_warnings(job.spec)


def load_documents(text: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([Issue("(document)", f"{where}not valid YAML ({getattr(err, 'problem', err)})")]) from None
