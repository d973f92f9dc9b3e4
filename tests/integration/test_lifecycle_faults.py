"""Faults the operator survives, on the real control plane: kube-apiserver, etcd and the KubeRay operator
restarted mid-run (each a real process stopped and started again with its own command line), and the
operator SIGKILLed again and again while jobs are created.

Afterwards every job has exactly one RayJob (the one recorded in status.rayJobUID), the right phase, and
the progress flushed before the fault is still there. The kill loop runs at the issue's scale: 50 jobs
created while the operator is SIGKILLed 20 times (FINETUNE_FAULT_JOBS, FINETUNE_FAULT_KILLS change it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import ftj
from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import OperatorProcess, service_account_kubeconfig
from tests.integration.support import (  # emptied_namespace: the namespace fixture, emptied of its jobs' pods
    LEASE_NS,
    create,
    emptied_namespace,  # noqa: F401
    job_token,
    kuberay_ready,
    rayjobs,
    restart_component,
    running_with_uid,
    status,
    worker_pods,
)

JOBS = int(os.environ.get("FINETUNE_FAULT_JOBS", "50"))
KILLS = int(os.environ.get("FINETUNE_FAULT_KILLS", "20"))


@pytest.fixture(scope="module")
def operator_kubeconfig(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")


class Supervised:
    """The operator with a restart policy (what the kubelet does for the Deployment's pod)."""

    def __init__(self, op: OperatorProcess):
        self.op = op
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            proc = self.op.proc
            if proc is not None and proc.poll() is not None:
                self.restarts += 1
                self.op.start(wait_ready=False)

    def __enter__(self) -> Supervised:
        self.op.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.op.stop()


@pytest.fixture(scope="module")
def supervised(operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"), identity="op-faults",
                         lease_namespace=LEASE_NS)
    with Supervised(op) as sup:
        yield sup


def one_rayjob_each(kube: Kube, ns: str, names: list[str]) -> bool:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rj in rayjobs(kube, ns):
        by_name.setdefault(rj["metadata"]["name"], []).append(rj)
    for n in names:
        rjs = by_name.get(n) or []
        st = status(kube, ns, n)
        if len(rjs) != 1 or st.get("rayJobUID") != rjs[0]["metadata"]["uid"]:
            return False
    return set(by_name) == set(names)


def post_progress(kube: Kube, ns: str, name: str, op: OperatorProcess, step: int) -> None:
    pod = worker_pods(kube, ns, name)[0]
    token = job_token(kube, ns, pod, f"finetune.dev/progress/{ns}/{name}")
    code, text = op.post(ns, name, {"rank": 0, "phase": "Training", "training": {"step": step, "totalSteps": 100}}, token)
    assert code == 202, text
    wait_for(f"step {step} flushed", lambda: status(kube, ns, name).get("step") == f"{step}/100", timeout=30)


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd", "ray-operator"])
@pytest.mark.usefixtures("ray_dashboard")
def test_a_control_plane_component_restarts_mid_run(kube: Kube, namespace: str, control_plane: Any,
                                                   supervised: Supervised, component: str) -> None:
    create(kube, namespace, ftj("steady"))
    uid = running_with_uid(kube, namespace, "steady")
    post_progress(kube, namespace, "steady", supervised.op, 12)
    restart_component(control_plane, component)
    if component == "ray-operator":
        wait_for("KubeRay ready", lambda: kuberay_ready(control_plane), timeout=90)

    def api_back() -> bool:
        try:
            return bool(status(kube, namespace, "steady"))
        except Exception:
            return False
    wait_for(f"API answering after the {component} restart", api_back, timeout=120)
    wait_for("the operator leads again", lambda: supervised.op.readyz() == 200, timeout=120)
    # The job goes on: same RayJob, still Running, the flushed progress kept; and the operator acts.
    wait_for("Running on the same RayJob", lambda: (s := status(kube, namespace, "steady")).get("phase") == "Running"
             and one_rayjob_each(kube, namespace, ["steady"]) and s.get("rayJobUID") == uid, timeout=120)
    assert status(kube, namespace, "steady")["step"] == "12/100"
    post_progress(kube, namespace, "steady", supervised.op, 13)


@pytest.mark.usefixtures("ray_dashboard")
def test_operator_killed_again_and_again_while_jobs_are_created(kube: Kube, namespace: str,
                                                                 supervised: Supervised) -> None:
    names = [f"storm-{i}" for i in range(JOBS)]
    errors: list[BaseException] = []

    def creator() -> None:
        try:
            for n in names:
                create(kube, namespace, ftj(n))
                time.sleep(0.3)
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=creator)
    t.start()
    for _ in range(KILLS):
        time.sleep(1.5)
        proc = supervised.op.proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # SIGKILL at an arbitrary moment; the supervisor starts it again
            proc.wait()
    t.join()
    assert errors == []
    wait_for("exactly one RayJob per job, recorded by UID", lambda: one_rayjob_each(kube, namespace, names), timeout=240)
    # Two simulated GPU nodes fit one job: one runs, the rest wait for capacity (none failed, none lost).
    phases = wait_for("every job Provisioning or Running", lambda: (p := {n: status(kube, namespace, n).get("phase")
                                                                         for n in names})
                      and set(p.values()) <= {"Provisioning", "Running"} and p, timeout=180)
    assert "Failed" not in phases.values()  # type: ignore[union-attr]
    time.sleep(5)
    assert one_rayjob_each(kube, namespace, names)
