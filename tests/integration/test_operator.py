"""The operator against the real control plane and the real KubeRay operator (kwok plays kubelet)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.builders import example, ftj
from tests.integration.conftest import Kube, create_namespace, wait_for
from tests.integration.operator_fixtures import ROOT, OperatorProcess, service_account_kubeconfig
from tests.integration.support import (
    LEASE_NS,
    G,
    P,
    V,
    condition,
    create,
    get,
    job_token,
    kubectl,
    metric,
    node_of_new_type,
    phase_is,
    rayclusters,
    rayjobs,
    status,
    stays,
    worker_pods,
)


@pytest.fixture(scope="module")
def operator_kubeconfig(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The operator runs as its ServiceAccount with deploy/rbac.yaml: every test below also checks the RBAC."""
    return service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")


@pytest.fixture(scope="module")
def operator(operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"), lease_namespace=LEASE_NS)
    op.start()
    yield op
    op.stop()


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.usefixtures("ray_dashboard")
def test_seed_example_runs_on_two_simulated_g6_nodes(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("seed"))
    st = wait_for("status names recorded", lambda: status(kube, namespace, "seed").get("rayJobName"), timeout=30)
    assert st == "seed"
    (rj,) = wait_for("RayJob", lambda: rayjobs(kube, namespace), timeout=30)  # type: ignore[misc]
    assert rj["metadata"]["ownerReferences"][0]["kind"] == "FinetuneJob"
    wait_for("RayCluster from KubeRay", lambda: rayclusters(kube, namespace), timeout=60)
    pods = wait_for("2 worker pods bound", lambda: [p for p in worker_pods(kube, namespace, "seed") if p.spec.node_name]
                    if len([p for p in worker_pods(kube, namespace, "seed") if p.spec.node_name]) == 2 else None,
                    timeout=90)
    nodes = {p.spec.node_name for p in pods}  # type: ignore[attr-defined]
    assert len(nodes) == 2, nodes
    for n in nodes:
        labels = kube.core.read_node(n).metadata.labels
        assert labels["node.kubernetes.io/instance-type"] == "g6.12xlarge"
    for p in pods:  # type: ignore[attr-defined]
        limits = p.spec.containers[0].resources.limits
        assert limits["nvidia.com/gpu"] == "4" and limits["vpc.amazonaws.com/efa"] == "1"
    st = wait_for("phase Running", lambda: phase_is(kube, namespace, "seed", "Running"), timeout=120)
    assert condition(st, "CapacityAvailable")["status"] == "True"  # type: ignore[index]
    assert condition(st, "WorkersScheduled")["status"] == "True"  # type: ignore[index]
    out = kubectl(kube, "get", "ftj", "-n", namespace)
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STEP", "LOSS", "NETWORK", "AGE"], out
    assert "Running" in out.splitlines()[1]
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=seed").items
    assert {"Running"} <= {e.reason for e in events}


def test_starting_until_the_ray_job_runs(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """KubeRay says Running as soon as its submitter Job exists (the image may still be pulling, `ray job
    submit` not run yet). The job says Provisioning, reason Starting, until Ray runs the job. The test asks
    for no dashboard stand-in (conftest.py's ray_dashboard): it writes KubeRay's jobStatus itself, step by
    step -- two simulated steps (PENDING, RUNNING)."""
    create(kube, namespace, ftj("starting"))

    def deploy_running() -> Any:
        rjs = rayjobs(kube, namespace)
        return rjs and (rjs[0].get("status") or {}).get("jobDeploymentStatus") == "Running" and rjs[0]
    wait_for("KubeRay's RayJob Running (submitter created)", deploy_running, timeout=120)
    st = wait_for("Starting", lambda: (s := status(kube, namespace, "starting")) and (condition(s, "Running") or {}).get(
        "reason") == "Starting" and s, timeout=60)
    assert st["phase"] == "Provisioning" and st["message"].startswith("starting"), st  # type: ignore[index]
    assert kubectl(kube, "get", "ftj", "-n", namespace).splitlines()[1].split()[1] == "Provisioning"

    def ray_job_status(value: str) -> None:  # what KubeRay writes once the dashboard answers
        kube.custom.patch_namespaced_custom_object_status("ray.io", "v1", namespace, "rayjobs", "starting",
                                                          {"status": {"jobStatus": value}})
    ray_job_status("PENDING")
    wait_for("the Ray job status in the message", lambda: "PENDING" in str(status(kube, namespace, "starting").get("message")),
             timeout=60)
    assert status(kube, namespace, "starting")["phase"] == "Provisioning"
    ray_job_status("RUNNING")
    st = wait_for("Running", lambda: phase_is(kube, namespace, "starting", "Running"), timeout=60)
    assert condition(st, "Running")["reason"] == "RayJobRunning"  # type: ignore[index]


def our_managed_fields(obj: dict[str, Any]) -> list[str]:
    return sorted(str(e.get("operation")) for e in obj["metadata"].get("managedFields") or []
                  if e.get("manager") == "finetune-operator")


@pytest.mark.usefixtures("ray_dashboard")
def test_children_changed_outside_the_operator_are_reverted(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """`kubectl edit` on the RayJob's spec is drift: the operator re-applies what the FinetuneJob says and
    posts a Warning Event DriftReverted naming the fields (issue 9). The RayJob was created by a POST: the
    first re-apply makes the create's fields the operator's applied ones (Kube.own_for_apply)."""
    create(kube, namespace, ftj("drift"))
    wait_for("Running", lambda: phase_is(kube, namespace, "drift", "Running"), timeout=120)

    def drift_events() -> list[str]:
        return [e.message for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=drift").items
                if e.reason == "DriftReverted" and e.type == "Warning"]
    # KubeRay's own updates (its finalizer; its Go structs drop `suspend: false`) are no drift.
    assert drift_events() == []

    def rayjob() -> dict[str, Any]:
        return kube.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "drift")  # type: ignore[no-any-return]
    assert our_managed_fields(rayjob()) == ["Update"]  # created by a POST
    rendered = int(rayjob()["spec"]["backoffLimit"])  # from the FinetuneJob's spec.backoffLimit
    kube.custom.patch_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "drift",
                                               {"spec": {"backoffLimit": rendered + 3}})
    wait_for("RayJob spec reverted", lambda: int(rayjob()["spec"]["backoffLimit"]) == rendered, timeout=60)
    drift = drift_events()
    assert any("RayJob drift" in m and "spec.backoffLimit" in m for m in drift), drift
    assert our_managed_fields(rayjob()) == ["Apply"]
    assert phase_is(kube, namespace, "drift", "Running")


def test_a_field_the_render_drops_is_removed_from_a_rayjob_created_by_post(kube: Kube, namespace: str,
                                                                            operator: OperatorProcess) -> None:
    """Server-side apply removes only fields its own earlier apply set. The RayJob is created by a POST (one
    request, and it never takes over an object of the name): without Kube.own_for_apply a field set at
    creation that the render later drops (spec.activeDeadlineSeconds removed from the job) would stay."""
    create(kube, namespace, ftj("dropped", activeDeadlineSeconds=86400))

    def rayjob_spec() -> dict[str, Any]:
        try:
            return kube.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "dropped")["spec"]  # type: ignore[no-any-return]
        except ApiException as err:
            if err.status == 404:
                return {}
            raise
    wait_for("RayJob", lambda: rayjob_spec().get("activeDeadlineSeconds") == 86400, timeout=60)
    kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "dropped", {"spec": {"activeDeadlineSeconds": None}})
    wait_for("activeDeadlineSeconds removed from the RayJob",
             lambda: rayjob_spec() and "activeDeadlineSeconds" not in rayjob_spec(), timeout=60)


