"""Admission on the real API server: what deploy/ rejects at `kubectl apply` time, with the API server's
own messages. deploy/ (RBAC, ValidatingAdmissionPolicies, their ConfigMaps) is installed as shipped;
the operator's ServiceAccount is used through a token, as in-cluster."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.api.validation import check
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.admission_table import ROWS, Row
from tests.builders import ftj
from tests.integration.conftest import Kube, create_namespace
from tests.integration.operator_fixtures import ROOT, install_deploy, service_account_kubeconfig, token_kubeconfig
from tests.integration.support import G, P, V, denial, dry_create


@pytest.fixture(scope="module")
def deployed(control_plane: Any) -> None:
    install_deploy(Path(control_plane.kubeconfig))


@pytest.fixture(scope="module")
def operator_sa(control_plane: Any, deployed: None, tmp_path_factory: pytest.TempPathFactory) -> client.ApiClient:
    path = service_account_kubeconfig(Path(control_plane.kubeconfig), tmp_path_factory.mktemp("sa") / "kubeconfig")
    return config.new_client_from_config(config_file=str(path))


def test_name_must_be_a_dns1035_label(kube: Kube, namespace: str, deployed: None) -> None:
    err = denial(dry_create(kube, namespace, ftj("qwen2.5-ft")))
    assert err.status == 422
    assert "metadata.name: must be a DNS-1035 label" in err.body, err.body
    kube.custom.create_namespaced_custom_object(G, V, namespace, P, ftj("qwen25-ft"), dry_run="All")


# ----------------------------------------------------------------------------- issue 30: one table, two checkers


@pytest.fixture(scope="module")
def table_namespace(kube: Kube) -> Iterator[str]:
    name = f"t-admission-table-{uuid.uuid4().hex[:6]}"
    create_namespace(kube.core, name, timeout=30)
    yield name
    kube.core.delete_namespace(name)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_api_server_and_finetune_validate_agree(kube: Kube, table_namespace: str, row: Row) -> None:
    """tests/admission_table.py through `finetune validate`'s check() and a server-side dry run with the
    generated CRD: the same verdict, and the row's field path in both messages. (Where deploy/'s policies
    are installed by another test of this module, they have nothing to say about the valid rows.)"""
    doc = row.doc()
    job, issues = check(doc)
    errors = [str(i) for i in issues if i.severity == "error"]
    try:
        kube.custom.create_namespaced_custom_object(G, V, table_namespace, P, doc, dry_run="All")
        server: ApiException | None = None
    except ApiException as err:
        server = err
    if row.path is None:
        assert job is not None and not errors, errors
        assert server is None, server.body if server else ""
        return
    assert job is None and any(e.startswith(row.path) for e in errors), errors
    assert server is not None, f"the API server accepted {row.id}; finetune validate said {errors}"
    assert server.status == 422, server.body
    message = json.loads(server.body)["message"]
    assert row.path in message, message


FIT = [
    ("8-gpus-on-g6.12xlarge", {"cluster__workers": {"replicas": 2, "gpusPerWorker": 8}, "training__globalBatchSize": 64},
     "spec.cluster.workers.gpusPerWorker: 8 GPUs per worker do not fit g6.12xlarge (4 GPUs per node)"),
    ("2-efa-on-g6.12xlarge", {"cluster__efaInterfacesPerWorker": 2},
     "spec.cluster.efaInterfacesPerWorker: 2 EFA interfaces do not fit g6.12xlarge (1)"),
    ("memory-over-allocatable", {"cluster__workers": {"replicas": 2, "gpusPerWorker": 4, "memory": "190Gi"}},
     "spec.cluster.workers.memory: 190Gi (+5120Mi hugepages) exceeds g6.12xlarge's allocatable 195043Mi"),
    ("cpu-over-allocatable", {"cluster__workers": {"replicas": 2, "gpusPerWorker": 4, "cpu": "48"}},
     "spec.cluster.workers.cpu: 48 CPUs exceed g6.12xlarge's allocatable 47810m"),
    ("efa-on-a-cpu-type", {"cluster__instanceType": "m5.2xlarge", "cluster__workers": {"replicas": 2, "gpusPerWorker": 0},
                           "training__globalBatchSize": 4, "training__precision": "fp32"},
     "spec.network.efa: m5.2xlarge has no EFA interfaces; set network.efa: false"),
]


@pytest.mark.parametrize(("sets", "message"), [f[1:] for f in FIT], ids=[f[0] for f in FIT])
def test_instance_fit_is_enforced_at_admission(kube: Kube, namespace: str, deployed: None, sets: dict[str, Any],
                                               message: str) -> None:
    err = denial(dry_create(kube, namespace, ftj("fit", **sets)))
    assert err.status == 422, err.body
    assert "ValidatingAdmissionPolicy 'finetune-instance-fit'" in err.body, err.body
    assert message in err.body, err.body


def test_unknown_type_passes_until_a_configmap_describes_it(kube: Kube, namespace: str, deployed: None) -> None:
    big = ftj("g6e", cluster__instanceType="g6e.12xlarge", cluster__workers={"replicas": 2, "gpusPerWorker": 8},
              training__globalBatchSize=64)
    # No ConfigMap knows g6e.12xlarge: not a dead end at admission (the operator takes node figures).
    kube.custom.create_namespaced_custom_object(G, V, namespace, P, big, dry_run="All")
    extra = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=f"extra-{uuid.uuid4().hex[:6]}", namespace="finetune-system",
                                     labels={"finetune.dev/instance-types": "true"}),
        data={"g6e.12xlarge.gpus": "4", "g6e.12xlarge.efaInterfaces": "1", "g6e.12xlarge.allocatableCPU": "47810m",
              "g6e.12xlarge.allocatableMemory": "380000Mi", "g6e.12xlarge.gpuModel": "L40S"})
    kube.core.create_namespaced_config_map("finetune-system", extra)
    try:
        err = denial(dry_create(kube, namespace, big))
        assert "8 GPUs per worker do not fit g6e.12xlarge (4 GPUs per node)" in err.body, err.body
        ok = ftj("g6e", cluster__instanceType="g6e.12xlarge")
        kube.custom.create_namespaced_custom_object(G, V, namespace, P, ok, dry_run="All")
    finally:
        kube.core.delete_namespaced_config_map(extra.metadata.name, "finetune-system")


ALLOW = [
    ("image", {"cluster__image": "docker.io/evil/miner:latest"},
     "spec.cluster.image: docker.io/evil/miner:latest is not in the allowed images "
     "(public.ecr.aws/deep-learning-containers/ray:*; ConfigMap finetune-system/finetune-operator-policy)"),
    ("service-account", {"cluster__serviceAccountName": "cluster-admin"},
     "spec.cluster.serviceAccountName: cluster-admin is not in the allowed service accounts (default;"),
]


@pytest.mark.parametrize(("sets", "message"), [a[1:] for a in ALLOW], ids=[a[0] for a in ALLOW])
def test_allow_list_is_enforced_at_admission(kube: Kube, namespace: str, deployed: None, sets: dict[str, Any],
                                             message: str) -> None:
    err = denial(dry_create(kube, namespace, ftj("allow", **sets)))
    assert err.status == 403, err.body
    assert "ValidatingAdmissionPolicy 'finetune-allowed-images'" in err.body and message in err.body, err.body


# ----------------------------------------------------------------------------- the operator's own scope


def _cm(name: str, labels: dict[str, str] | None = None) -> client.V1ConfigMap:
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, labels=labels), data={"k": "v"})


def test_operator_service_account_writes_only_its_own_objects(kube: Kube, namespace: str,
                                                             operator_sa: client.ApiClient) -> None:
    core = client.CoreV1Api(operator_sa)
    custom = client.CustomObjectsApi(operator_sa)
    labelled = {"finetune.dev/job": "x"}
    # RBAC lets it write ConfigMaps anywhere; the policy stops it in system namespaces...
    # (Denials are probed with dry runs: admission runs for them, and nothing is left behind if a
    # policy is not active yet.)
    err = denial(lambda: core.create_namespaced_config_map("kube-system", _cm("aws-auth-2", labelled), dry_run="All"))
    assert err.status == 403
    assert "may not write configmaps in the system namespace kube-system" in err.body, err.body
    # ...and outside its own labelled objects.
    err = denial(lambda: core.create_namespaced_config_map(namespace, _cm("plain"), dry_run="All"))
    assert "may only write configmaps labelled finetune.dev/job" in err.body, err.body
    kube.core.create_namespaced_config_map(namespace, _cm("users-own"))
    err = denial(lambda: core.patch_namespaced_config_map("users-own", namespace,
                                                          {"metadata": {"labels": labelled}, "data": {"k": "owned"}},
                                                          dry_run="All"))
    assert "may not change configmaps users-own: it does not carry the finetune.dev/job label" in err.body, err.body
    assert kube.core.read_namespaced_config_map("users-own", namespace).data == {"k": "v"}
    err = denial(lambda: custom.create_namespaced_custom_object(
        "ray.io", "v1", namespace, "rayjobs", {"apiVersion": "ray.io/v1", "kind": "RayJob",
                                               "metadata": {"name": "rj"}, "spec": {"entrypoint": "true"}},
        dry_run="All"))
    assert "may only write rayjobs labelled finetune.dev/job" in err.body, err.body
    # What it is for still works.
    core.create_namespaced_config_map(namespace, _cm("mine", labelled))
    core.patch_namespaced_config_map("mine", namespace, {"data": {"k": "w"}})


@pytest.fixture
def scoped_operator(kube: Kube, control_plane: Any, deployed: None,
                    tmp_path: Path) -> Iterator[tuple[client.ApiClient, str, str]]:
    """A second operator installation confined to one namespace, exactly as
    examples/namespaced-operator/ binds it: the read-only ClusterRole, and the children ClusterRole
    through a RoleBinding in the chosen namespace only."""
    suffix = uuid.uuid4().hex[:6]
    system, allowed, other = f"ft-sys-{suffix}", f"ft-team-{suffix}", f"ft-other-{suffix}"
    rb = yaml.safe_load((ROOT / "examples" / "namespaced-operator" / "rolebindings.yaml").read_text())
    for ns in (system, allowed, other):
        kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    try:
        kube.core.create_namespaced_service_account(system, client.V1ServiceAccount(
            metadata=client.V1ObjectMeta(name="finetune-operator")))
        subject = [{"kind": "ServiceAccount", "name": "finetune-operator", "namespace": system}]
        kube.rbac.create_cluster_role_binding({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"finetune-operator-{suffix}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "finetune-operator"},
            "subjects": subject})
        rb["metadata"]["namespace"] = allowed
        rb["subjects"] = subject
        kube.rbac.create_namespaced_role_binding(allowed, rb)
        token = kube.core.create_namespaced_service_account_token("finetune-operator", system, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))).status.token
        path = token_kubeconfig(Path(control_plane.kubeconfig), tmp_path / "kubeconfig", token, "scoped")
        yield config.new_client_from_config(config_file=str(path)), allowed, other
    finally:
        kube.rbac.delete_cluster_role_binding(f"finetune-operator-{suffix}")
        for ns in (system, allowed, other):
            kube.core.delete_namespace(ns)


def test_namespaced_role_bindings_confine_the_operator(scoped_operator: tuple[client.ApiClient, str, str]) -> None:
    api, allowed, other = scoped_operator
    core = client.CoreV1Api(api)
    labelled = {"finetune.dev/job": "x"}
    deadline = time.monotonic() + 30
    while True:  # RBAC caches catch up with new bindings within a moment
        try:
            core.create_namespaced_config_map(allowed, _cm("child", labelled))
            break
        except ApiException as err:
            if err.status != 403 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(other, _cm("child", labelled))
    assert err.value.status == 403
    message = json.loads(err.value.body)["message"]
    assert f'cannot create resource "configmaps" in API group "" in the namespace "{other}"' in message, message
