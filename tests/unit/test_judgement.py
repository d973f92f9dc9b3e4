"""A job is judged (allow-list, instance-type figures) once, before its RayJob exists (transitions.py rows 1, 23,
24): what `Reconciler._parse` decides, with the cluster's configuration stubbed (no API server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from finetune_operator.api import instance_types as it
from finetune_operator.api.policy import AllowList
from finetune_operator.api.status import InstanceFigures
from finetune_operator.api.validation import SpecError, UnknownInstanceType, parse_model
from finetune_operator.controller.reconcile import Reconciler
from finetune_operator.controller.status import Observed
from finetune_operator.render.config import RenderConfig
from finetune_operator.render.rayjob import render_rayjob

from tests.builders import StatusDoc, ftj

G6 = it.INSTANCE_TYPES["g6.12xlarge"]
FROM_NODE = it.InstanceType("g6e.12xlarge", 48, 384, 4, "", 0, 1, 0, False, 0.0, source="node n-0",
                            alloc_cpu_millis=47000, alloc_memory_mib=370000)
TIGHT = AllowList(images=("registry.example/*",), source="ConfigMap finetune-system/finetune-operator-policy")


@dataclass
class StubConfig:
    """The cluster's configuration (clusterconfig.py) as a reconcile sees it."""

    extra: dict[str, it.InstanceType] = field(default_factory=dict)
    allow: AllowList = field(default_factory=AllowList)
    namespace: str = "finetune-system"

    def instance_types(self, itype: str) -> dict[str, it.InstanceType]:
        return {**it.INSTANCE_TYPES, **self.extra}

    def allow_list(self) -> AllowList:
        return self.allow


def reconciler(config: StubConfig) -> Reconciler:
    return Reconciler(kube=None, cfg=RenderConfig(), runtime_files={}, cluster_config=config)  # type: ignore[arg-type]


def body(**spec: Any) -> dict[str, Any]:
    doc = ftj("j", **spec)
    doc["metadata"].update(namespace="ns", uid="u-1", generation=1)
    return doc


JUDGED_RUNNING = StatusDoc("Running").set("rayJobUID", "rj-1").set("instance", InstanceFigures.of(FROM_NODE).wire())
SUCCEEDED = StatusDoc("Succeeded").set("rayJobUID", "rj-1").set("instance", InstanceFigures.of(G6).wire())
G6E = {"cluster__instanceType": "g6e.12xlarge"}


@pytest.mark.parametrize(("config", "spec", "prev", "outcome"), [
    (StubConfig(), {}, StatusDoc(), "g6.12xlarge:built-in table"),
    (StubConfig(allow=TIGHT), {}, StatusDoc(), "SpecError:spec.cluster.image"),
    (StubConfig(), G6E, StatusDoc(), "Unknown"),
    (StubConfig(extra={"g6e.12xlarge": FROM_NODE}), G6E, StatusDoc(), "g6e.12xlarge:node n-0"),
    # Judged: the allow-list is tightened, the nodes of its type are gone: rendered from the recorded figures.
    (StubConfig(allow=TIGHT), G6E, JUDGED_RUNNING, "g6e.12xlarge:node n-0"),
    (StubConfig(allow=TIGHT), {}, SUCCEEDED, "g6.12xlarge:built-in table"),
    # An older status without recorded figures: looked up (and recorded), never judged.
    (StubConfig(allow=TIGHT), {}, StatusDoc("Running").set("rayJobUID", "rj-1"), "g6.12xlarge:built-in table"),
    (StubConfig(allow=TIGHT), G6E, StatusDoc("Running").set("rayJobUID", "rj-1"), "none"),
], ids=["built-in", "image-not-allowed", "unknown-type-waits", "figures-from-a-node", "judged-running-keeps-its-figures",
        "succeeded-not-judged-again", "older-status-looked-up", "older-status-figures-gone"])
def test_judged_once(config: StubConfig, spec: dict[str, Any], prev: StatusDoc, outcome: str) -> None:
    observed = Observed()
    try:
        job, cfg = reconciler(config)._parse(body(**spec), prev.obj(), observed)
    except SpecError as err:
        assert outcome == f"SpecError:{err.issues[0].path}"
        return
    except UnknownInstanceType as err:
        assert outcome == "Unknown"
        assert "ConfigMap" in str(err) and "finetune.dev/instance-types=true in finetune-system" in str(err)
        assert "g6e.12xlarge.allocatableCPU" in str(err)
        return
    table = cfg.instance_types or {}
    inst = table.get(job.spec.cluster.instance_type)
    assert (f"{inst.name}:{inst.source}" if inst else "none") == outcome
    recorded = prev.obj().get("instance")
    if recorded is None and inst is not None:
        assert observed.instance == InstanceFigures.of(inst).wire()  # recorded by this reconcile's status write
    else:
        assert observed.instance is None  # never replaced once recorded


def test_render_from_recorded_figures_is_the_render_from_the_looked_up_ones() -> None:
    """The recorded figures reproduce the render byte for byte: a judged job's RayJob is never re-applied
    just because its figures now come from status."""
    for t in (G6, FROM_NODE, it.INSTANCE_TYPES["p5.48xlarge"]):
        model = parse_model(body(cluster__instanceType=t.name))
        looked_up = render_rayjob(model, {}, RenderConfig(instance_types={**it.INSTANCE_TYPES, t.name: t}))
        again = render_rayjob(model, {}, RenderConfig(
            instance_types={t.name: InstanceFigures.model_validate(InstanceFigures.of(t).wire()).instance_type()}))
        assert again == looked_up, t.name