def test_a_rayjob_of_the_jobs_name_that_is_not_its_own_is_never_taken_over(kube: Kube, namespace: str,
                                                                          operator: OperatorProcess) -> None:
    """The RayJob is created with a POST, which the API server refuses when the name is taken: a user's
    hand-written RayJob of the same name blocks the job (ChildConflict) and stays as it was; once it is
    deleted, the job proceeds."""
    theirs = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "taken", "labels": {"team": "a"}},
              "spec": {"entrypoint": "echo hi", "suspend": True, "rayClusterSpec": {"headGroupSpec": {
                  "rayStartParams": {}, "template": {"spec": {"containers": [{"name": "ray-head", "image": "x"}]}}}}}}
    kube.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", theirs)
    create(kube, namespace, ftj("taken"))
    st = wait_for("Blocked by the user's RayJob",
                  lambda: (c := condition(status(kube, namespace, "taken"), "Blocked")) and c["status"] == "True" and c,
                  timeout=60)
    assert st["reason"] == "ChildConflict", st  # type: ignore[index]
    assert "RayJob taken already exists and is not owned by this FinetuneJob" in st["message"], st  # type: ignore[index]
    rj = kube.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "taken")
    assert rj["metadata"]["labels"] == {"team": "a"} and not rj["metadata"].get("ownerReferences")
    assert our_managed_fields(rj) == [] and rj["spec"]["entrypoint"] == "echo hi"
    kube.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "taken")

    def ours() -> Any:
        try:
            got = kube.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", "taken")
        except ApiException:
            return None
        return got if got["metadata"].get("labels", {}).get("finetune.dev/job") == "taken" else None
    wait_for("the job's own RayJob once the name is free", ours, timeout=120)


@pytest.mark.usefixtures("ray_dashboard")
def test_three_workers_on_two_nodes_wait_then_proceed(kube: Kube, namespace: str, operator: OperatorProcess,
                                                       gpu_node: Any) -> None:
    create(kube, namespace, ftj("three", cluster__workers={"replicas": 3, "gpusPerWorker": 4},
                                training__globalBatchSize=96))
    st = wait_for("Provisioning with an unschedulable worker", lambda: (
        (s := phase_is(kube, namespace, "three", "Provisioning")) and (c := condition(s, "WorkersScheduled"))
        and c["status"] == "False" and s), timeout=120)
    sched = condition(st, "WorkersScheduled")  # type: ignore[arg-type]
    assert "Insufficient nvidia.com/gpu" in sched["message"] or "Insufficient vpc.amazonaws.com/efa" in sched["message"]
    cap = condition(st, "CapacityAvailable")  # type: ignore[arg-type]
    assert cap["status"] == "False" and cap["reason"] == "InsufficientNodes"
    gpu_node()
    wait_for("Running once a third node exists", lambda: phase_is(kube, namespace, "three", "Running"), timeout=180)
    st = status(kube, namespace, "three")
    assert condition(st, "CapacityAvailable")["status"] == "True"  # type: ignore[index]


