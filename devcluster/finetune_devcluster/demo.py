"""The whole product path on the dev cluster's real node: ``finetune dev-cluster demo`` (``make demo-cluster``)
and the end-to-end test (tests/integration/test_e2e_real_node.py) share these steps.

1. :func:`import_images`: the Ray image (the Ray Train DLC's Python stack) and the operator image (built
   by buildah from ``Dockerfile.operator``), both built on this machine (cached), imported into the real
   node's containerd, also under the stable names ``localhost/finetune/ray:local`` and
   ``localhost/finetune/operator:local`` (examples/local-cluster.yaml uses the first).
2. :func:`install_operator`: ``deploy/`` rendered by kustomize (``kubectl kustomize deploy``) and applied,
   with what a one-node dev cluster needs on top (:func:`operator_manifests`): the local image, the real
   node, the local Ray image allowed by the admission policy and used for KubeRay's submitter. Everything
   else is production's: two replicas on the pod network (one leads by Lease, the other stands by, both
   Ready), a RollingUpdate that surges one pod, in-cluster config through the ``kubernetes`` Service (on a
   real node its endpoint forwards to the apiserver, see ``realnode_wiring.serve_apiserver_to_pods``), and
   the Ray pods' progress reaching the leader through the ``finetune-operator`` Service.
3. :func:`prepare_claim`: the ``finetune-local`` claim (a local PersistentVolume) holding the shipped tiny
   model and data; the job reads them and writes checkpoints and the export there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import build, images, realnode
from .cluster import DevCluster, DevClusterError

Log = Callable[[str], None]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local-cluster.yaml"
LOCAL_RAY_IMAGE = "localhost/finetune/ray:local"
LOCAL_OPERATOR_IMAGE = "localhost/finetune/operator:local"
CLAIM = "finetune-local"
OPERATOR_NAMESPACE = "finetune-system"
OPERATOR_NAME = "finetune-operator"
STACK = "dlc"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
    """Run the real node's kubectl (built with kubelet); raise :class:`DevClusterError` with its stderr."""
    out = subprocess.run([str(build.node_binaries()["kubectl"]), "--kubeconfig", str(kubeconfig), *args],
                         input=stdin, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise DevClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def import_images(cluster: DevCluster, log: Log = _stderr) -> dict[str, float]:
    """Build (cached) and import the Ray and operator images; returns seconds per step."""
    took: dict[str, float] = {}
    t0 = time.monotonic()
    ray = images.ray_image(STACK, log)
    operator = images.operator_image(log)
    took["build images (cached: 0)"] = time.monotonic() - t0
    t0 = time.monotonic()
    cluster.import_image(ray, tags=[LOCAL_RAY_IMAGE])
    took["import Ray image"] = time.monotonic() - t0
    t0 = time.monotonic()
    cluster.import_image(operator, tags=[LOCAL_OPERATOR_IMAGE])
    took["import operator image"] = time.monotonic() - t0
    return took


def operator_manifests(kubeconfig: Path) -> list[dict[str, Any]]:
    """``deploy/`` as kustomize renders it, adapted to the dev cluster (see the module docstring)."""
    docs = [d for d in yaml.safe_load_all(kubectl(kubeconfig, "kustomize", str(REPO / "deploy"))) if d]
    return adapt_deploy(docs)


def adapt_deploy(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dev-cluster changes to ``deploy/``'s objects (in place; returns ``docs``)."""
    found = set()
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "ConfigMap" and name == "finetune-operator-policy":
            found.add(kind)
            doc["data"]["allowedImages"] = doc["data"].get("allowedImages", "") + "localhost/finetune/ray:*\n"
        if kind == "Deployment" and name == OPERATOR_NAME:
            found.add(kind)
            pod = doc["spec"]["template"]["spec"]
            pod["nodeSelector"] = {"finetune.dev/real-node": "true"}
            (c,) = pod["containers"]
            c["image"] = LOCAL_OPERATOR_IMAGE
            c["imagePullPolicy"] = "Never"  # imported, never pulled
            c["args"] = [*c["args"], f"--submitter-image={LOCAL_RAY_IMAGE}"]
    missing = {"ConfigMap", "Deployment"} - found
    if missing:
        raise DevClusterError(f"deploy/ has no {' or '.join(sorted(missing))} to adapt (renamed?)")
    return docs


CHART = REPO / "deploy" / "helm" / "finetune-operator"


def chart_values() -> dict[str, Any]:
    """The Helm values that make the chart what :func:`adapt_deploy` makes of ``deploy/`` (one test
    compares the two): the same chart a cluster gets, with the dev cluster's images and node. Replicas,
    update strategy, network and in-cluster config stay the chart's defaults."""
    return {
        "image": {"repository": LOCAL_OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": LOCAL_OPERATOR_IMAGE.rsplit(":", 1)[1],
                  "pullPolicy": "Never"},
        "nodeSelector": {"finetune.dev/real-node": "true"},
        "operator": {"extraArgs": [f"--submitter-image={LOCAL_RAY_IMAGE}"]},
        "policy": {"allowedImages": ["public.ecr.aws/deep-learning-containers/ray:*", "localhost/finetune/ray:*"],
                   "allowedServiceAccounts": ["default"]},
    }


def helm_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}


def leader_pod(kubeconfig: Path) -> str | None:
    """The operator pod the ``finetune-operator`` Service routes progress to: the leader (it labels its own
    pod), Ready and not terminating; None while there is none (or, during a handover, not just one)."""
    slices = json.loads(kubectl(kubeconfig, "-n", OPERATOR_NAMESPACE, "get", "endpointslices",
                                "-l", f"kubernetes.io/service-name={OPERATOR_NAME}", "-o", "json"))["items"]
    routed = {e["targetRef"]["name"] for sl in slices for e in sl.get("endpoints") or []
              if (e.get("conditions") or {}).get("ready") and e.get("targetRef", {}).get("kind") == "Pod"}
    pods = json.loads(kubectl(kubeconfig, "-n", OPERATOR_NAMESPACE, "get", "pods",
                              "-l", f"app.kubernetes.io/name={OPERATOR_NAME}", "-o", "json"))["items"]
    live = [p["metadata"]["name"] for p in pods
            if p["metadata"]["name"] in routed and not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def install_operator(cluster: DevCluster, timeout: float = 300, log: Log = _stderr, helm: Path | None = None,
                     values: dict[str, Any] | None = None) -> str:
    """Install (or upgrade) the operator: ``deploy/`` (kustomize, adapted), or with ``helm`` (a helm binary)
    the chart in deploy/helm with :func:`chart_values` and ``values`` on top. Waits for ``kubectl rollout
    status`` (every replica of the new template Ready, the old ones gone) and for a leader behind the
    Service; returns the leader's pod name."""
    kc = Path(cluster.kubeconfig)
    t0 = time.monotonic()
    if helm is None:
        docs = operator_manifests(kc)
        kubectl(kc, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump_all(docs))
        how = "deploy/"
    else:
        home = Path(cluster.workdir) / "helm-home"
        home.mkdir(parents=True, exist_ok=True)
        path = home / "dev-cluster-values.yaml"
        path.write_text(yaml.safe_dump({**chart_values(), **(values or {})}))
        out = subprocess.run([str(helm), "upgrade", "--install", OPERATOR_NAME, str(CHART), "--namespace",
                              OPERATOR_NAMESPACE, "--create-namespace", "--kubeconfig", str(kc), "-f", str(path)],
                             capture_output=True, text=True, timeout=timeout, env=helm_env(home))
        if out.returncode != 0:
            raise DevClusterError(f"helm install {CHART}: {out.stderr.strip()}")
        how = "the Helm chart"
    kubectl(kc, "-n", OPERATOR_NAMESPACE, "rollout", "status", f"deployment/{OPERATOR_NAME}",
            f"--timeout={int(timeout)}s", timeout=timeout + 30)
    deadline = time.monotonic() + timeout
    while (leader := leader_pod(kc)) is None:  # the leader labels its own pod; the Service then selects it
        if time.monotonic() > deadline:
            raise DevClusterError(f"the operator's Service has no live leader behind it after {timeout:.0f}s")
        time.sleep(1)
    log(f"[demo] operator from {how} running on {realnode.NODE_NAME} in {time.monotonic() - t0:.0f}s "
        f"(leader {leader})")
    return leader


def prepare_claim(cluster: DevCluster, namespace: str, timeout: float = 60) -> Path:
    """The claim examples/local-cluster.yaml uses, holding the shipped tiny model and data; returns its host dir."""
    host = cluster.create_local_claim(namespace, CLAIM, "5Gi")
    for sub in ("models", "data", "runs"):
        shutil.rmtree(host / sub, ignore_errors=True)
    shutil.copytree(REPO / "examples" / "models" / "tiny-qwen2", host / "models" / "tiny-qwen2")
    (host / "data").mkdir()
    shutil.copy(REPO / "examples" / "data" / "arithmetic.jsonl", host / "data" / "arithmetic.jsonl")
    kc = Path(cluster.kubeconfig)
    deadline = time.monotonic() + timeout
    while kubectl(kc, "-n", namespace, "get", "pvc", CLAIM, "-o", "jsonpath={.status.phase}") != "Bound":
        if time.monotonic() > deadline:
            raise DevClusterError(f"claim {namespace}/{CLAIM} not Bound after {timeout:.0f}s")
        time.sleep(0.5)
    return host


def demo(workdir: Path | None, keep: bool, timeout: float = 1800, log: Log = _stderr, helm: bool = False) -> int:
    """``make demo-cluster``: dev cluster with a real node, images, the operator from deploy/ (or the Helm
    chart), then ``kubectl apply -f examples/local-cluster.yaml`` and ``kubectl get ftj -w`` until it ends."""
    cluster = DevCluster(workdir, nodes=1, real_node=True, log=log)
    try:
        helm_binary = build.optional_binaries("helm", log=log) / "helm" if helm else None
        cluster.up(timeout=600)
        for step, secs in import_images(cluster, log).items():
            log(f"[demo] {step}: {secs:.0f}s")
        install_operator(cluster, log=log, helm=helm_binary)
        host = prepare_claim(cluster, "default")
        kc = Path(cluster.kubeconfig)
        print(kubectl(kc, "apply", "-f", str(EXAMPLE)), end="", flush=True)
        watch = subprocess.Popen([str(build.node_binaries()["kubectl"]), "--kubeconfig", str(kc), "get", "ftj", "-w"])
        start = time.monotonic()
        phase = ""
        try:
            while phase not in ("Succeeded", "Failed") and time.monotonic() - start < timeout:
                time.sleep(2)
                phase = kubectl(kc, "get", "ftj", "local-cluster", "-o", "jsonpath={.status.phase}")
        finally:
            time.sleep(1)
            watch.terminate()
            watch.wait()
        final = host / "runs" / "local-cluster" / "final"
        if phase == "Succeeded":
            log(f"[demo] Succeeded in {time.monotonic() - start:.0f}s; exported model: {final} "
                f"({', '.join(sorted(p.name for p in final.iterdir()))})")
        else:
            log(f"[demo] the job ended {phase or 'nowhere'}: {kubectl(kc, 'get', 'ftj', 'local-cluster', '-o', 'jsonpath={.status.message}')}")
        if keep:
            log(f"[demo] cluster left running: kubectl --kubeconfig {kc} ...; stop: finetune dev-cluster down"
                + (f" --workdir {workdir}" if workdir else ""))
        return 0 if phase == "Succeeded" else 1
    except (DevClusterError, build.BuildError, images.ImageError) as e:
        log(f"error: {e}")
        return 1
    finally:
        if not keep:
            cluster.down()
