"""The Helm chart in deploy/helm/finetune-operator/, with real helm (built from its Go module):
lint --strict, template against a golden file, the same objects as the kustomize base, the values
schema rejecting bad values, the files it shares with the rest of the repository kept identical.
Installing it on the dev cluster is tests/integration/test_helm_install.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_operator.api.instance_types import from_params

from tests.deploy.helm_scenarios import CHART, NS, NS_OTHER, SCENARIOS, scenario_namespace

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "helm"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version", "app.kubernetes.io/name")


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False,
                          env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": "/tmp/helm-test-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-test-config", "HELM_DATA_HOME": "/tmp/helm-test-data"})


def template(helm: Path, *args: str, namespace: str = NS) -> str:
    # No --include-crds: the CRD is crds/ byte for byte (test below), so API changes do not churn the golden.
    res = helm_run(helm, "template", "finetune-operator", str(CHART), "--namespace", namespace, *args)
    assert res.returncode == 0, res.stderr
    return res.stdout


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_lint_strict(helm: Path) -> None:
    for name, args in SCENARIOS.items():
        res = helm_run(helm, "lint", "--strict", str(CHART), "--namespace", scenario_namespace(name), *args)
        assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"
        assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("name", sorted(SCENARIOS), ids=sorted(SCENARIOS))
def test_template_matches_golden(helm: Path, name: str, request: pytest.FixtureRequest) -> None:
    out = template(helm, *SCENARIOS[name], namespace=scenario_namespace(name))
    golden = GOLDEN / f"{name}.yaml"
    if request.config.getoption("--update-golden"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out)
    assert golden.exists(), f"missing {golden}: run pytest --update-golden {__file__}"
    assert out == golden.read_text(), f"helm template differs from {golden}; review and refresh with --update-golden"


def _normal(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as compared across helm and kustomize: chart bookkeeping labels dropped, RBAC rules as
    the set of (group, resource, verb) they grant (the chart groups rules per scope)."""
    obj = yaml.safe_load(yaml.safe_dump(obj))
    labels = obj["metadata"].pop("labels", {}) or {}
    for key in HELM_LABELS:
        labels.pop(key, None)
    if labels:
        obj["metadata"]["labels"] = labels
    if obj["kind"] in ("ClusterRole", "Role"):
        obj["rules"] = sorted({(g, r, v) for rule in obj.get("rules", []) for g in rule["apiGroups"]
                               for r in rule["resources"] for v in rule["verbs"]})
    return obj


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _kustomize(path: str) -> list[dict[str, Any]]:
    return docs(subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True, text=True,
                               timeout=60, check=True).stdout)


# The chart against each kustomization it has values for. What differs on purpose, and nothing else:
# the Namespace (left to `helm install --create-namespace`), the chart's bookkeeping labels (_normal),
# and for TLS the cert-manager Issuers/Certificates of examples/tls-operator (the chart takes the Secret
# they produce: progress.tls.secretName).
PARITY: dict[str, tuple[str, list[str], set[str]]] = {
    "defaults": ("deploy", [], set()),
    "namespaced": ("examples/namespaced-operator", ["--set", "rbac.scope=namespaces", "--set", "rbac.namespaces={ml-team}"],
                   set()),
    "tls": ("examples/tls-operator", ["--set", "progress.tls.enabled=true", "--set",
                                      "progress.tls.secretName=finetune-operator-tls"], {"Issuer", "Certificate"}),
}


@pytest.mark.parametrize("name", sorted(PARITY), ids=sorted(PARITY))
def test_chart_renders_the_same_objects_as_kustomize(helm: Path, name: str) -> None:
    path, args, not_in_chart = PARITY[name]
    kust = _kustomize(path)
    assert {o["kind"] for o in kust} >= not_in_chart  # the exceptions exist (else drop them here)
    want = {_key(o): _normal(o) for o in kust if o["kind"] not in {"Namespace", *not_in_chart}}
    got = {_key(o): _normal(o) for o in docs(template(helm, *args)) if o["kind"] != "CustomResourceDefinition"}
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


def test_release_namespace_replaces_finetune_system_everywhere(helm: Path) -> None:
    # Admission parameters, the policy's messages, bindings' subjects, the progress URL: all follow the
    # release namespace (the operator reads its configuration from its own namespace).
    out = template(helm, namespace=NS_OTHER)
    assert NS not in out
    objs = {_key(o): o for o in docs(out)}
    fit = objs[("ValidatingAdmissionPolicyBinding", "", "finetune-instance-fit")]
    assert fit["spec"]["paramRef"]["namespace"] == NS_OTHER
    assert ("ConfigMap", NS_OTHER, "finetune-instance-types") in objs
    assert ("ConfigMap", NS_OTHER, "finetune-operator-policy") in objs
    allowed = objs[("ValidatingAdmissionPolicy", "", "finetune-allowed-images")]
    assert f"ConfigMap {NS_OTHER}/finetune-operator-policy" in allowed["spec"]["validations"][0]["messageExpression"]


def test_chart_ships_the_repositorys_crd_and_observability_files() -> None:
    # Helm reads only files inside the chart: these are copies, kept identical here (cp to refresh).
    pairs = [
        (ROOT / "crds" / "finetune.dev_finetunejobs.yaml", CHART / "crds" / "finetune.dev_finetunejobs.yaml"),
        (ROOT / "deploy" / "observability" / "prometheusrule.yaml", CHART / "files" / "prometheusrule.yaml"),
        (ROOT / "deploy" / "observability" / "finetune-dashboard.json", CHART / "files" / "finetune-dashboard.json"),
        (ROOT / "deploy" / "admission.yaml", CHART / "files" / "admission.yaml"),
        (ROOT / "deploy" / "instance-types.yaml", CHART / "files" / "instance-types.yaml"),
    ]
    for source, copy in pairs:
        assert copy.read_bytes() == source.read_bytes(), f"cp {source.relative_to(ROOT)} {copy.relative_to(ROOT)}"


