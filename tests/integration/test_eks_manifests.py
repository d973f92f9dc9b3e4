"""deploy/eks/karpenter.yaml through the API server: Karpenter's CRDs (from its Go module, with their
CEL rules) installed on the dev cluster, a server-side dry run of the NodePool and EC2NodeClass."""

from __future__ import annotations

import subprocess
from pathlib import Path

from finetune_devcluster.upstream_crds import crd_files

from tests.integration.conftest import Kube

ROOT = Path(__file__).resolve().parents[2]


def kubectl(kube: Kube, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_karpenter_manifests_pass_a_server_side_dry_run(kube: Kube, tmp_path: Path) -> None:
    files = crd_files("karpenter")
    res = kubectl(kube, "apply", "--server-side", *[a for f in files for a in ("-f", str(f))])
    assert res.returncode == 0, res.stderr
    res = kubectl(kube, "wait", "--for=condition=Established", "--timeout=60s",
                  "crd/nodepools.karpenter.sh", "crd/ec2nodeclasses.karpenter.k8s.aws")
    assert res.returncode == 0, res.stderr
    res = kubectl(kube, "apply", "--dry-run=server", "-f", str(ROOT / "deploy" / "eks" / "karpenter.yaml"))
    assert res.returncode == 0, res.stderr
    assert "nodepool.karpenter.sh/gpu-efa created (server dry run)" in res.stdout
    assert "ec2nodeclass.karpenter.k8s.aws/gpu-efa created (server dry run)" in res.stdout
    # The dry run is a real check: the EC2NodeClass CEL rules reject a bad placement group selector.
    bad = (ROOT / "deploy" / "eks" / "karpenter.yaml").read_text().replace("name: finetune-efa", "id: not-a-pg-id")
    (tmp_path / "bad.yaml").write_text(bad)
    res = kubectl(kube, "apply", "--dry-run=server", "-f", str(tmp_path / "bad.yaml"))
    assert res.returncode != 0 and "placementGroupSelector" in res.stderr
