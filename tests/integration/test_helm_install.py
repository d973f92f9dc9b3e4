"""The Helm chart on the dev cluster with real helm: install, upgrade, uninstall, and a server-side
dry run of every object the chart can render (the Prometheus Operator's CRDs installed from its Go
module, so PodMonitor and PrometheusRule are checked by the API server too).

What this does not show: the operator *process* running from the chart. kwok plays kubelet here, so
the Deployment's pods are scheduled and marked Running/Ready by kwok without any container; the
operator itself runs as a process in tests/integration/test_operator.py."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster.upstream_crds import crd_files
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.builders import ftj
from tests.deploy.helm_scenarios import CHART, SCENARIOS, scenario_namespace
from tests.integration.conftest import Kube, wait_for
from tests.integration.support import denial, dry_create

NS = "finetune-system"
RELEASE = "finetune-operator"


class Helm:
    def __init__(self, binary: Path, kubeconfig: Path, home: Path):
        self.binary = binary
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "KUBECONFIG": str(kubeconfig),
                    "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                    "HELM_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([str(self.binary), *args], capture_output=True, text=True, timeout=300, env=self.env,
                             check=False)
        if check:
            assert res.returncode == 0, f"helm {' '.join(args)}:\n{res.stdout}\n{res.stderr}"
        return res


def kubectl(kube: Kube, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args], input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def helm_cli(helm: Path, kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    h = Helm(helm, kube.kubeconfig, tmp_path_factory.mktemp("helm-home"))
    yield h
    h("uninstall", RELEASE, "-n", NS, "--wait", check=False)


@pytest.fixture(scope="module")
def monitoring_crds(kube: Kube) -> None:
    files = crd_files("prometheus-operator")
    args = [a for f in files for a in ("-f", str(f))]
    res = kubectl(kube, "apply", "--server-side", *args)
    assert res.returncode == 0, res.stderr
    res = kubectl(kube, "wait", "--for=condition=Established", "--timeout=60s",
                  "crd/podmonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("scenario", sorted(SCENARIOS), ids=sorted(SCENARIOS))
def test_every_rendered_object_passes_a_server_side_dry_run(helm_cli: Helm, kube: Kube, monitoring_crds: None,
                                                           scenario: str) -> None:
    release_ns = scenario_namespace(scenario)
    rendered = helm_cli("template", RELEASE, str(CHART), "-n", release_ns, "--include-crds", *SCENARIOS[scenario]).stdout
    objs = [o for o in yaml.safe_load_all(rendered) if o]
    for ns in {o["metadata"].get("namespace") for o in objs} - {None}:
        kubectl(kube, "create", "namespace", ns)  # the release namespace; the namespaced scenario's team-a, team-b
    res = kubectl(kube, "apply", "--dry-run=server", "--server-side", "--force-conflicts", "-f", "-", stdin=rendered)
    assert res.returncode == 0, res.stderr
    assert len([line for line in res.stdout.splitlines() if "(server dry run)" in line]) == len(objs), res.stdout


def _deployment(kube: Kube) -> Any:
    return kube.apps.read_namespaced_deployment("finetune-operator", NS)


def _admitted(kube: Kube, doc: dict[str, Any]) -> bool:
    try:
        dry_create(kube, "default", doc)()
    except ApiException as err:
        if err.status in (403, 422):
            return False
        raise
    return True


def test_install_upgrade_uninstall(helm_cli: Helm, kube: Kube, monitoring_crds: None) -> None:
    # Other tests applied deploy/ with kubectl: this is the move from kustomize to Helm (docs/install.md).
    # Taking the objects over, not deleting them first: re-creating the ValidatingAdmissionPolicies with
    # their bindings and parameters in a batch leaves finetune-instance-fit without its selector-matched
    # parameters on this API server (kubernetes/kubernetes#133827; parameterNotFoundAction Allow admits).
    out = helm_cli("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", "--wait", "--timeout", "3m",
                   "--take-ownership", "--force-conflicts", "--set", "metrics.prometheusRule.enabled=true").stdout
    assert "finetune preflight" in out  # NOTES.txt tells the user what to run next
    dep = _deployment(kube)
    assert dep.metadata.labels["app.kubernetes.io/managed-by"] == "Helm"
    wait_for("Deployment Available (pods simulated by kwok)", lambda: any(
        c.type == "Available" and c.status == "True" for c in (_deployment(kube).status.conditions or [])), timeout=120)
    assert kube.rbac.read_cluster_role("finetune-operator").rules
    rule = kube.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", NS, "prometheusrules", "finetune-operator")
    assert rule["spec"]["groups"][0]["name"] == "finetune-jobs"
    # The chart's admission policies work with the chart's parameters (instance figures, allow-list).
    err = denial(dry_create(kube, "default", ftj("too-big", cluster__workers={"replicas": 2, "gpusPerWorker": 8},
                                                 training__globalBatchSize=64)))
    assert "8 GPUs per worker do not fit g6.12xlarge (4 GPUs per node)" in err.body, err.body
    mine = ftj("mine", cluster__image="registry.example/ray:2.55.0")
    err = denial(dry_create(kube, "default", mine))
    assert f"not in the allowed images (public.ecr.aws/deep-learning-containers/ray:*; ConfigMap {NS}/finetune-operator-policy)" \
        in err.body, err.body

    # kubectl still co-owns the fields it applied with the same values: changing them takes --force-conflicts.
    helm_cli("upgrade", RELEASE, str(CHART), "-n", NS, "--wait", "--timeout", "3m", "--reuse-values", "--force-conflicts",
             "--set", "replicas=1", "--set", "metrics.dashboard.enabled=true", "--set", "operator.workers=8",
             "--set", "policy.allowedImages={public.ecr.aws/deep-learning-containers/ray:*,registry.example/ray:*}",
             "--set-json", 'instanceTypes={"g6e.12xlarge": {"gpus": 4, "efaInterfaces": 1, "allocatableCPU": "47810m", '
             '"allocatableMemory": "356000Mi", "gpuModel": "L40S"}}')
    wait_for("the upgraded allow-list admits registry.example", lambda: _admitted(kube, mine), timeout=30)
    err = denial(dry_create(kube, "default", ftj("too-big-g6e", cluster__instanceType="g6e.12xlarge",
                                                 cluster__workers={"replicas": 2, "gpusPerWorker": 8},
                                                 training__globalBatchSize=64)))
    assert "8 GPUs per worker do not fit g6e.12xlarge (4 GPUs per node)" in err.body, err.body
    dep = _deployment(kube)
    assert dep.spec.replicas == 1
    assert "--workers=8" in dep.spec.template.spec.containers[0].args
    assert kube.core.read_namespaced_config_map("finetune-operator-dashboard", NS).data["finetune-dashboard.json"]
    history = json.loads(helm_cli("history", RELEASE, "-n", NS, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"

    helm_cli("uninstall", RELEASE, "-n", NS, "--wait")
    for read in (lambda: _deployment(kube), lambda: kube.rbac.read_cluster_role("finetune-operator"),
                 lambda: kube.core.read_namespaced_service_account("finetune-operator", NS),
                 lambda: kube.core.read_namespaced_config_map("finetune-instance-types", NS),
                 lambda: client.AdmissionregistrationV1Api(kube.api_client).read_validating_admission_policy(
                     "finetune-allowed-images")):
        with pytest.raises(ApiException) as err:
            read()
        assert err.value.status == 404
    # Helm never deletes what crds/ installed: FinetuneJobs survive an uninstall.
    assert kube.apiext.read_custom_resource_definition("finetunejobs.finetune.dev")
