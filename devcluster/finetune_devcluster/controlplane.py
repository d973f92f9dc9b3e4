"""The control plane's processes and their flags: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok and the KubeRay operator. ``DevCluster.up`` calls these in start order; each spawns
through the :class:`~.supervisor.Supervisor` and, where the next step depends on it, waits for readiness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import build, kwok_nodes, pki
from .apiclient import Api, http_json, http_text, https_ok
from .supervisor import Supervisor

# The app.kubernetes.io/component label of the submitter pods the operator renders (render/rayjob.py).
SUBMITTER_COMPONENT = "submitter"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
POD_CIDR = "10.244.0.1/16"
# Start order.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "ray-operator"]
STOP_STAGES = [["ray-operator", "kwok", "kube-scheduler", "kube-controller-manager"], ["kube-apiserver"], ["etcd"]]
PORTS = ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler", "ray-probe")


@dataclass(frozen=True)
class Launch:
    """What every step needs: the processes, built binaries, picked ports, keys and the start deadline."""

    sup: Supervisor
    workdir: Path
    kubeconfig: Path
    bins: dict[str, Path]
    ports: dict[str, int]
    keys: pki.Pki
    server: str
    deadline: float

    def wait(self, what: str, check: Callable[[], bool]) -> None:
        self.sup.wait(what, check, self.deadline)


def start_etcd(c: Launch) -> None:
    etcd_url = f"http://127.0.0.1:{c.ports['etcd']}"
    peer_url = f"http://127.0.0.1:{c.ports['etcd-peer']}"
    c.sup.spawn(
        "etcd",
        [
            str(c.bins["etcd"]),
            "--name=default",
            f"--data-dir={c.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
    )
    c.wait("etcd healthy", lambda: http_json(f"{etcd_url}/health").get("health") == "true")


def start_apiserver(c: Launch, real_node: bool, extra_args: list[str]) -> Api:
    keys = c.keys
    real = ["--authorization-mode=Node,RBAC"] if real_node else ["--authorization-mode=RBAC"]
    if real_node:  # the apiserver's identity towards kubelet (logs, exec, port-forward)
        kcrt, kkey = pki.issue_client(keys, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        real += [
            f"--kubelet-client-certificate={kcrt}",
            f"--kubelet-client-key={kkey}",
            "--kubelet-preferred-address-types=InternalIP",
        ]
    c.sup.spawn(
        "kube-apiserver",
        [
            str(c.bins["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{c.ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # 1.37 refuses a loopback advertise address for the endpoints of the `kubernetes` Service.
            # Without a real node nothing reaches the apiserver through that Service; with one, its
            # endpoint is the node's forwarder to this apiserver (realnode_wiring.serve_apiserver_to_pods).
            "--endpoint-reconciler-type=none",
            f"--secure-port={c.ports['apiserver']}",
            f"--cert-dir={c.workdir / 'certs'}",
            f"--tls-cert-file={keys.serving_crt}",
            f"--tls-private-key-file={keys.serving_key}",
            f"--client-ca-file={keys.ca_crt}",
            *real,
            f"--service-account-issuer={c.server}",
            f"--service-account-key-file={keys.sa_pub}",
            f"--service-account-signing-key-file={keys.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # API Priority and Fairness on, as on EKS: the operator's 429 handling is tested against it
            # (tests/integration/test_operator_outages.py); admin (system:masters) requests stay exempt.
            "--profiling=false",
            *extra_args,
        ],
    )
    api = Api(c.server, keys)
    c.wait("kube-apiserver ready", lambda: api.get("/readyz") == "ok")
    return api


def start_controllers(c: Launch) -> None:
    """kube-controller-manager and kube-scheduler (healthy later: :func:`wait_controllers_healthy`)."""
    kc = str(c.kubeconfig)
    common = [
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--profiling=false",
    ]
    c.sup.spawn(
        "kube-controller-manager",
        [
            str(c.bins["kube-controller-manager"]),
            *common,
            f"--secure-port={c.ports['kcm']}",
            f"--cert-dir={c.workdir / 'certs' / 'kcm'}",
            f"--service-account-private-key-file={c.keys.sa_key}",
            f"--root-ca-file={c.keys.ca_crt}",
            f"--cluster-signing-cert-file={c.keys.ca_crt}",
            f"--cluster-signing-key-file={c.keys.ca_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--cluster-name=finetune-dev",
            "--controllers=*",
        ],
    )
    c.sup.spawn(
        "kube-scheduler",
        [
            str(c.bins["kube-scheduler"]),
            *common,
            f"--secure-port={c.ports['scheduler']}",
            f"--cert-dir={c.workdir / 'certs' / 'scheduler'}",
        ],
    )


def wait_controllers_healthy(c: Launch) -> None:
    c.wait("kube-scheduler healthy", lambda: https_ok(f"https://127.0.0.1:{c.ports['scheduler']}/healthz"))
    c.wait("kube-controller-manager healthy", lambda: https_ok(f"https://127.0.0.1:{c.ports['kcm']}/healthz"))


def kwok_stages(workdir: Path) -> list[Path]:
    """kwok's stages, with one change: a RayJob's submitter pod is never completed by kwok.

    A real submitter runs `ray job submit` and follows the Ray job's logs until it ends. kwok runs
    nothing, so its pod-complete stage would end every Job's pod within seconds; KubeRay would then
    see a submitter that finished while the Ray job never did, retry the whole RayJob after 30 s
    (JobDeploymentStatusTransitionGracePeriodExceeded) and replace the Ray pods under the test.
    On kwok a submitter therefore keeps running, as it does while a real training runs.
    """
    out: list[Path] = []
    for path in build.kwok_stages():
        if path.name == "pod-complete.yaml":
            stage = yaml.safe_load(path.read_text())
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": '.metadata.labels["app.kubernetes.io/component"]', "operator": "NotIn",
                 "values": [SUBMITTER_COMPONENT]}
            )
            path = workdir / "kwok-pod-complete.yaml"
            path.write_text(yaml.safe_dump(stage, sort_keys=False))
        out.append(path)
    return out


def start_kwok(c: Launch) -> None:
    c.sup.spawn(
        "kwok",
        [
            str(c.bins["kwok"]),
            f"--kubeconfig={c.kubeconfig}",
            *[f"--config={p}" for p in kwok_stages(c.workdir)],
            f"--manage-nodes-with-annotation-selector={kwok_nodes.KWOK_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}",
        ],
    )


def start_ray_operator(c: Launch, real_node: bool) -> None:
    c.sup.spawn(
        "ray-operator",
        [
            str(c.bins["ray-operator"]),
            f"--kubeconfig={c.kubeconfig}",
            "--enable-leader-election=false",
            "--metrics-addr=0",
            f"--health-probe-bind-address=127.0.0.1:{c.ports['ray-probe']}",
            "--log-stdout-encoder=console",
            # Out of the cluster, the operator cannot resolve the head Service's cluster.local name: its
            # dashboard calls (job status, the submitter's outcome) go through the apiserver's Service
            # proxy instead, which reaches the real node's pods over the bridge.
            *(["--use-kubernetes-proxy"] if real_node else []),
        ],
    )


def wait_ray_operator_ready(c: Launch) -> None:
    c.wait("ray-operator ready", lambda: http_text(f"http://127.0.0.1:{c.ports['ray-probe']}/readyz") == "ok")
