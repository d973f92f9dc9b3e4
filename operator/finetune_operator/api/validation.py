"""Turn a FinetuneJob document into a validated model, or into one clear line per problem.

Three layers, all pure:
1. the pydantic model (types, bounds, enums, unknown fields, cross-field rules mirrored in CEL);
2. `fit_issues`: does the spec fit the instance type (GPUs, EFA interfaces, CPU/memory allocatable)?
3. warnings for things that only work for `finetune run` (relative paths).
Every message starts with the field path (`spec.cluster.workers.gpusPerWorker: ...`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from . import env_policy, quantity
from . import instance_types as it
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


_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and not _FIELD.fullmatch(str(part)):
            out += f"[{str(part)!r}]"  # a map key (nodeSelector, labels): quoted, so the line stays one line
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


Table = Mapping[str, it.InstanceType]
UNKNOWN_TYPE_HINT = (
    f"add its figures to a ConfigMap labelled {it.PARAMS_LABEL}=true in the operator's namespace "
    "(see deploy/instance-types.yaml), or add a node of that type: the operator then takes them from the node"
)


def unknown_type_issue(name: str, table: Table | None = None) -> Issue:
    known = ", ".join(sorted(it.INSTANCE_TYPES if table is None else table))
    return Issue("spec.cluster.instanceType", f"unknown instance type {name!r} (known: {known}); {UNKNOWN_TYPE_HINT}")


class UnknownInstanceType(Exception):
    """No figures for the job's instance type anywhere: the job waits for them (never a verdict)."""


def unknown_type_message(name: str, namespace: str) -> str:
    """How an admin adds an instance type's figures (a cluster that scales from zero has no node to read)."""
    keys = ", ".join(f"{name}.{f}" for f in it.FIGURES)
    return (f"spec.cluster.instanceType: no figures for {name!r} in the built-in table, the ConfigMaps labelled "
            f"{it.PARAMS_LABEL}=true in {namespace}, or the cluster's nodes; waiting for them. Add them to such a "
            f"ConfigMap (see deploy/instance-types.yaml; keys {keys}, e.g. {name}.allocatableCPU: 47810m, "
            f"{name}.allocatableMemory: 190000Mi) and the job starts")


def fit_issues(spec: FinetuneJobSpec, table: Table | None = None) -> list[Issue]:
    """Rules that need the instance-type table (the admission policy in deploy/ checks the same ones
    against the same figures; `table` defaults to the built-in one)."""
    c = spec.cluster
    w = c.workers
    out: list[Issue] = []
    inst = it.lookup(c.instance_type, table)
    if inst is None:
        return [unknown_type_issue(c.instance_type, table)]
    if w.gpus_per_worker > inst.gpus:
        have = (f"{inst.gpus} x {inst.gpu_model}" if inst.gpu_model else f"{inst.gpus} GPUs") if inst.gpus else "no GPUs"
        if inst.source != it.BUILT_IN:
            have += f"; figures from {inst.source}"
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
    res = worker_resources(spec, table)
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


def worker_resources(spec: FinetuneJobSpec, table: Table | None = None) -> tuple[float, float, float, float] | None:
    """(cpu, memory GiB, hugepages GiB, /dev/shm GiB) of one worker pod, defaults resolved."""
    inst = it.lookup(spec.cluster.instance_type, table)
    if inst is None:
        return None
    w = spec.cluster.workers
    cpu = float(quantity.parse(w.cpu)) if w.cpu else float(inst.default_worker_cpu)
    mem = quantity.gib(w.memory) if w.memory else float(inst.default_worker_memory_gib)
    huge = quantity.gib(w.hugepages2_mi) if spec.network.efa else 0.0
    shm = quantity.gib(w.shm_size) if w.shm_size else min(mem / 4, 64.0)
    return cpu, mem, huge, shm


def env_warnings(spec: FinetuneJobSpec) -> list[Issue]:
    """Overrides of variables the operator sets that are allowed, but change what it set (docs/api.md)."""
    out = []
    for i, e in enumerate(spec.cluster.env):
        message = env_policy.warning(e.name, spec.network.efa)
        if message is not None:
            out.append(Issue(f"spec.cluster.env[{i}].name", message, severity="warning"))
    return out


def local_only_warnings(spec: FinetuneJobSpec) -> list[Issue]:
    out = env_warnings(spec)
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


def parse_model(doc: Any) -> FinetuneJob:
    """The model only (layer 1, no instance-type figures); raises SpecError listing every problem."""
    if not isinstance(doc, dict):
        raise SpecError([Issue("(document)", "expected a mapping with apiVersion, kind, metadata and spec")])
    try:
        return FinetuneJob.model_validate(doc)
    except ValidationError as err:
        raise SpecError(issues_from_validation_error(err)) from None


def parse_job(doc: Any, table: Table | None = None) -> FinetuneJob:
    """Validate one document; raises SpecError listing every problem."""
    job = parse_model(doc)
    errors = fit_issues(job.spec, table)
    if errors:
        raise SpecError(errors)
    return job


def check(doc: Any, table: Table | None = None) -> tuple[FinetuneJob | None, list[Issue]]:
    """Everything `finetune validate` reports: (job or None, errors + warnings).

    An instance type the table does not know is a warning here, not an error: the operator may know it
    (a ConfigMap in the cluster, or the cluster's nodes) even if this machine does not."""
    table = it.INSTANCE_TYPES if table is None else table
    try:
        job = FinetuneJob.model_validate(doc) if isinstance(doc, dict) else parse_job(doc)
    except ValidationError as err:
        return None, issues_from_validation_error(err)
    except SpecError as err:
        return None, err.issues
    itype = job.spec.cluster.instance_type
    if itype not in table:
        warning = Issue(
            "spec.cluster.instanceType",
            f"{itype!r} is not in the {figures_source(table)}: instance fit not checked here; {UNKNOWN_TYPE_HINT} "
            "(`finetune validate --instance-types FILE` checks against such a ConfigMap)",
            severity="warning",
        )
        return job, [warning, *local_only_warnings(job.spec)]
    errors = fit_issues(job.spec, table)
    if errors:
        return None, errors
    return job, local_only_warnings(job.spec)


def figures_source(table: Table, name: str | None = None) -> str:
    """Where the figures for `name` (or the table as a whole) come from, in words."""
    if name is not None and name in table:
        return table[name].source
    sources = sorted({t.source for t in table.values()})
    return " + ".join(sources) if sources else "empty table"


def load_documents(text: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([Issue("(document)", f"{where}not valid YAML ({getattr(err, 'problem', err)})")]) from None