def test_deadline_exceeded_maps_to_failed(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    # Real KubeRay behaviour: activeDeadlineSeconds passes, KubeRay fails the RayJob (DeadlineExceeded).
    create(kube, namespace, ftj("deadline", activeDeadlineSeconds=3))
    st = wait_for("Failed", lambda: phase_is(kube, namespace, "deadline", "Failed"), timeout=120)
    failed = condition(st, "Failed")  # type: ignore[arg-type]
    assert failed["reason"] == "DeadlineExceeded", failed
    assert st["completionTime"]  # type: ignore[index]


@pytest.mark.usefixtures("ray_dashboard")
def test_rayjob_success_maps_to_succeeded(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("done"))
    wait_for("Running", lambda: phase_is(kube, namespace, "done", "Running"), timeout=120)
    # kwok pods run no Ray, so no Ray job can really run or finish here. Two simulated steps: the dashboard
    # stand-in's jobStatus RUNNING (ray_dashboard), and now the terminal status KubeRay writes when the job
    # succeeds (jobStatus SUCCEEDED, jobDeploymentStatus Complete), written to the RayJob's status subresource.
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    kube.custom.patch_namespaced_custom_object_status(
        "ray.io", "v1", namespace, "rayjobs", "done",
        {"status": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete", "endTime": now}},
        _content_type="application/merge-patch+json",
    )
    st = wait_for("Succeeded", lambda: phase_is(kube, namespace, "done", "Succeeded"), timeout=60)
    assert condition(st, "Complete")["status"] == "True"  # type: ignore[index]


@pytest.mark.usefixtures("ray_dashboard")
def test_suspend_and_resume(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("pause"))
    wait_for("Running", lambda: phase_is(kube, namespace, "pause", "Running"), timeout=120)
    kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "pause", {"spec": {"suspend": True}},
                                               _content_type="application/merge-patch+json")
    wait_for("RayJob suspended", lambda: rayjobs(kube, namespace)[0]["spec"].get("suspend") is True, timeout=30)
    wait_for("Suspended and cluster gone", lambda: phase_is(kube, namespace, "pause", "Suspended")
             and not worker_pods(kube, namespace, "pause"), timeout=120)
    kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "pause", {"spec": {"suspend": False}},
                                               _content_type="application/merge-patch+json")
    wait_for("Running again", lambda: phase_is(kube, namespace, "pause", "Running"), timeout=180)
    assert len(rayjobs(kube, namespace)) == 1


@pytest.mark.usefixtures("ray_dashboard")
def test_delete_leaves_nothing_behind(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("gone"))
    wait_for("Running", lambda: phase_is(kube, namespace, "gone", "Running"), timeout=120)
    kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "gone")
    wait_for("children garbage-collected", lambda: not rayjobs(kube, namespace) and not rayclusters(kube, namespace)
             and not kube.core.list_namespaced_config_map(namespace, label_selector="finetune.dev/job=gone").items
             and not kube.core.list_namespaced_pod(namespace, label_selector="finetune.dev/job=gone").items,
             timeout=120)


def test_immutable_fields_are_rejected_mutable_ones_accepted(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("frozen"))
    with pytest.raises(ApiException) as err:
        kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "frozen",
                                                   {"spec": {"model": {"source": "Qwen/Qwen2.5-7B"}}},
                                                   _content_type="application/merge-patch+json")
    assert err.value.status == 422
    assert "spec.model is immutable" in err.value.body
    with pytest.raises(ApiException) as err:
        kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "frozen",
                                                   {"spec": {"cluster": {"workers": {"replicas": 4}}}},
                                                   _content_type="application/merge-patch+json")
    assert "spec.cluster is immutable" in err.value.body
    kube.custom.patch_namespaced_custom_object(G, V, namespace, P, "frozen", {"spec": {"activeDeadlineSeconds": 86400}},
                                               _content_type="application/merge-patch+json")
    wait_for("deadline propagated to the RayJob", lambda: (r := rayjobs(kube, namespace)) and
             r[0]["spec"].get("activeDeadlineSeconds") == 86400, timeout=30)


def test_bad_spec_is_rejected_by_the_api_server(kube: Kube, namespace: str) -> None:
    doc = ftj("bad", training__globalBatchSize=12)
    with pytest.raises(ApiException) as err:
        create(kube, namespace, doc)
    assert err.value.status == 422
    assert "globalBatchSize must be a multiple" in err.value.body