def test_everything_scenario_wires_tls_metrics_and_policy(helm: Path) -> None:
    objs = {_key(o): o for o in docs(template(helm, *SCENARIOS["everything"]))}
    dep = objs[("Deployment", NS, "finetune-operator")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--progress-url=https://finetune-operator.finetune-system.svc:8080" in c["args"]
    assert "--tls-cert=/etc/finetune/tls/tls.crt" in c["args"]
    assert "--progress-ca=/etc/finetune/tls/ca.crt" in c["args"]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert c["image"].endswith("@sha256:" + "0" * 64)
    assert dep["spec"]["replicas"] == 3
    rule = objs[("PrometheusRule", NS, "finetune-operator")]
    source = yaml.safe_load((ROOT / "deploy" / "observability" / "prometheusrule.yaml").read_text())
    assert rule["spec"] == source["spec"]
    board = objs[("ConfigMap", NS, "finetune-operator-dashboard")]
    assert board["data"]["finetune-dashboard.json"] == (ROOT / "deploy/observability/finetune-dashboard.json").read_text().rstrip("\n")
    policy = objs[("ConfigMap", NS, "finetune-operator-policy")]
    assert policy["data"]["allowedServiceAccounts"].split() == ["default", "trainer"]
    extra = objs[("ConfigMap", NS, "finetune-instance-types-extra")]
    assert extra["metadata"]["labels"]["finetune.dev/instance-types"] == "true"
    assert from_params(extra["data"], "extra")["g6e.12xlarge"].gpus == 4  # what the operator reads
    endpoint = objs[("PodMonitor", NS, "finetune-operator")]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "finetune-operator-tls", "key": "ca.crt"}


def test_namespaced_scope_binds_per_namespace_and_watches_only_them(helm: Path) -> None:
    objs = {_key(o): o for o in docs(template(helm, *SCENARIOS["namespaced"]))}
    for ns in ("team-a", "team-b"):
        assert objs[("RoleBinding", ns, "finetune-operator-children")]["roleRef"]["name"] == "finetune-operator-children"
    assert ("ClusterRoleBinding", "", "finetune-operator-children") not in objs
    # Reading stays cluster-wide; writing children only where bound.
    assert objs[("ClusterRoleBinding", "", "finetune-operator")]["roleRef"]["name"] == "finetune-operator"
    writes = {(r, v) for _, r, v in _normal(objs[("ClusterRole", "", "finetune-operator")])["rules"]}
    assert not writes & {("rayjobs", "create"), ("configmaps", "create"), ("configmaps", "patch")}
    args = objs[("Deployment", NS, "finetune-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_service_routes_to_the_leader_and_every_replica_is_ready(helm: Path) -> None:
    objs = {_key(o): o for o in docs(template(helm))}
    assert objs[("Service", NS, "finetune-operator")]["spec"]["selector"]["finetune.dev/operator-leader"] == "true"
    c = objs[("Deployment", NS, "finetune-operator")]["spec"]["template"]["spec"]["containers"][0]
    assert "--pod-name=$(POD_NAME)" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    leader = _normal(objs[("Role", NS, "finetune-operator-leader")])["rules"]
    assert ("", "pods", "patch") in leader and ("", "configmaps", "watch") in leader


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "replicas=0"], "/replicas"),
        (["--set", "rbac.scope=everywhere"], "/rbac/scope"),
        (["--set", "rbac.namespaces={Bad_NS}"], "/rbac/namespaces/0"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "metrics.podMonitor.interval=soon"], "/metrics/podMonitor/interval"),
        (["--set", "progress.tls.caKey=../ca"], "/progress/tls/caKey"),
        (["--set", "instanceTypes.g6e\\.12xlarge.gpus=4"], "/instanceTypes/g6e.12xlarge"),
        (["--set", "imagePullPolicy=Always"], "imagePullPolicy"),
        (["--set", "progress.tls.enabled=true"], "progress.tls.secretName: required"),
        (["--set", "rbac.scope=namespaces"], "rbac.namespaces: list at least one namespace"),
    ],
    ids=["replicas", "scope", "namespace-name", "pull-policy", "interval", "ca-key", "instance-type-figures",
         "unknown-key", "tls-secret", "no-namespaces"],
)
def test_bad_values_are_rejected_with_the_field_named(helm: Path, args: list[str], message: str) -> None:
    res = helm_run(helm, "template", "x", str(CHART), "--namespace", NS, *args)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr


def test_dev_cluster_values_make_the_chart_what_the_demo_makes_of_deploy(helm: Path, tmp_path: Path) -> None:
    # The real-node e2e test installs the chart with demo.chart_values; `make demo-cluster` applies deploy/
    # adapted by demo.adapt_deploy. Same objects (both keep production's replicas, RollingUpdate and pod
    # network), except the order of the args.
    from finetune_devcluster import demo

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(demo.chart_values()))
    kust = demo.adapt_deploy(_kustomize("deploy"))
    want = {_key(o): _normal(o) for o in kust if o["kind"] != "Namespace"}
    got = {_key(o): _normal(o) for o in docs(template(helm, "-f", str(values))) if o["kind"] != "CustomResourceDefinition"}
    assert sorted(got) == sorted(want)
    dep = ("Deployment", NS, "finetune-operator")
    assert got[dep]["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert got[dep]["spec"]["replicas"] == 2
    for objs in (got, want):
        c = objs[dep]["spec"]["template"]["spec"]["containers"][0]
        c["args"] = sorted(c["args"])
    for key in want:
        assert got[key] == want[key], key
