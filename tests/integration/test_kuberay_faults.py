"""KubeRay not doing its part, on the real control plane: the KubeRay operator process stopped (the dev
cluster's supervisor stops it, as test_lifecycle_faults.py's restarts do) while a job is created, then
started again with its own command line. The job must say so in its status, and stop saying so once
KubeRay is back (docs/operator.md, *KubeRay's part*)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import ftj
from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import OperatorProcess, service_account_kubeconfig
from tests.integration.support import LEASE_NS, condition, create, kuberay_ready, metric, rayjobs, status

TIMEOUT = 15  # the operator's --kuberay-timeout here (300 s by default)


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    kubeconfig = service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path_factory.mktemp("operator-logs"), identity="op-kuberay",
                         lease_namespace=LEASE_NS, extra_args=["--kuberay-timeout", str(TIMEOUT)])
    op.start()
    yield op
    op.stop()


def test_a_stopped_kuberay_is_named_in_the_job_status_and_cleared_when_it_returns(
        kube: Kube, namespace: str, control_plane: Any, operator: OperatorProcess) -> None:
    # The RayJob CRD the dev cluster installs (KubeRay v1.6.1) passes the start-up version check.
    wait_for("the version check passed", lambda: metric(operator.metrics(), "finetune_kuberay_compatible") == 1.0)
    stopped = control_plane.processes.stop(["ray-operator"])
    assert stopped == ["ray-operator"]
    try:
        create(kube, namespace, ftj("orphan"))
        wait_for("the RayJob created", lambda: len(rayjobs(kube, namespace)) == 1, timeout=60)
        assert not rayjobs(kube, namespace)[0].get("status")  # nobody gives it one

        def flagged() -> Any:
            st = status(kube, namespace, "orphan")
            c = condition(st, "KubeRayReconciling")
            return st if c and c["status"] == "False" else None
        st: Any = wait_for("KubeRayReconciling=False", flagged, timeout=TIMEOUT + 60)
        c = condition(st, "KubeRayReconciling")
        assert c is not None and c["reason"] == "KubeRayNotReconciling", st
        assert "KubeRay has given it no status yet on RayJob" in c["message"] and "kuberay-operator" in c["message"], c
        assert st["phase"] == "Provisioning", st
    finally:
        control_plane.restart("ray-operator")  # not running: started again with its recorded command line
        wait_for("KubeRay ready", lambda: kuberay_ready(control_plane), timeout=90)
    wait_for("the RayJob has a status", lambda: bool((rayjobs(kube, namespace)[0].get("status") or {})
                                                     .get("jobDeploymentStatus")), timeout=90)
    wait_for("KubeRayReconciling cleared",
             lambda: condition(status(kube, namespace, "orphan"), "KubeRayReconciling") is None, timeout=60)
