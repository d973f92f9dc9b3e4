"""The dev-cluster adaptations of deploy/ for the real-node demo and e2e test (devcluster/demo.py).

The end-to-end test (tests/integration/test_e2e_real_node.py) runs them for real; this checks what they
change and that they leave the rest of deploy/ as it is.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from finetune_devcluster import DevClusterError, demo

ROOT = Path(__file__).resolve().parents[2]


def deploy_docs() -> list[dict[str, Any]]:
    """deploy/'s objects, as kustomize would list them (its kustomization only lists resources)."""
    kz = yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text())
    assert set(kz) == {"apiVersion", "kind", "resources"}, "kustomization.yaml transforms now: render it for real"
    return [d for f in kz["resources"] for d in yaml.safe_load_all((ROOT / "deploy" / f).read_text()) if d]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_operator_runs_the_local_image_on_the_real_node_and_keeps_productions_shape() -> None:
    before = find(deploy_docs(), "Deployment", "finetune-operator")
    dep = find(demo.adapt_deploy(deploy_docs()), "Deployment", "finetune-operator")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["nodeSelector"] == {"finetune.dev/real-node": "true"}
    assert c["image"] == demo.LOCAL_OPERATOR_IMAGE and c["imagePullPolicy"] == "Never"
    assert c["args"] == [*before["spec"]["template"]["spec"]["containers"][0]["args"],
                         f"--submitter-image={demo.LOCAL_RAY_IMAGE}"]
    # Production's replicas, surging update, pod network, in-cluster config (no apiserver address given),
    # port and progress URL (the Service): the real node exercises them as they are.
    assert dep["spec"]["replicas"] == before["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert c["env"] == before["spec"]["template"]["spec"]["containers"][0]["env"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080}]
    assert "--progress-url=http://finetune-operator.finetune-system.svc:8080" in c["args"]
    # Production's hardening is kept.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_policy_allows_the_local_ray_image_besides_the_dlc() -> None:
    original = find(deploy_docs(), "ConfigMap", "finetune-operator-policy")["data"]["allowedImages"]
    docs = demo.adapt_deploy(deploy_docs())
    allowed = find(docs, "ConfigMap", "finetune-operator-policy")["data"]["allowedImages"].split()
    assert allowed == [*original.split(), "localhost/finetune/ray:*"]
    example = yaml.safe_load(demo.EXAMPLE.read_text())
    assert example["spec"]["cluster"]["image"] == demo.LOCAL_RAY_IMAGE


def test_everything_else_in_deploy_is_unchanged() -> None:
    before = deploy_docs()
    after = demo.adapt_deploy(copy.deepcopy(before))
    changed = [(d["kind"], d["metadata"]["name"]) for d, a in zip(before, after, strict=True) if d != a]
    assert sorted(changed) == [("ConfigMap", "finetune-operator-policy"), ("Deployment", "finetune-operator")]


def test_a_renamed_deployment_is_an_error_not_a_silent_no_op() -> None:
    docs = [d for d in deploy_docs() if d["kind"] != "Deployment"]
    with pytest.raises(DevClusterError, match="no Deployment"):
        demo.adapt_deploy(docs)


def test_images_cli_rejects_an_unknown_image_and_accepts_none(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`finetune dev-cluster images` with no name builds the default set (Python 3.11's argparse rejected
    an empty list against `choices`); an unknown name is an error that lists the valid ones. Only the argument handling is under test here:
    the two builds are stand-ins (tests/images/ builds the images for real)."""
    from finetune_devcluster import images

    built: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.ref, self.key, self.path = f"localhost/{name}:x", "k", Path("/dev/null")

    monkeypatch.setattr(images, "ray_image", lambda stack, log: built.append(f"ray-{stack}") or Fake("ray"))
    monkeypatch.setattr(images, "operator_image", lambda log: built.append("operator") or Fake("operator"))
    assert images.main([]) == 0
    assert built == ["ray-dlc", "operator"]
    with pytest.raises(SystemExit) as exc:
        images.main(["rays"])
    assert exc.value.code == 2
    assert "unknown image 'rays' (choose from ray, operator, base)" in capsys.readouterr().err
