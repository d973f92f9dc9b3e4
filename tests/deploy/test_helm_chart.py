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

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "finetune-operator"
GOLDEN = ROOT / "tests" / "golden" / "helm"
NS = "finetune-system"
# Scenarios rendered to tests/golden/helm/<name>.yaml (refresh: pytest --update-golden).
SCENARIOS: dict[str, list[str]] = {
    "defaults": [],
    "everything": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
                   "--set", "metrics.dashboard.enabled=true", "--set", "progress.tls.enabled=true",
                   "--set", "progress.tls.secretName=finetune-operator-tls",
                   "--set", "policy.allowedImages={public.ecr.aws/deep-learning-containers/ray:*}",
                   "--set", "policy.allowedServiceAccounts={default,trainer}",
                   "--set", "image.digest=sha256:" + "0" * 64, "--set", "replicas=3"],
    "namespaced": ["--set", "rbac.scope=namespaces", "--set", "rbac.namespaces={team-a,team-b}"],
}
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version", "app.kubernetes.io/name")


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False,
                          env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": "/tmp/helm-test-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-test-config", "HELM_DATA_HOME": "/tmp/helm-test-data"})


def template(helm: Path, *args: str) -> str:
    # No --include-crds: the CRD is crds/ byte for byte (test below), so API changes do not churn the golden.
    res = helm_run(helm, "template", "finetune-operator", str(CHART), "--namespace", NS, *args)
    assert res.returncode == 0, res.stderr
    return res.stdout


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_lint_strict(helm: Path) -> None:
    for name, args in SCENARIOS.items():
        res = helm_run(helm, "lint", "--strict", str(CHART), "--namespace", NS, *args)
        assert res.returncode == 0, f"{name}: {res.stdout}{res.stderr}"
        assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("name", sorted(SCENARIOS), ids=sorted(SCENARIOS))
def test_template_matches_golden(helm: Path, name: str, request: pytest.FixtureRequest) -> None:
    out = template(helm, *SCENARIOS[name])
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


def test_defaults_render_the_same_objects_as_kustomize(helm: Path) -> None:
    kust = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy")], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    # The Namespace is the one object the chart leaves to `helm install --create-namespace`.
    want = {_key(o): _normal(o) for o in docs(kust) if o["kind"] != "Namespace"}
    got = {_key(o): _normal(o) for o in docs(template(helm)) if o["kind"] != "CustomResourceDefinition"}
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


def test_chart_ships_the_repositorys_crd_and_observability_files() -> None:
    # Helm reads only files inside the chart: these are copies, kept identical here (cp to refresh).
    pairs = [
        (ROOT / "crds" / "finetune.dev_finetunejobs.yaml", CHART / "crds" / "finetune.dev_finetunejobs.yaml"),
        (ROOT / "deploy" / "observability" / "prometheusrule.yaml", CHART / "files" / "prometheusrule.yaml"),
        (ROOT / "deploy" / "observability" / "finetune-dashboard.json", CHART / "files" / "finetune-dashboard.json"),
    ]
    for source, copy in pairs:
        assert copy.read_bytes() == source.read_bytes(), f"cp {source.relative_to(ROOT)} {copy.relative_to(ROOT)}"


def test_everything_scenario_wires_tls_metrics_and_policy(helm: Path) -> None:
    objs = {_key(o): o for o in docs(template(helm, *SCENARIOS["everything"]))}
    dep = objs[("Deployment", NS, "finetune-operator")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--progress-url=https://finetune-operator.finetune-system.svc:8080" in c["args"]
    assert "--tls-cert=/etc/finetune/tls/tls.crt" in c["args"]
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
    assert objs[("ServiceMonitor", NS, "finetune-operator")]["spec"]["endpoints"][0]["scheme"] == "https"


def test_namespaced_scope_binds_per_namespace_and_watches_only_them(helm: Path) -> None:
    objs = {_key(o): o for o in docs(template(helm, *SCENARIOS["namespaced"]))}
    assert ("RoleBinding", "team-a", "finetune-operator") in objs and ("RoleBinding", "team-b", "finetune-operator") in objs
    assert ("ClusterRoleBinding", "", "finetune-operator") not in objs
    cluster_rules = _normal(objs[("ClusterRole", "", "finetune-operator-cluster")])["rules"]
    assert {r for _, r, _ in cluster_rules} == {"nodes", "tokenreviews", "customresourcedefinitions", "namespaces"}
    args = objs[("Deployment", NS, "finetune-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "replicas=0"], "/replicas"),
        (["--set", "rbac.scope=everywhere"], "/rbac/scope"),
        (["--set", "rbac.namespaces={Bad_NS}"], "/rbac/namespaces/0"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "metrics.serviceMonitor.interval=soon"], "/metrics/serviceMonitor/interval"),
        (["--set", "imagePullPolicy=Always"], "imagePullPolicy"),
        (["--set", "progress.tls.enabled=true"], "progress.tls.secretName: required"),
        (["--set", "rbac.scope=namespaces"], "rbac.namespaces: list at least one namespace"),
    ],
    ids=["replicas", "scope", "namespace-name", "pull-policy", "interval", "unknown-key", "tls-secret", "no-namespaces"],
)
def test_bad_values_are_rejected_with_the_field_named(helm: Path, args: list[str], message: str) -> None:
    res = helm_run(helm, "template", "x", str(CHART), "--namespace", NS, *args)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