@pytest.mark.usefixtures("ray_dashboard")
def test_operator_killed_mid_reconcile_makes_no_duplicates(kube: Kube, namespace: str, operator: OperatorProcess,
                                                            operator_kubeconfig: Path, tmp_path: Path) -> None:
    operator.stop()
    # A real SIGKILL-equivalent crash at the worst moment: right after the children were created and before
    # the status write that records them: the fail point reconcile/after-create (api/failpoints.py).
    crashing = OperatorProcess(operator_kubeconfig, tmp_path, identity="op-crash", lease_namespace=LEASE_NS,
                               extra_env={"FINETUNE_FAILPOINTS": "reconcile/after-create=exit(137)"})
    try:
        crashing.start()
        create(kube, namespace, ftj("crash"))
        assert crashing.proc is not None
        crashing.proc.wait(timeout=60)
        assert crashing.proc.returncode == 137
        assert "rayJobUID" not in status(kube, namespace, "crash")  # created, not recorded
        assert [r["metadata"]["name"] for r in rayjobs(kube, namespace)] == ["crash"]
    finally:
        crashing.kill()
    operator.start()
    st = wait_for("Running after restart", lambda: phase_is(kube, namespace, "crash", "Running"), timeout=180)
    (rj,) = rayjobs(kube, namespace)  # the one created before the crash, adopted: not a second one
    assert rj["metadata"]["name"] == "crash" and st["rayJobUID"] == rj["metadata"]["uid"]  # type: ignore[index]
    assert st["rayJobName"] == "crash"  # type: ignore[index]
    assert len(rayclusters(kube, namespace)) == 1
    operator.kill()  # and once more, mid-flight with children present
    operator.start()
    # Evidence the restarted process reconciled this job (its own /metrics: set at the end of a reconcile,
    # after the children were applied), before counting them: else the count proves nothing.
    wait_for("the restarted operator reconciled the job", lambda: metric(
        operator.metrics(), "finetune_job_phase", namespace=namespace, name="crash", phase="Running") == 1.0,
        timeout=60)
    assert len(rayjobs(kube, namespace)) == 1 and len(rayclusters(kube, namespace)) == 1


def test_progress_channel_authenticates_per_job(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    create(kube, namespace, ftj("alpha"))
    create(kube, namespace, ftj("beta"))
    for job in ("alpha", "beta"):
        wait_for(f"{job} pods", lambda job=job: worker_pods(kube, namespace, job), timeout=90)
    alpha_pod = worker_pods(kube, namespace, "alpha")[0]
    beta_pod = worker_pods(kube, namespace, "beta")[0]
    # The projected token the pod gets is minted exactly like this: bound to the pod, job audience.
    alpha_token = job_token(kube, namespace, alpha_pod, f"finetune.dev/progress/{namespace}/alpha")
    beta_token = job_token(kube, namespace, beta_pod, f"finetune.dev/progress/{namespace}/beta")
    body = {"rank": 0, "training": {"step": 7, "totalSteps": 100, "loss": 1.234, "tokensPerSecond": 5000.0},
            "network": {"transport": "efa", "provider": "efa", "healthy": True, "message": "NET/OFI efa, 1 nic"}}
    assert operator.post(namespace, "alpha", body, None)[0] == 401
    assert operator.post(namespace, "alpha", body, "not-a-token")[0] == 401
    code, text = operator.post(namespace, "alpha", body, beta_token)
    assert code == 403, text
    code, text = operator.post(namespace, "alpha", body, alpha_token)
    assert code == 202, text
    st = wait_for("loss in status", lambda: (s := status(kube, namespace, "alpha")).get("training", {}).get("loss") == 1.234
                  and s, timeout=30)
    assert st["step"] == "7/100" and st["network"]["transport"] == "efa"  # type: ignore[index]
    wait_for("NetworkHealthy condition", lambda: (c := condition(status(kube, namespace, "alpha"), "NetworkHealthy"))
             and c["status"] == "True", timeout=30)
    out = kubectl(kube, "get", "ftj", "alpha", "-n", namespace)
    row = out.splitlines()[1].split()
    assert row[2] == "7/100" and row[3] == "1.234" and row[4] == "efa", out
    metrics = operator.metrics()
    assert f'finetune_job_loss{{name="alpha",namespace="{namespace}"}} 1.234' in metrics
    assert status(kube, namespace, "beta").get("training") is None  # the rejected post changed nothing
    # Deleting the job removes its per-job metric series.
    kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "alpha")
    wait_for("alpha's series gone", lambda: not [line for line in operator.metrics().splitlines()
                                                 if line.startswith("finetune_job_") and 'name="alpha"' in line],
             timeout=30)


