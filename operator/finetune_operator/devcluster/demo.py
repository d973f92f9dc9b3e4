"""The whole product path on the dev cluster's real node: ``finetune dev-cluster demo`` (``make demo-cluster``)
and the end-to-end test (tests/integration/test_e2e_real_node.py) share these steps.

1. :func:`import_images`: the Ray image (the Ray Train DLC's Python stack) and the operator image (built
   by buildah from ``Dockerfile.operator``), both built on this machine (cached), imported into the real
   node's containerd, also under the stable names ``localhost/finetune/ray:local`` and
   ``localhost/finetune/operator:local`` (examples/local-cluster.yaml uses the first).
2. :func:`install_operator`: ``deploy/`` rendered by kustomize (``kubectl kustomize deploy``) and applied,
   with what a one-node dev cluster needs on top (:func:`operator_manifests`): the local image, one
   replica on the real node, the local Ray image allowed by the admission policy and used for KubeRay's
   submitter. The apiserver listens on 127.0.0.1 only, so the operator pod uses the host's network and is
   told that address (``KUBERNETES_SERVICE_HOST``/``PORT``); the Ray pods reach its progress endpoint
   through the ``finetune-operator`` Service as in production.
3. :func:`prepare_claim`: the ``finetune-local`` claim (a local PersistentVolume) holding the shipped tiny
   model and data; the job reads them and writes checkpoints and the export there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import build, images
from . import node as realnode
from .cluster import DevCluster, DevClusterError

Log = Callable[[str], None]

REPO = Path(__file__).resolve().parents[3]
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


def free_gateway_port() -> int:
    """A free TCP port on the real node's bridge address (where the host-network operator pod listens)."""
    with socket.socket() as s:
        s.bind((realnode.GATEWAY, 0))
        return int(s.getsockname()[1])


def operator_manifests(kubeconfig: Path, port: int) -> list[dict[str, Any]]:
    """``deploy/`` as kustomize renders it, adapted to the dev cluster (see the module docstring)."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    docs = [d for d in yaml.safe_load_all(kubectl(kubeconfig, "kustomize", str(REPO / "deploy"))) if d]
    return adapt_deploy(docs, server, port)


def adapt_deploy(docs: list[dict[str, Any]], server_url: str, port: int) -> list[dict[str, Any]]:
    """The dev-cluster changes to ``deploy/``'s objects (in place; returns ``docs``)."""
    server = urllib.parse.urlsplit(server_url)
    found = set()
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "ConfigMap" and name == "finetune-operator-policy":
            found.add(kind)
            doc["data"]["allowedImages"] = doc["data"].get("allowedImages", "") + "localhost/finetune/ray:*\n"
        if kind == "Deployment" and name == OPERATOR_NAME:
            found.add(kind)
            doc["spec"]["replicas"] = 1  # the node has 2 cores; one replica leads
            pod = doc["spec"]["template"]["spec"]
            pod["hostNetwork"] = True
            pod["dnsPolicy"] = "ClusterFirstWithHostNet"
            pod["nodeSelector"] = {"finetune.dev/real-node": "true"}
            (c,) = pod["containers"]
            c["image"] = LOCAL_OPERATOR_IMAGE
            c["imagePullPolicy"] = "Never"  # imported, never pulled
            c["args"] = [*c["args"], f"--listen={realnode.GATEWAY}", f"--port={port}",
                         f"--submitter-image={LOCAL_RAY_IMAGE}"]
            c["env"] = [*c.get("env", []),
                        {"name": "KUBERNETES_SERVICE_HOST", "value": server.hostname},
                        {"name": "KUBERNETES_SERVICE_PORT", "value": str(server.port)}]
            c["ports"] = [{"name": "http", "containerPort": port}]
    missing = {"ConfigMap", "Deployment"} - found
    if missing:
        raise DevClusterError(f"deploy/ has no {' or '.join(sorted(missing))} to adapt (renamed?)")
    return docs


CHART = REPO / "deploy" / "helm" / "finetune-operator"


def chart_values(server_url: str, port: int) -> dict[str, Any]:
    """The Helm values that make the chart what :func:`adapt_deploy` makes of ``deploy/`` (one test
    compares the two): the same chart a cluster gets, with the dev cluster's image, node and network."""
    server = urllib.parse.urlsplit(server_url)
    return {
        "image": {"repository": LOCAL_OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": LOCAL_OPERATOR_IMAGE.rsplit(":", 1)[1],
                  "pullPolicy": "Never"},
        "replicas": 1,
        # One node and the host's network: a surged second pod could never bind the port.
        "strategy": {"type": "Recreate"},
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": {"finetune.dev/real-node": "true"},
        "port": port,
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": server.hostname},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": str(server.port)}],
        "operator": {"extraArgs": [f"--listen={realnode.GATEWAY}", f"--submitter-image={LOCAL_RAY_IMAGE}"]},
        "policy": {"allowedImages": ["public.ecr.aws/deep-learning-containers/ray:*", "localhost/finetune/ray:*"],
                   "allowedServiceAccounts": ["default"]},
    }


def helm_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}


def install_operator(cluster: DevCluster, timeout: float = 300, log: Log = _stderr, helm: Path | None = None) -> None:
    """Install the operator and wait until its pod leads and its Service has the endpoint: ``deploy/``
    (kustomize, adapted), or with ``helm`` (a helm binary) the chart in deploy/helm with
    :func:`chart_values`."""
    kc = Path(cluster.kubeconfig)
    t0 = time.monotonic()
    port = free_gateway_port()
    if helm is None:
        docs = operator_manifests(kc, port)
        kubectl(kc, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump_all(docs))
        how = "deploy/"
    else:
        server = yaml.safe_load(kc.read_text())["clusters"][0]["cluster"]["server"]
        home = Path(cluster.workdir) / "helm-home"
        home.mkdir(parents=True, exist_ok=True)
        values = home / "dev-cluster-values.yaml"
        values.write_text(yaml.safe_dump(chart_values(server, port)))
        out = subprocess.run([str(helm), "upgrade", "--install", OPERATOR_NAME, str(CHART), "--namespace",
                              OPERATOR_NAMESPACE, "--create-namespace", "--kubeconfig", str(kc), "-f", str(values)],
                             capture_output=True, text=True, timeout=timeout, env=helm_env(home))
        if out.returncode != 0:
            raise DevClusterError(f"helm install {CHART}: {out.stderr.strip()}")
        how = "the Helm chart"
    kubectl(kc, "-n", OPERATOR_NAMESPACE, "rollout", "status", f"deployment/{OPERATOR_NAME}",
            f"--timeout={int(timeout)}s", timeout=timeout + 30)
    deadline = time.monotonic() + timeout
    while True:  # the leader labels its own pod; the Service then selects it
        addrs = kubectl(kc, "-n", OPERATOR_NAMESPACE, "get", "endpointslices",
                        "-l", f"kubernetes.io/service-name={OPERATOR_NAME}",
                        "-o", "jsonpath={.items[*].endpoints[*].addresses[*]}").split()
        if addrs:
            break
        if time.monotonic() > deadline:
            raise DevClusterError(f"the operator's Service has no endpoint after {timeout:.0f}s (no leader?)")
        time.sleep(1)
    log(f"[demo] operator from {how} running on {realnode.NODE_NAME} in {time.monotonic() - t0:.0f}s")


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
