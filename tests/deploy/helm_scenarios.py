"""The Helm chart and the value scenarios its tests render (tests/deploy/test_helm_chart.py) and install
(tests/integration/test_helm_install.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "finetune-operator"
NS = "finetune-system"
# Scenarios rendered to tests/golden/helm/<name>.yaml (refresh: pytest --update-golden).
SCENARIOS: dict[str, list[str]] = {
    "defaults": [],
    "everything": ["--set", "metrics.podMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true",
                   "--set", "metrics.dashboard.enabled=true", "--set", "progress.tls.enabled=true",
                   "--set", "progress.tls.secretName=finetune-operator-tls",
                   "--set", "policy.allowedImages={public.ecr.aws/deep-learning-containers/ray:*}",
                   "--set", "policy.allowedServiceAccounts={default,trainer}",
                   "--set", "image.digest=sha256:" + "0" * 64, "--set", "replicas=3",
                   "--set-json", 'instanceTypes={"g6e.12xlarge": {"gpus": 4, "efaInterfaces": 1, "allocatableCPU": '
                   '"47810m", "allocatableMemory": "356000Mi", "gpuModel": "L40S"}}'],
    "namespaced": ["--set", "rbac.scope=namespaces", "--set", "rbac.namespaces={team-a,team-b}"],
    "other-namespace": [],  # rendered into NS_OTHER: nothing may still name finetune-system
}
NS_OTHER = "ml-platform"


def scenario_namespace(name: str) -> str:
    return NS_OTHER if name == "other-namespace" else NS