def test_a_report_from_an_earlier_ray_cluster_is_refused(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """Issue 9, item 3: after a retry or a resume KubeRay runs the job on a new RayCluster; a pod of the
    earlier one (still terminating, its token still valid) must not overwrite the status. The stale pod
    here is made by hand exactly as KubeRay labels its Ray pods, only with the earlier cluster's name, and
    owned as KubeRay owns them: by that earlier RayCluster (made by hand too, owned by the job's RayJob, and
    marked managed by another controller so KubeRay leaves it and its pod alone). A pod whose owners do not
    lead to the job (here: none) is refused with 403."""
    create(kube, namespace, ftj("gamma"))
    wait_for("gamma pods", lambda: worker_pods(kube, namespace, "gamma"), timeout=90)
    current_pod = worker_pods(kube, namespace, "gamma")[0]
    current = current_pod.metadata.labels["ray.io/cluster"]
    (rj,) = rayjobs(kube, namespace)
    assert rj["status"]["rayClusterName"] == current
    earlier = kube.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": f"{current}-earlier", "ownerReferences": [
            {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": "gamma", "uid": rj["metadata"]["uid"]}]},
        "spec": {"managedBy": "kueue.x-k8s.io/multikueue", "headGroupSpec": {"rayStartParams": {}, "template": {
            "spec": {"containers": [{"name": "ray-head", "image": "unused"}]}}}}})

    def hand_made_pod(name: str, owners: list[client.V1OwnerReference] | None) -> Any:
        return kube.core.create_namespaced_pod(namespace, client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, owner_references=owners, labels={
                "finetune.dev/job": "gamma", "ray.io/cluster": f"{current}-earlier", "ray.io/node-type": "worker"}),
            spec=client.V1PodSpec(containers=[client.V1Container(name="ray-worker", image="unused")],
                                  node_selector={"finetune.dev/nowhere": "true"})))  # stays Pending: enough for a token

    stale_pod = hand_made_pod("gamma-earlier-worker", [client.V1OwnerReference(
        api_version="ray.io/v1", kind="RayCluster", name=f"{current}-earlier", uid=earlier["metadata"]["uid"])])
    audience = f"finetune.dev/progress/{namespace}/gamma"
    ownerless = job_token(kube, namespace, hand_made_pod("gamma-ownerless-worker", None), audience)
    code, text = operator.post(namespace, "gamma", {"rank": 0, "training": {"step": 50}}, ownerless)
    assert code == 403 and "belongs to no FinetuneJob" in text, (code, text)
    stale_token = job_token(kube, namespace, stale_pod, audience)
    stale = {"rank": 0, "training": {"step": 90, "totalSteps": 100, "loss": 9.99}}

    def refused() -> tuple[int, str] | None:
        code, text = operator.post(namespace, "gamma", stale, stale_token)
        assert code in (202, 409), (code, text)
        return (code, text) if code == 409 else None

    code, text = wait_for("the stale report refused", refused, timeout=30)  # type: ignore[misc]
    assert f"{current}-earlier" in text and current in text, text
    code, text = operator.post(namespace, "gamma", {"rank": 0, "training": {"step": 3, "totalSteps": 100, "loss": 1.5}},
                               job_token(kube, namespace, current_pod, audience))
    assert code == 202, text
    wait_for("the current cluster's report in status",
             lambda: (status(kube, namespace, "gamma").get("training") or {}).get("loss") == 1.5, timeout=30)
    assert status(kube, namespace, "gamma")["step"] == "3/100"


def test_standby_replica_does_not_act(kube: Kube, namespace: str, operator: OperatorProcess,
                                      operator_kubeconfig: Path, tmp_path: Path) -> None:
    """A standby waits for the Lease and writes nothing, while the leader does the work of a job created
    meanwhile. Its own /metrics count every write its API client made (mirrored at each scrape), and its
    Lease reads show the counters are live."""
    standby = OperatorProcess(operator_kubeconfig, tmp_path, identity="op-b", lease_namespace=LEASE_NS)
    try:
        standby.start(wait_ready=False)
        wait_for("the standby's Lease reads", lambda: standby.readyz() == 503 and metric(
            standby.metrics(), "finetune_api_reads_total", resource="leases") >= 1, timeout=30)
        create(kube, namespace, ftj("watched"))  # work the standby sees too, and must leave to the leader
        wait_for("the leader created and recorded the RayJob", lambda: status(kube, namespace, "watched").get("rayJobUID"),
                 timeout=60)

        def standby_idle() -> bool:
            text = standby.metrics()
            return (standby.proc is not None and standby.proc.poll() is None and standby.readyz() == 503
                    and metric(text, "finetune_api_writes_total") == 0 and metric(text, "finetune_reconcile_total") == 0)
        stays("the standby writes nothing and reconciles nothing", standby_idle, seconds=5)
        assert metric(operator.metrics(), "finetune_api_writes_total") > 0  # the leader's counter does count
        holder = client.CoordinationV1Api(kube.api_client).read_namespaced_lease("finetune-operator-leader", LEASE_NS)
        assert holder.spec.holder_identity == operator.identity
    finally:
        standby.stop()


