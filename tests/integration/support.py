"""Helpers the integration tests share (test modules import this, never each other).

- FinetuneJob and child reads: create, get, status, phase_is, condition, rayjobs, rayclusters, worker_pods.
- metric: one figure from an operator's /metrics.
- job_token: the pod-bound, job-audience token the kubelet would project into a Ray pod.
- complete_rayjob: the simulated end of a Ray job (kwok runs no Ray).
- node_of_new_type: a kwok node of an instance type no ConfigMap describes (its figures come from the node).
- emptied_namespace: the ``namespace`` fixture, emptied of its jobs' pods before it is deleted (a test
  module uses it with ``from tests.integration.support import emptied_namespace  # noqa: F401``).
- restart_component, kuberay_ready: dev-cluster control for the fault tests.
- denial, dry_create: admission on the real API server.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.conftest import Kube, wait_for
from tests.integration.operator_fixtures import pod_token

G, V, P = "finetune.dev", "v1alpha1", "finetunejobs"
LEASE_NS = "finetune-system"


def create(kube: Kube, ns: str, doc: dict[str, Any]) -> dict[str, Any]:
    return kube.custom.create_namespaced_custom_object(G, V, ns, P, doc)  # type: ignore[no-any-return]


def get(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return kube.custom.get_namespaced_custom_object(G, V, ns, P, name)  # type: ignore[no-any-return]


def status(kube: Kube, ns: str, name: str) -> dict[str, Any]:
    return get(kube, ns, name).get("status") or {}


def phase_is(kube: Kube, ns: str, name: str, *phases: str) -> Any:
    st = status(kube, ns, name)
    return st if st.get("phase") in phases else None


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), None)


def rayjobs(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayjobs")["items"]  # type: ignore[no-any-return]


def rayclusters(kube: Kube, ns: str) -> list[dict[str, Any]]:
    return kube.custom.list_namespaced_custom_object("ray.io", "v1", ns, "rayclusters")["items"]  # type: ignore[no-any-return]


def worker_pods(kube: Kube, ns: str, job: str) -> list[Any]:
    pods = kube.core.list_namespaced_pod(ns, label_selector=f"finetune.dev/job={job},ray.io/node-type=worker").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def kubectl(kube: Kube, *args: str) -> str:
    out = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def metric(text: str, name: str, /, **labels: str) -> float:
    """The sum of the samples of ``name`` in a /metrics text whose labels include ``labels`` (0.0: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


def job_token(kube: Kube, namespace: str, pod: Any, audience: str) -> str:
    return pod_token(kube.core, namespace, pod, audience)


def running_with_uid(kube: Kube, ns: str, name: str) -> str:
    st = wait_for(f"{name} Running", lambda: phase_is(kube, ns, name, "Running"), timeout=180)
    (rj,) = [r for r in rayjobs(kube, ns) if r["metadata"]["name"] == name]
    assert st["rayJobUID"] == rj["metadata"]["uid"]  # type: ignore[index]
    return str(rj["metadata"]["uid"])


def stays(what: str, check: Any, seconds: float) -> None:
    """`check()` must hold the whole time (sampled), not just eventually."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), what
        time.sleep(0.25)


def node_of_new_type(kube: Kube, name: str, itype: str, gpus: int) -> None:
    """A node of an instance type no ConfigMap describes (kwok keeps it Ready); its figures are the
    only source the operator has for that type."""
    from finetune_devcluster.kwok_nodes import node_manifest

    node = node_manifest(name, "g6.12xlarge", "new-types", index=90)
    for key in ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type"):
        node["metadata"]["labels"][key] = itype
    for figures in (node["status"]["capacity"], node["status"]["allocatable"]):
        figures["nvidia.com/gpu"] = str(gpus)
    kube.core.create_node(node)


def complete_rayjob(kube: Kube, ns: str, name: str, job_status: str = "SUCCEEDED") -> None:
    """Write what KubeRay writes when the Ray job ends (a simulated step: kwok runs no Ray; the other is the
    dashboard stand-in's jobStatus RUNNING, conftest.py's ray_dashboard)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    deploy = "Complete" if job_status == "SUCCEEDED" else "Failed"
    kube.custom.patch_namespaced_custom_object_status(
        "ray.io", "v1", ns, "rayjobs", name,
        {"status": {"jobStatus": job_status, "jobDeploymentStatus": deploy, "endTime": now}},
        _content_type="application/merge-patch+json",
    )


@pytest.fixture(name="namespace")
def emptied_namespace(namespace: str, kube: Kube) -> Iterator[str]:
    """conftest's namespace, emptied of its jobs' pods before it is deleted: the namespace controller,
    finding pods still terminating, re-checks only after their grace period (~15 s a test); pods already
    gone make the deletion take a second or two."""
    yield namespace
    for ftj_obj in kube.custom.list_namespaced_custom_object(G, V, namespace, P)["items"]:
        try:
            kube.custom.delete_namespaced_custom_object(G, V, namespace, P, ftj_obj["metadata"]["name"])
        except ApiException as e:
            if e.status != 404:
                raise
    deadline = time.monotonic() + 60  # best effort (a failed test may leave a finalizer): never fails here
    while kube.core.list_namespaced_pod(namespace).items and time.monotonic() < deadline:
        time.sleep(0.25)


# ------------------------------------------------------------------------------- dev cluster control


def restart_component(cluster: Any, name: str, env: dict[str, str] | None = None) -> None:
    """Stop one dev-cluster component and start it again with the same command line (plus `env`)."""
    cluster.restart(name, env=env)


def kuberay_ready(cluster: Any) -> bool:
    port = cluster.port("ray-probe")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return bool(r.read().decode() == "ok")
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ admission


def denial(call: Callable[[], object], timeout: float = 30) -> ApiException:
    """The API server's rejection of `call`. Policies and their parameters reach the admission plugin
    through informers, so a freshly applied policy may take a moment: retry until denied."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call()
        except ApiException as err:
            if err.status in (403, 422):
                return err
            raise
        if time.monotonic() > deadline:
            pytest.fail("the API server accepted it")
        time.sleep(0.5)


def dry_create(kube: Kube, ns: str, doc: dict[str, Any]) -> Callable[[], object]:
    return lambda: kube.custom.create_namespaced_custom_object(G, V, ns, P, doc, dry_run="All")
