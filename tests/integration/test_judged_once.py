"""A job is judged (allow-list, instance-type figures) once, before its RayJob exists (issue 23; transitions.py
rows 1, 23, 24), on the real control plane with the real KubeRay operator (kwok plays kubelet).

Each fault is provoked for real: the allow-list ConfigMap is tightened, the nodes that gave a type's figures
are deleted (what Karpenter does), a job's type has no figures until an admin adds a ConfigMap. The operator
reads the cluster's configuration with a 1 s cache here (--config-ttl) and is also restarted, as any upgrade
or failover does: a restarted operator reconciles every job with what it reads then."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.builders import ftj
from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import OperatorProcess, service_account_kubeconfig
from tests.integration.support import (
    LEASE_NS,
    complete_rayjob,
    condition,
    create,
    emptied_namespace,  # noqa: F401
    node_of_new_type,
    phase_is,
    rayjobs,
    status,
    stays,
)

POLICY = "finetune-operator-policy"
FIGURES_CM = "finetune-instance-types-g7x"


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    kubeconfig = service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator-logs"), lease_namespace=LEASE_NS,
                         extra_args=["--config-ttl", "1"])
    op.start()
    yield op
    op.stop()


def rayjob(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    return next((r for r in rayjobs(kube, ns) if r["metadata"]["name"] == name), None)


def phases(kube: Kube, ns: str, want: dict[str, str]) -> bool:
    return all(status(kube, ns, name).get("phase") == phase for name, phase in want.items())


@pytest.mark.usefixtures("ray_dashboard")
def test_a_tightened_allow_list_fails_no_running_or_finished_job(kube: Kube, namespace: str,
                                                                 operator: OperatorProcess) -> None:
    # One after the other: the dev cluster holds one Ray head at a time (KubeRay deletes a finished job's
    # cluster at once: ttlSecondsAfterFinished 0).
    create(kube, namespace, ftj("done"))
    wait_for("done Running", lambda: phase_is(kube, namespace, "done", "Running"), timeout=120)
    complete_rayjob(kube, namespace, "done")
    wait_for("done Succeeded", lambda: phase_is(kube, namespace, "done", "Succeeded"), timeout=60)
    create(kube, namespace, ftj("runs"))
    wait_for("runs Running", lambda: phase_is(kube, namespace, "runs", "Running"), timeout=120)
    before = rayjob(kube, namespace, "runs")
    assert before is not None

    original = dict(kube.core.read_namespaced_config_map(POLICY, LEASE_NS).data)
    kube.core.patch_namespaced_config_map(POLICY, LEASE_NS, {"data": {"allowedImages": "registry.example/*\n"}})
    try:
        # Past the 1 s cache and one resync (15 s), then a restart: every job is reconciled with the new list.
        same = {"runs": "Running", "done": "Succeeded"}
        stays("no phase changes under the tightened list", lambda: phases(kube, namespace, same), seconds=18)
        operator.stop()
        operator.start()
        stays("no phase changes after a restart", lambda: phases(kube, namespace, same), seconds=6)
    finally:
        kube.core.patch_namespaced_config_map(POLICY, LEASE_NS, {"data": original})
    after = rayjob(kube, namespace, "runs")
    assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["spec"] == before["spec"]  # not suspended, not re-rendered: untouched
    for name in ("runs", "done"):
        assert condition(status(kube, namespace, name), "Failed") is None
    assert status(kube, namespace, "runs")["instance"]["name"] == "g6.12xlarge"  # what it was judged against


@pytest.mark.usefixtures("ray_dashboard")
def test_a_finished_job_keeps_its_verdict_when_the_nodes_of_its_type_are_gone(kube: Kube, namespace: str,
                                                                               operator: OperatorProcess,
                                                                               control_plane: Any) -> None:
    # g6e.12xlarge is in no ConfigMap: its figures come from the node only.
    node_of_new_type(kube, "g6e-judged-0", "g6e.12xlarge", gpus=4)
    try:
        create(kube, namespace, ftj("on-node", cluster__instanceType="g6e.12xlarge",
                                    cluster__workers={"replicas": 1, "gpusPerWorker": 4}, training__globalBatchSize=32))
        wait_for("Running", lambda: phase_is(kube, namespace, "on-node", "Running"), timeout=120)
        complete_rayjob(kube, namespace, "on-node")
        wait_for("Succeeded", lambda: phase_is(kube, namespace, "on-node", "Succeeded"), timeout=60)
    finally:
        control_plane.delete_node("g6e-judged-0")  # what Karpenter does with an empty node
    stays("Succeeded with the nodes gone", lambda: phase_is(kube, namespace, "on-node", "Succeeded"), seconds=18)
    operator.stop()
    operator.start()
    stays("Succeeded after a restart", lambda: phase_is(kube, namespace, "on-node", "Succeeded"), seconds=6)
    assert status(kube, namespace, "on-node")["instance"]["source"] == "node g6e-judged-0"
    # A new job of that type, now that no node has it (scale from zero), waits instead of failing.
    create(kube, namespace, ftj("after", cluster__instanceType="g6e.12xlarge",
                                cluster__workers={"replicas": 1, "gpusPerWorker": 4}, training__globalBatchSize=32))
    st = wait_for("waiting for figures", lambda: (condition(status(kube, namespace, "after"), "InstanceTypeKnown")
                                                  and status(kube, namespace, "after")), timeout=60)
    assert st["phase"] == "Pending"  # type: ignore[index]
    assert rayjob(kube, namespace, "after") is None


def test_a_job_of_an_unknown_type_waits_for_its_figures_then_starts(kube: Kube, namespace: str,
                                                                    operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("g7x", cluster__instanceType="g7x.12xlarge",
                                cluster__workers={"replicas": 1, "gpusPerWorker": 4}, training__globalBatchSize=32))
    st = wait_for("InstanceTypeKnown=False", lambda: (condition(status(kube, namespace, "g7x"), "InstanceTypeKnown")
                                                      and status(kube, namespace, "g7x")), timeout=60)
    known = condition(st, "InstanceTypeKnown")  # type: ignore[arg-type]
    assert (known["status"], known["reason"]) == ("False", "UnknownInstanceType"), known  # type: ignore[index]
    assert "finetune.dev/instance-types=true" in known["message"] and "g7x.12xlarge.gpus" in known["message"]  # type: ignore[index]
    assert st["phase"] == "Pending"  # type: ignore[index]
    stays("waits, never fails", lambda: phase_is(kube, namespace, "g7x", "Pending") and not rayjobs(kube, namespace),
          seconds=5)

    kube.core.create_namespaced_config_map(LEASE_NS, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=FIGURES_CM, labels={"finetune.dev/instance-types": "true"}),
        data={"g7x.12xlarge.gpus": "4", "g7x.12xlarge.efaInterfaces": "1", "g7x.12xlarge.allocatableCPU": "47000m",
              "g7x.12xlarge.allocatableMemory": "180000Mi"}))
    try:
        # Picked up at the next resync (15 s here) once the 1 s cache has expired: no restart.
        wait_for("RayJob created", lambda: rayjob(kube, namespace, "g7x"), timeout=45)
        st = wait_for("InstanceTypeKnown=True", lambda: (condition(status(kube, namespace, "g7x"), "InstanceTypeKnown")
                                                         or {}).get("status") == "True" and status(kube, namespace, "g7x"),
                      timeout=30)
        assert st["instance"]["source"] == f"ConfigMap {LEASE_NS}/{FIGURES_CM}"  # type: ignore[index]
        (group,) = rayjob(kube, namespace, "g7x")["spec"]["rayClusterSpec"]["workerGroupSpecs"]  # type: ignore[index]
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    finally:
        kube.core.delete_namespaced_config_map(FIGURES_CM, LEASE_NS)