@pytest.mark.slow
def test_training_runtime_reports_through_the_progress_channel(kube: Kube, namespace: str, operator: OperatorProcess,
                                                                tmp_path: Path) -> None:
    """End to end without mocks: the real training entrypoint (`python -m finetune_training`, Ray + FSDP on
    CPU) posts progress with a pod-bound, job-audience token to the running operator, and the FinetuneJob's
    status (and `kubectl get ftj`) shows its step, loss and network transport."""
    import os
    import sys

    import yaml as _yaml

    create(kube, namespace, ftj("e2e"))
    pod = wait_for("a worker pod", lambda: (p := worker_pods(kube, namespace, "e2e")) and p[0], timeout=90)
    # kwok runs no kubelet, so nothing mounts the projected token; mint the same token the kubelet would.
    token_file = tmp_path / "token"
    token_file.write_text(job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/e2e"))
    job = example("local-tiny.yaml")
    job["metadata"] = {"name": "e2e", "namespace": namespace}
    root = Path(__file__).resolve().parents[2]
    # The cluster entrypoint takes paths as the pods see them: absolute (relative ones are `finetune run`'s).
    job["spec"]["model"]["source"] = str(root / "examples" / "models" / "tiny-qwen2")
    job["spec"]["dataset"]["source"] = str(root / "examples" / "data" / "arithmetic.jsonl")
    job["spec"]["training"].update(maxSteps=6, evalIntervalSteps=6)
    job["spec"]["training"]["checkpoint"].update(intervalSteps=6, storageUri=str(tmp_path / "storage"))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(_yaml.safe_dump(job))
    env = {**os.environ, "FINETUNE_PROGRESS_URL": f"{operator.url}/v1/progress/{namespace}/e2e",
           "FINETUNE_PROGRESS_TOKEN_FILE": str(token_file), "FINETUNE_PROGRESS_INTERVAL": "0.5",
           "RAY_DISABLE_USAGE_STATS": "1"}
    run = subprocess.run([sys.executable, "-m", "finetune_training", "--config", str(cfg)], cwd=Path(__file__).parents[2],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    st = wait_for("final step in status", lambda: (s := status(kube, namespace, "e2e")).get("step") == "6/6" and s,
                  timeout=30)
    training = st["training"]  # type: ignore[index]
    assert st["attempt"] == 1  # type: ignore[index]  # the Ray pods the token is bound to were never replaced
    assert training["loss"] > 0 and training["tokensPerSecond"] > 0
    assert st["network"]["transport"] == "gloo"  # type: ignore[index]  # honest on CPU
    row = kubectl(kube, "get", "ftj", "e2e", "-n", namespace).splitlines()[1].split()
    assert row[2] == "6/6" and row[4] == "gloo"


def test_unknown_instance_type_takes_figures_from_the_nodes(kube: Kube, namespace: str, operator: OperatorProcess,
                                                            control_plane: Any) -> None:
    # g6e.12xlarge is in no ConfigMap: admission lets it through, the operator reads a node's figures.
    node_of_new_type(kube, "g6e-node-0", "g6e.12xlarge", gpus=4)
    try:
        create(kube, namespace, ftj("toobig", cluster__instanceType="g6e.12xlarge",
                                    cluster__workers={"replicas": 2, "gpusPerWorker": 8}, training__globalBatchSize=64))
        create(kube, namespace, ftj("fits", cluster__instanceType="g6e.12xlarge",
                                    cluster__workers={"replicas": 1, "gpusPerWorker": 4}, training__globalBatchSize=32))
        st = wait_for("Failed", lambda: phase_is(kube, namespace, "toobig", "Failed"), timeout=60)
        valid = condition(st, "SpecValid")  # type: ignore[arg-type]
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"  # type: ignore[index]
        assert ("spec.cluster.workers.gpusPerWorker: 8 GPUs per worker do not fit g6e.12xlarge "
                "(4 GPUs; figures from node g6e-node-0)") in valid["message"]  # type: ignore[index]
        wait_for("RayJob for the fitting job", lambda: [r for r in rayjobs(kube, namespace)
                                                        if r["metadata"]["name"] == "fits"], timeout=60)
        (rj,) = rayjobs(kube, namespace)
        (group,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4" and limits["vpc.amazonaws.com/efa"] == "1"
        assert kube.core.list_namespaced_config_map(namespace, label_selector="finetune.dev/job=toobig").items == []
        events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=toobig").items
        assert any(e.type == "Warning" and e.reason == "Failed" for e in events)
    finally:
        control_plane.delete_node("g6e-node-0")


def test_operator_enforces_the_allow_list_for_jobs_admission_let_through(kube: Kube, namespace: str,
                                                                         operator: OperatorProcess) -> None:
    """A job created while the policy allowed its image (or where the admission policy is not installed)
    is still refused by the operator: SpecValid=False naming the field and the policy, no children."""
    policy = kube.core.read_namespaced_config_map("finetune-operator-policy", LEASE_NS)
    original = dict(policy.data)
    operator.stop()
    try:
        kube.core.patch_namespaced_config_map("finetune-operator-policy", LEASE_NS,
                                              {"data": {"allowedImages": original["allowedImages"] + "registry.example/*\n"}})
        doc = ftj("other-image", cluster__image="registry.example/ray:2.58.0")
        deadline = time.monotonic() + 30
        while True:  # the admission plugin sees the new parameters within a moment
            try:
                create(kube, namespace, doc)
                break
            except ApiException as err:
                if err.status != 403 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        kube.core.patch_namespaced_config_map("finetune-operator-policy", LEASE_NS, {"data": original})
        operator.start()
    st = wait_for("Failed", lambda: phase_is(kube, namespace, "other-image", "Failed"), timeout=60)
    valid = condition(st, "SpecValid")  # type: ignore[arg-type]
    assert valid["reason"] == "InvalidSpec"  # type: ignore[index]
    assert ("spec.cluster.image: registry.example/ray:2.58.0 is not in the allowed images "
            "(public.ecr.aws/deep-learning-containers/ray:*; ConfigMap finetune-system/finetune-operator-policy)"
            ) in valid["message"]  # type: ignore[index]
    assert rayjobs(kube, namespace) == []


def test_runtime_config_map_is_shared_immutable_and_collected_with_its_last_job(
        kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """One runtime ConfigMap per namespace and version, with no owners (no patch per job): the operator
    deletes it once no job needs it (controller/runtime_configmaps.py). It also collects the ConfigMap of a runtime
    version nothing runs any more, and leaves alone one that has owners (an earlier version's, which the
    garbage collector handles)."""
    runtime = {"app.kubernetes.io/managed-by": "finetune-operator", "finetune.dev/runtime": "0ld000000000"}
    kube.core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="finetune-runtime-0ld000000000", labels=runtime), data={"x": "y"},
        immutable=True))
    create(kube, namespace, ftj("one"))
    create(kube, namespace, ftj("two"))

    def current() -> Any:
        cms = [c for c in kube.core.list_namespaced_config_map(namespace, label_selector="finetune.dev/runtime").items
               if c.metadata.name != "finetune-runtime-0ld000000000"]
        return cms if len(cms) == 1 and len(rayjobs(kube, namespace)) == 2 else None

    (cm,) = wait_for("one runtime ConfigMap for both jobs", current, timeout=60)  # type: ignore[misc]
    assert cm.immutable is True and cm.metadata.name.startswith("finetune-runtime-")
    assert not cm.metadata.owner_references  # nothing patched per job
    digest = cm.metadata.labels["finetune.dev/runtime"]
    legacy = kube.core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="finetune-runtime-1e6ac9000000", labels={**runtime, "finetune.dev/runtime": "1e6ac9000000"},
                                     owner_references=[client.V1OwnerReference(
                                         api_version=f"{G}/{V}", kind="FinetuneJob", name="two",
                                         uid=get(kube, namespace, "two")["metadata"]["uid"])]),
        data={"x": "y"}, immutable=True))
    with pytest.raises(ApiException) as err:  # nobody, not even an admin, changes code under a trainer
        kube.core.patch_namespaced_config_map(cm.metadata.name, namespace, {"data": {"x": "y"}})
    assert err.value.status == 422 and "field is immutable" in err.value.body
    for name in ("one", "two"):
        (rj,) = [r for r in rayjobs(kube, namespace) if r["metadata"]["name"] == name]
        assert rj["metadata"]["labels"]["finetune.dev/runtime"] == digest
        vols = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
        assert next(v for v in vols if v["name"] == "finetune-runtime")["configMap"]["name"] == cm.metadata.name

    def names() -> set[str]:
        return {c.metadata.name for c in kube.core.list_namespaced_config_map(
            namespace, label_selector="finetune.dev/runtime").items}
    kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "one")
    # A deletion in the namespace collects what nothing uses: the old version's ConfigMap goes, the current
    # one stays for "two", and the one with an owner is the garbage collector's.
    wait_for("the unused old runtime collected", lambda: "finetune-runtime-0ld000000000" not in names(), timeout=90)
    assert names() == {cm.metadata.name, legacy.metadata.name}
    kube.custom.delete_namespaced_custom_object(G, V, namespace, P, "two")
    wait_for("runtime ConfigMaps collected with their last job", lambda: names() == set(), timeout=120)


def test_a_runtime_config_map_deleted_behind_the_operators_back_is_created_again(
        kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    """The operator used to remember a runtime ConfigMap it had created for good: after
    `kubectl delete cm -l finetune.dev/runtime`, or the namespace deleted and re-created under its name, the
    next job's pods waited in FailedMount for ever. Now a job that has no RayJob yet asks the API server
    (controller/runtime_configmaps.py). kwok's pods mount nothing, so the test checks the ConfigMap itself."""
    def runtime_cms() -> list[str]:
        return [c.metadata.name for c in kube.core.list_namespaced_config_map(
            namespace, label_selector="finetune.dev/runtime").items]

    create(kube, namespace, ftj("one"))
    (first,) = wait_for("the runtime ConfigMap of the first job",
                        lambda: runtime_cms() if runtime_cms() and rayjobs(kube, namespace) else None, timeout=60)  # type: ignore[misc]
    # The documented clean-up, while job "one" still exists (no deletion the operator would see).
    kube.core.delete_collection_namespaced_config_map(namespace, label_selector="finetune.dev/runtime")
    wait_for("runtime ConfigMaps deleted", lambda: not runtime_cms(), timeout=30)
    create(kube, namespace, ftj("two"))
    wait_for("the runtime ConfigMap created again for the next job", lambda: runtime_cms() == [first], timeout=30)
    wait_for("the second job's RayJob", lambda: len(rayjobs(kube, namespace)) == 2, timeout=30)

    # The namespace deleted and re-created under the same name (per-PR namespaces, Argo CD).
    kube.core.delete_namespace(namespace)

    def gone() -> bool:
        try:
            kube.core.read_namespace(namespace)
            return False
        except ApiException as e:
            return e.status == 404

    wait_for(f"namespace {namespace} deleted", gone, timeout=90)
    create_namespace(kube.core, namespace, timeout=30)
    create(kube, namespace, ftj("three"))
    wait_for("the runtime ConfigMap created in the re-created namespace", lambda: runtime_cms() == [first], timeout=30)


def test_an_operator_upgrade_leaves_a_running_job_on_the_runtime_it_started_with(
        kube: Kube, namespace: str, operator: OperatorProcess, operator_kubeconfig: Path, tmp_path: Path) -> None:
    """An operator with another runtime (a later release: here the training package with one more line) does
    not re-apply a job's RayJob: its next retry or resume would run new code against the old checkpoint.
    New jobs get the new runtime, and the old runtime's ConfigMap stays while the old job's RayJob names it."""
    def runtime_cms() -> set[str]:
        return {c.metadata.name for c in kube.core.list_namespaced_config_map(
            namespace, label_selector="finetune.dev/runtime").items}

    create(kube, namespace, ftj("kept"))
    wait_for("the RayJob recorded", lambda: status(kube, namespace, "kept").get("rayJobUID"), timeout=60)
    (before,) = rayjobs(kube, namespace)
    old = before["metadata"]["labels"]["finetune.dev/runtime"]
    later = tmp_path / "later"
    shutil.copytree(ROOT / "training" / "finetune_training", later / "finetune_training",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with (later / "finetune_training" / "__init__.py").open("a") as f:
        f.write("# a later release\n")
    operator.stop()
    # The same address (the rendered progress URL names it): only the runtime differs.
    upgraded = OperatorProcess(operator_kubeconfig, tmp_path, identity="op-upgraded", lease_namespace=LEASE_NS,
                               port=operator.port, extra_env={"PYTHONPATH": os.pathsep.join(filter(None, [str(later), os.environ.get("PYTHONPATH")]))})
    try:
        upgraded.start()
        create(kube, namespace, ftj("fresh"))
        fresh = wait_for("the new job's RayJob", lambda: next(
            (r for r in rayjobs(kube, namespace) if r["metadata"]["name"] == "fresh"), None), timeout=60)
        new = fresh["metadata"]["labels"]["finetune.dev/runtime"]  # type: ignore[index]
        assert new != old
        # Evidence the upgraded process reconciled the old job (its /metrics are set at the end of a reconcile,
        # after the children were applied) before looking at its RayJob.
        wait_for("the upgraded operator reconciled the old job", lambda: any(
            line.startswith("finetune_job_phase{") and 'name="kept"' in line and line.endswith(" 1.0")
            for line in upgraded.metrics().splitlines()), timeout=60)
        (after,) = [r for r in rayjobs(kube, namespace) if r["metadata"]["name"] == "kept"]
        assert after["metadata"]["generation"] == before["metadata"]["generation"]  # no spec change applied
        assert after["metadata"]["labels"]["finetune.dev/runtime"] == old
        assert runtime_cms() == {f"finetune-runtime-{old}", f"finetune-runtime-{new}"}
    finally:
        upgraded.stop()
        operator.start()


# The module's operator runs with the runner's default --lease-duration (30 s): it renews every third of it,
# and a leader whose renewals keep failing gives up leadership once the renew deadline has passed since its
# last renewal (controller/leader.py, LeaderElector.hold).
LEASE_SECONDS = 30
RENEW_PERIOD = LEASE_SECONDS / 3
RENEW_DEADLINE = LEASE_SECONDS - RENEW_PERIOD


def test_forged_token_flood_costs_no_leadership_and_no_genuine_report(kube: Kube, namespace: str,
                                                                      operator: OperatorProcess) -> None:
    """Scaled down from benchmarks/bench_progress_flood.py (1000/s for 30 s with 20 jobs): forged tokens
    that look plausible (JWT, a real job's audience, not expired) at 300/s while 3 jobs report every second,
    for longer than the renew deadline (a flood that starved the renewals would cost the leadership within
    it). Every genuine report is accepted, no forged one is, TokenReviews stay within the rate limit, and
    the leader renews its Lease through the flood: no two renewals (nor the last one and the flood's end)
    further apart than the renew deadline, and the same holder throughout."""
    import asyncio
    import itertools
    import re
    import threading
    from datetime import UTC, datetime

    from tests.integration.flood import flood, lease_sampler

    names = ["fa", "fb", "fc"]
    for n in names:
        create(kube, namespace, ftj(n))
    jobs = []
    for n in names:
        pod = wait_for(f"{n} worker pod", lambda n=n: (p := worker_pods(kube, namespace, n)) and p[0], timeout=90)
        jobs.append((namespace, n, job_token(kube, namespace, pod, f"finetune.dev/progress/{namespace}/{n}")))

    def reviews() -> float:
        m = re.search(r"^finetune_progress_token_reviews_total ([0-9.e+]+)$", operator.metrics(), re.M)
        return float(m.group(1)) if m else 0.0

    coordination = client.CoordinationV1Api(kube.api_client)
    samples: list[tuple[float, str, str]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=lease_sampler, args=(
        lambda: coordination.read_namespaced_lease("finetune-operator-leader", LEASE_NS), stop, samples))
    before = reviews()
    sampler.start()
    try:
        result = asyncio.run(flood(operator.url, jobs, forged_per_second=300, seconds=RENEW_DEADLINE + 4,
                                   report_interval=1.0))
        flood_end = datetime.now(UTC)
    finally:
        stop.set()
        sampler.join()
    assert result.seconds > RENEW_DEADLINE, result.seconds  # the flood outlasted the renew deadline
    assert result.genuine[202] == result.genuine_sent, result.genuine
    assert result.forged[202] == 0 and set(result.forged) <= {401, 429}, result.forged
    assert result.forged_sent >= 1000, result.forged_sent  # the flood really happened
    # Without the defences every forged request would have cost a TokenReview.
    made = reviews() - before
    assert made <= 100 + 50 * result.seconds + len(jobs) * 2, (made, result.forged)
    assert {holder for _, holder, _ in samples} == {operator.identity}
    assert operator.proc is not None and operator.proc.poll() is None and operator.readyz() == 200
    assert metric(operator.metrics(), "finetune_operator_leader") == 1.0
    renewals = sorted({datetime.fromisoformat(renew) for _, _, renew in samples})
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise([*renewals, flood_end])]
    assert len(renewals) >= int(result.seconds // RENEW_PERIOD), renewals  # renewed during the flood
    assert max(gaps) < RENEW_DEADLINE, (gaps, renewals)  # never left to lapse towards losing the lead
    for ns, n, _ in jobs:
        step = result.last_step[f"{ns}/{n}"]
        wait_for(f"{n}'s last genuine step in status", lambda n=n, step=step:
                 status(kube, namespace, n).get("training", {}).get("step") == step, timeout=30)
