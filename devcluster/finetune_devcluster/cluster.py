"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the KubeRay operator, and kwok playing kubelet for simulated EKS GPU/EFA nodes.

Everything listens on 127.0.0.1 (free ports picked at start), talks TLS with generated certificates,
and runs in its own process group with its log in ``<workdir>/logs/``. ``<workdir>/state.json`` records
the processes, so ``down()``/``status()`` work from another process (the CLI). Each ``up()`` starts a
fresh cluster (etcd data is wiped); ``down()`` stops every process and is safe to repeat.

    cluster = DevCluster("/tmp/dev", nodes=2)
    cluster.up()
    print(cluster.kubeconfig)          # admin (system:masters) kubeconfig
    cluster.add_gpu_node()             # one more g6.12xlarge
    cluster.down()
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from . import build, kwok_nodes, pki, realnode
from .ports import free_port
from .versions import KUBERNETES_VERSION

# The app.kubernetes.io/component label of the submitter pods the operator renders (render/rayjob.py).
SUBMITTER_COMPONENT = "submitter"

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
POD_CIDR = "10.244.0.1/16"
GPU_NODEGROUP = "gpu-efa"
CPU_NODEGROUP = "cpu"
FIELD_MANAGER = "finetune-dev-cluster"
# Start order.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "ray-operator"]
# The real node's processes stop first; its containers are killed before containerd goes.
NODE_STOP_STAGES = [["fake-device-plugin", "kube-proxy", "coredns", "kubelet", "apiserver-forward"], ["containerd"]]
REAL_NODE_LABELS = {
    "node.kubernetes.io/instance-type": "local-real",
    "finetune.dev/real-node": "true",
    "kubernetes.io/os": "linux",
}
LOCAL_STORAGE_CLASS: dict[str, Any] = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "finetune-local"},
    "provisioner": "kubernetes.io/no-provisioner",
    "volumeBindingMode": "Immediate",
    "reclaimPolicy": "Retain",
}
STOP_STAGES = [["ray-operator", "kwok", "kube-scheduler", "kube-controller-manager"], ["kube-apiserver"], ["etcd"]]

Log = Callable[[str], None]


class DevClusterError(RuntimeError):
    """A component failed to start or become ready; the message names it and quotes its log."""


def default_workdir() -> Path:
    env = os.environ.get("FINETUNE_DEVCLUSTER_DIR")
    if env:
        return Path(env)
    return build.cache_dir() / "dev-cluster"


def default_crd_dirs() -> list[Path]:
    """The repository's ``crds/`` when running from a checkout (or ``$FINETUNE_CRDS_DIR``)."""
    env = os.environ.get("FINETUNE_CRDS_DIR")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "crds").is_dir():
            return [parent / "crds"]
    return []


def _proc_start_time(pid: int) -> int | None:
    """Kernel start time of a process (guards against killing a recycled pid), None if gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _set_pdeathsig() -> None:
    """Child side: get SIGKILL when the parent dies (so a killed test run leaves no processes).

    SIGKILL, not SIGTERM: a terminating kube-apiserver waits for etcd, a terminating etcd for the
    apiserver's connections; together they linger ~20s. The cluster is throwaway anyway."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return "(no log)"


def _status_message(e: urllib.error.HTTPError) -> str:
    body = e.read().decode(errors="replace")
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError):
        return body or str(e)


class _Api:
    """Just enough REST for bootstrapping (CRDs, nodes, readiness); tests use the kubernetes client."""

    def __init__(self, server: str, keys: pki.Pki) -> None:
        self.server = server
        self.ctx = ssl.create_default_context(cafile=str(keys.ca_crt))
        self.ctx.load_cert_chain(str(keys.admin_crt), str(keys.admin_key))

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", timeout: float = 30
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def get(self, path: str) -> Any:
        return self.request("GET", path)


class DevCluster:
    """A local control plane with simulated nodes.

    ``nodes`` GPU nodes of ``instance_type`` (node group ``gpu-efa``, named ``gpu-node-0``...) plus one
    ``cpu_instance_type`` node (``cpu-node-0``) for the Ray head. ``crd_dirs``: every ``*.yaml`` in them
    is installed (default: the checkout's ``crds/``), as are KubeRay's CRDs from its module.
    ``die_with_parent``: components get SIGTERM if this process dies (for test sessions; the CLI leaves
    the cluster running after it exits). ``apiserver_args``: extra kube-apiserver flags (the benchmarks
    turn on an audit log with them).
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        nodes: int = 2,
        instance_type: str = "g6.12xlarge",
        cpu_instance_type: str = "m5.2xlarge",
        crd_dirs: list[Path] | None = None,
        die_with_parent: bool = False,
        log: Log = print,
        real_node: bool = False,
        apiserver_args: list[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir) if workdir is not None else default_workdir()
        self.gpu_nodes = nodes
        self.instance_type = instance_type
        self.cpu_instance_type = cpu_instance_type
        self.crd_dirs = default_crd_dirs() if crd_dirs is None else list(crd_dirs)
        self.die_with_parent = die_with_parent
        self.log = log
        self.real_node = real_node
        self.apiserver_args = list(apiserver_args or [])  # extra kube-apiserver flags (benchmarks: audit log)
        self.node = realnode.RealNode(self.workdir, log=log)
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    # ---- paths -------------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    @property
    def certs(self) -> pki.Pki:
        return pki.Pki(self.workdir / "pki")

    def _state(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def _api(self) -> _Api:
        server = self._state().get("server")
        if not server:
            raise DevClusterError(f"no dev cluster state in {self.workdir}; run up() first")
        return _Api(server, self.certs)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def is_running(self) -> bool:
        procs = self._state().get("processes", {})
        return bool(procs) and all(self._alive(p) for p in procs.values())

    def up(self, timeout: float = 180) -> None:
        """Build missing binaries, start every component, wait until nodes are Ready."""
        if self.is_running():
            self.log(f"[dev-cluster] already running ({self.workdir}); kubeconfig {self.kubeconfig}")
            return
        self.down(quiet=True)  # leftovers of a crashed run
        bins = build.ensure_built(log=self.log)
        if self.real_node:
            bins = {**bins, **build.ensure_node_built(log=self.log)}
            realnode.node_images(log=self.log)  # built (or found cached) before the clock starts
        start = time.monotonic()
        for attempt in (1, 2):
            try:
                self._start(bins, start + timeout)
                break
            except DevClusterError as e:
                self.down(quiet=True)
                # Ports are picked free but bound later by the component: rarely someone else wins.
                if attempt == 1 and "address already in use" in str(e):
                    self.log("[dev-cluster] a port was taken meanwhile; starting again")
                    continue
                self.log(f"[dev-cluster] start failed; logs in {self.logs_dir}")
                raise
            except BaseException:
                self.down(quiet=True)
                raise
        self.log(f"[dev-cluster] up in {time.monotonic() - start:.1f}s; kubeconfig {self.kubeconfig}")

    def _start(self, bins: dict[str, Path], deadline: float) -> None:
        for sub in ("etcd", "pki", "certs"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        shutil.rmtree(self.logs_dir, ignore_errors=True)
        self.logs_dir.mkdir(parents=True)
        keys = pki.generate(self.workdir / "pki", SERVICE_IP)
        real = ["--authorization-mode=Node,RBAC"] if self.real_node else ["--authorization-mode=RBAC"]
        if self.real_node:  # the apiserver's identity towards kubelet (logs, exec, port-forward)
            kcrt, kkey = pki.issue_client(
                keys, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"
            )
            real += [
                f"--kubelet-client-certificate={kcrt}",
                f"--kubelet-client-key={kkey}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        ports = {n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler", "ray-probe")}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        self._save_state(
            {"server": server, "ports": ports, "processes": {}, "phase": "starting", "kubeconfig": str(self.kubeconfig)}
        )
        self._write_kubeconfig(server, keys)
        kc = str(self.kubeconfig)
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"

        self._spawn(
            "etcd",
            [
                str(bins["etcd"]),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._wait("etcd healthy", lambda: self._http_json(f"{etcd_url}/health").get("health") == "true", deadline)

        self._spawn(
            "kube-apiserver",
            [
                str(bins["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                # 1.37 refuses a loopback advertise address for the endpoints of the `kubernetes` Service.
                # Without a real node nothing reaches the apiserver through that Service; with one, its
                # endpoint is the node's forwarder to this apiserver (_start_real_node).
                "--endpoint-reconciler-type=none",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={keys.serving_crt}",
                f"--tls-private-key-file={keys.serving_key}",
                f"--client-ca-file={keys.ca_crt}",
                *real,
                f"--service-account-issuer={server}",
                f"--service-account-key-file={keys.sa_pub}",
                f"--service-account-signing-key-file={keys.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                *self.apiserver_args,
            ],
        )
        api = _Api(server, keys)
        self._wait("kube-apiserver ready", lambda: api.get("/readyz") == "ok", deadline)

        common = [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--profiling=false",
        ]
        self._spawn(
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                *common,
                f"--secure-port={ports['kcm']}",
                f"--cert-dir={self.workdir / 'certs' / 'kcm'}",
                f"--service-account-private-key-file={keys.sa_key}",
                f"--root-ca-file={keys.ca_crt}",
                f"--cluster-signing-cert-file={keys.ca_crt}",
                f"--cluster-signing-key-file={keys.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=finetune-dev",
                "--controllers=*",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(bins["kube-scheduler"]),
                *common,
                f"--secure-port={ports['scheduler']}",
                f"--cert-dir={self.workdir / 'certs' / 'scheduler'}",
            ],
        )
        self._spawn(
            "kwok",
            [
                str(bins["kwok"]),
                f"--kubeconfig={kc}",
                *[f"--config={p}" for p in self._kwok_stages()],
                f"--manage-nodes-with-annotation-selector={kwok_nodes.KWOK_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                f"--cidr={POD_CIDR}",
            ],
        )

        self._install_crds(api, deadline)
        self._spawn(
            "ray-operator",
            [
                str(bins["ray-operator"]),
                f"--kubeconfig={kc}",
                "--enable-leader-election=false",
                "--metrics-addr=0",
                f"--health-probe-bind-address=127.0.0.1:{ports['ray-probe']}",
                "--log-stdout-encoder=console",
                # Out of the cluster, the operator cannot resolve the head Service's cluster.local name: its
                # dashboard calls (job status, the submitter's outcome) go through the apiserver's Service
                # proxy instead, which reaches the real node's pods over the bridge.
                *(["--use-kubernetes-proxy"] if self.real_node else []),
            ],
        )

        for i in range(self.gpu_nodes):
            self._create_node(api, f"gpu-node-{i}", self.instance_type, GPU_NODEGROUP)
        self._create_node(api, "cpu-node-0", self.cpu_instance_type, CPU_NODEGROUP)

        if self.real_node:
            self._start_real_node(api, bins, server, keys, deadline)
        self._wait("nodes Ready", lambda: self._nodes_ready(api), deadline)
        self._wait(
            "kube-scheduler healthy",
            lambda: self._https_ok(f"https://127.0.0.1:{ports['scheduler']}/healthz"),
            deadline,
        )
        self._wait(
            "kube-controller-manager healthy",
            lambda: self._https_ok(f"https://127.0.0.1:{ports['kcm']}/healthz"),
            deadline,
        )
        # The service-account controller (in the controller manager) creates "default" in every
        # namespace; pods cannot be admitted before it exists.
        self._wait(
            "default ServiceAccount",
            lambda: bool(api.get("/api/v1/namespaces/default/serviceaccounts/default")),
            deadline,
        )
        self._wait(
            "ray-operator ready",
            lambda: self._http_text(f"http://127.0.0.1:{ports['ray-probe']}/readyz") == "ok",
            deadline,
        )
        state = self._state()
        state["phase"] = "ready"
        self._save_state(state)

    def down(self, quiet: bool = False) -> None:
        """Stop every component (SIGTERM, SIGKILL after 10s); idempotent. Logs are kept.

        In stages: the apiserver's clients first, then the apiserver, then etcd. (An apiserver whose
        etcd vanished first keeps retrying instead of exiting.)"""
        state = self._state()
        procs: dict[str, dict[str, Any]] = state.get("processes", {})
        stopped = []
        node_state = self.node.state_file.exists()
        for i, stage in enumerate([*NODE_STOP_STAGES, *STOP_STAGES]):
            if node_state and i == 1:
                self.node.kill_containers()  # before containerd goes: its shims are found by its socket
            if node_state and i == len(NODE_STOP_STAGES):
                problems = self.node.teardown()
                if problems:
                    self.log("[dev-cluster] real node teardown left: " + "; ".join(problems))
            running = [n for n in stage if n in procs and self._alive(procs[n])]
            for name in running:
                self._signal(procs[name], signal.SIGTERM)
            deadline = time.monotonic() + 10
            for name in running:
                while self._alive(procs[name]) and time.monotonic() < deadline:
                    self._reap(name)
                    time.sleep(0.02)
                if self._alive(procs[name]):
                    self._signal(procs[name], signal.SIGKILL)
                    kill_deadline = time.monotonic() + 5
                    while self._alive(procs[name]) and time.monotonic() < kill_deadline:
                        self._reap(name)
                        time.sleep(0.02)
                stopped.append(name)
        for name in list(self._popen):
            self._reap(name, block=True)
        if state:
            state["processes"] = {}
            state["phase"] = "down"
            self._save_state(state)
        if stopped and not quiet:
            self.log(f"[dev-cluster] stopped {', '.join(stopped)}; logs kept in {self.logs_dir}")

    def __enter__(self) -> DevCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def status(self) -> dict[str, Any]:
        """Processes (pid, alive, log), apiserver health and nodes; works from any process."""
        state = self._state()
        procs = state.get("processes", {})
        out: dict[str, Any] = {
            "workdir": str(self.workdir),
            "kubeconfig": str(self.kubeconfig),
            "phase": state.get("phase", "absent"),
            "server": state.get("server"),
            "components": {
                name: {"pid": p["pid"], "alive": self._alive(p), "log": str(self.logs_dir / f"{name}.log")}
                for name, p in procs.items()
            },
        }
        if procs and all(c["alive"] for c in out["components"].values()):
            try:
                api = self._api()
                out["apiserver"] = api.get("/readyz")
                out["nodes"] = [
                    {
                        "name": n["metadata"]["name"],
                        "ready": self._node_ready(n),
                        "instanceType": n["metadata"]["labels"].get("node.kubernetes.io/instance-type"),
                    }
                    for n in api.get("/api/v1/nodes")["items"]
                ]
            except (OSError, urllib.error.URLError, DevClusterError) as e:
                out["apiserver"] = f"error: {e}"
        return out

    # ---- nodes -------------------------------------------------------------------------------------
    def add_gpu_node(self, name: str | None = None, instance_type: str | None = None, wait_ready: float = 60) -> str:
        """Add one more simulated GPU/EFA node (default: the cluster's GPU instance type); returns its name
        once kwok reports it Ready."""
        api = self._api()
        existing = {n["metadata"]["name"] for n in api.get("/api/v1/nodes")["items"]}
        if name is None:
            name = next(f"gpu-node-{i}" for i in range(len(existing) + 1) if f"gpu-node-{i}" not in existing)
        self._create_node(api, name, instance_type or self.instance_type, GPU_NODEGROUP, index=len(existing))
        deadline = time.monotonic() + wait_ready
        self._wait(f"node {name} Ready", lambda: self._node_ready(api.get(f"/api/v1/nodes/{name}")), deadline)
        return name

    def delete_node(self, name: str) -> None:
        """Remove a node, then the pods bound to it (what the pod GC would do ~1 min later: no kubelet
        is left to finish their deletion). Deleting the node first means nothing new lands on it."""
        api = self._api()
        try:
            api.request("DELETE", f"/api/v1/nodes/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        q = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={name}"})
        for pod in api.get(f"/api/v1/pods?{q}")["items"]:
            meta = pod["metadata"]
            try:
                api.request(
                    "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", {"gracePeriodSeconds": 0}
                )
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise

    def _create_node(self, api: _Api, name: str, instance_type: str, nodegroup: str, index: int | None = None) -> None:
        if index is None:
            index = len(api.get("/api/v1/nodes")["items"])
        manifest = kwok_nodes.node_manifest(name, instance_type, nodegroup, index, KUBERNETES_VERSION)
        api.request("POST", "/api/v1/nodes", manifest)
        # Status is kept on create, but set it again through the subresource so it holds whatever the
        # create strategy does in future versions.
        api.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": manifest["status"]},
            content_type="application/merge-patch+json",
        )

    @staticmethod
    def _node_ready(node: dict[str, Any]) -> bool:
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions") or []
        )

    def _nodes_ready(self, api: _Api) -> bool:
        items = api.get("/api/v1/nodes")["items"]
        expected = self.gpu_nodes + 1 + (1 if self.real_node else 0)
        return len(items) == expected and all(self._node_ready(n) for n in items)

    # ---- CRDs --------------------------------------------------------------------------------------
    def crd_files(self) -> list[Path]:
        files = [f for d in self.crd_dirs for f in sorted(Path(d).glob("*.yaml")) + sorted(Path(d).glob("*.yml"))]
        return files + build.kuberay_crds()

    def _kwok_stages(self) -> list[Path]:
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
                path = self.workdir / "kwok-pod-complete.yaml"
                path.write_text(yaml.safe_dump(stage, sort_keys=False))
            out.append(path)
        return out

    def _install_crds(self, api: _Api, deadline: float) -> None:
        docs = []
        for f in self.crd_files():
            for doc in yaml.safe_load_all(f.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    docs.append(doc)
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

        def create(doc: dict[str, Any]) -> None:
            # Plain create (the cluster is fresh): no last-applied annotation, so KubeRay's ~1 MB CRDs
            # fit; server-side apply only when one already exists.
            try:
                api.request("POST", base, doc, timeout=120)
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise DevClusterError(
                        f"the apiserver rejected CRD {doc['metadata']['name']}: {_status_message(e)}"
                    ) from None
                q = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
                api.request(
                    "PATCH",
                    f"{base}/{doc['metadata']['name']}?{q}",
                    doc,
                    content_type="application/apply-patch+yaml",
                    timeout=120,
                )

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(create, docs))

        def established() -> bool:
            for doc in docs:
                crd = api.get(f"{base}/{doc['metadata']['name']}")
                conds = crd.get("status", {}).get("conditions") or []
                if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                    return False
            return True

        self._wait(f"{len(docs)} CRDs established", established, deadline)

    # ---- the real node -----------------------------------------------------------------------------
    def _start_real_node(self, api: _Api, bins: dict[str, Path], server: str, keys: pki.Pki, deadline: float) -> None:
        """containerd + kubelet + device plugin + CoreDNS + kube-proxy, and the local volumes' class."""
        rn = self.node
        t0 = time.monotonic()
        rn.prepare_host(bins)
        cgroup_root = rn.make_cgroups()
        rn.make_bridge()
        rn.write_cni_config()
        self._serve_apiserver_to_pods(api, server, deadline)
        ports = {n: free_port() for n in ("kubelet", "kubelet-healthz", "kube-proxy-healthz", "kube-proxy-metrics")}
        ports.update({n: free_port() for n in ("coredns-health", "coredns-ready")})
        path_env = {"PATH": f"{bins['containerd'].parent}:{bins['runc'].parent}:{os.environ.get('PATH', '')}"}
        self._spawn(
            "containerd",
            [str(bins["containerd"]), "--config", str(rn.write_containerd_config(bins)), "--log-level", "warn"],
            path_env,
        )
        self._wait("containerd", lambda: rn.ctr(bins, "version", check=False).returncode == 0, deadline)
        for image in realnode.node_images(log=self.log):
            rn.import_image(bins, image)

        kubelet_kc = rn.write_kubeconfig(
            "kubelet",
            server,
            keys,
            *pki.issue_client(keys, "kubelet", f"system:node:{realnode.NODE_NAME}", "system:nodes"),
        )
        self._spawn(
            "kubelet",
            [
                str(bins["kubelet"]),
                f"--config={rn.write_kubelet_config(keys, ports, cgroup_root)}",
                f"--kubeconfig={kubelet_kc}",
                f"--root-dir={rn.dir / 'kubelet' / 'root'}",
                f"--cert-dir={rn.dir / 'kubelet' / 'pki'}",
                f"--hostname-override={realnode.NODE_NAME}",
                f"--node-ip={realnode.GATEWAY}",
                "--node-labels=" + ",".join(f"{k}={v}" for k, v in REAL_NODE_LABELS.items()),
                "--v=2",
            ],
            path_env,
        )
        self._wait(
            f"node {realnode.NODE_NAME} Ready",
            lambda: self._node_ready(api.get(f"/api/v1/nodes/{realnode.NODE_NAME}")),
            deadline,
        )
        self._spawn(
            "fake-device-plugin",
            [
                str(bins["fake-device-plugin"]),
                f"--dir={realnode.DEVICE_PLUGIN_DIR}",
                *[f"--resource={k}={v}" for k, v in realnode.FAKE_RESOURCES.items()],
            ],
        )

        def advertised() -> bool:
            alloc = api.get(f"/api/v1/nodes/{realnode.NODE_NAME}")["status"].get("allocatable", {})
            return all(alloc.get(k) == str(v) for k, v in realnode.FAKE_RESOURCES.items())

        self._wait("simulated GPU/EFA devices allocatable on the real node", advertised, deadline)

        # CoreDNS as a host process behind the kube-dns Service (selector-less: one endpoint, the bridge
        # gateway address, where it listens).
        for doc in _coredns_objects():
            _apply(api, doc)
        coredns_kc = rn.write_kubeconfig("coredns", server, keys, *pki.issue_client(keys, "coredns", "system:coredns"))
        self._spawn(
            "coredns", [str(bins["coredns"]), "-conf", str(rn.write_corefile(coredns_kc, ports)), "-dns.port", "53"]
        )
        self._wait(
            "CoreDNS ready",
            lambda: self._http_text(f"http://127.0.0.1:{ports['coredns-ready']}/ready").strip() == "OK",
            deadline,
        )
        proxy_kc = rn.write_kubeconfig(
            "kube-proxy", server, keys, *pki.issue_client(keys, "kube-proxy", "system:kube-proxy")
        )
        self._spawn(
            "kube-proxy", [str(bins["kube-proxy"]), f"--config={rn.write_kube_proxy_config(proxy_kc, ports)}", "--v=2"]
        )
        self._wait(
            "kube-proxy healthy",
            lambda: '"lastUpdated"' in self._http_text(f"http://127.0.0.1:{ports['kube-proxy-healthz']}/healthz"),
            deadline,
        )
        _apply(api, LOCAL_STORAGE_CLASS)
        self.log(f"[dev-cluster] real node {realnode.NODE_NAME} ready in {time.monotonic() - t0:.1f}s")

    def _serve_apiserver_to_pods(self, api: _Api, server: str, deadline: float) -> None:
        """Pods reach the apiserver as in any cluster: the ``kubernetes`` Service (``KUBERNETES_SERVICE_HOST``,
        what in-cluster config uses) -> kube-proxy -> its endpoint, a forwarder on the bridge's address and
        the apiserver's port -> the apiserver on 127.0.0.1. The apiserver takes one bind address and keeps
        loopback (kwok-only clusters are unchanged); its certificate names the Service's address already."""
        port = urllib.parse.urlsplit(server).port
        assert port is not None
        self._spawn(
            "apiserver-forward",
            [sys.executable, str(Path(__file__).with_name("tcpforward.py")), f"{realnode.GATEWAY}:{port}",
             f"127.0.0.1:{port}"],
        )

        def accepts() -> bool:
            with socket.create_connection((realnode.GATEWAY, port), timeout=2):
                return True

        self._wait("the apiserver forwarder on the node's bridge", accepts, deadline)
        _apply(api, _kubernetes_endpoints(port))

    def import_image(self, image: realnode.ImageLike, tags: Sequence[str] = ()) -> None:
        """Import an OCI image archive (``images.ImageArchive``, ``oci.LocalImage``) into the real node,
        also under the references ``tags`` (e.g. ``localhost/finetune/ray:local`` for the examples)."""
        if not self.real_node and not self.node.state_file.exists():
            raise DevClusterError("import_image needs a dev cluster with a real node (real_node=True)")
        self.node.import_image(build.node_binaries(), image, tags)

    def create_local_claim(self, namespace: str, claim: str, size: str = "5Gi") -> Path:
        """A PersistentVolumeClaim ``claim`` bound to a new local PersistentVolume on the real node (usable
        as ``pvc://<claim>/<path>``); returns the host directory behind it (readable after the pods)."""
        api = self._api()
        host = self.node.dir / "pv" / f"{namespace}-{claim}"
        host.mkdir(parents=True, exist_ok=True)
        host.chmod(0o777)
        pv_name = f"local-{namespace}-{claim}"
        _apply(api, _local_pv(pv_name, host, size, namespace, claim))
        _apply(
            api,
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": namespace},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": LOCAL_STORAGE_CLASS["metadata"]["name"],
                    "volumeName": pv_name,
                    "resources": {"requests": {"storage": size}},
                },
            },
        )
        return host

    # ---- processes ---------------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env.update(extra_env or {})
        with open(self.logs_dir / f"{name}.log", "ab") as logf:
            logf.write(f"$ {' '.join(args)}\n".encode())
            logf.flush()
            p = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if self.die_with_parent else None,
            )
        self._popen[name] = p
        with self._lock:
            state = self._state()
            state.setdefault("processes", {})[name] = {"pid": p.pid, "start": _proc_start_time(p.pid)}
            self._save_state(state)

    @staticmethod
    def _alive(p: dict[str, Any]) -> bool:
        start = _proc_start_time(int(p["pid"]))
        return start is not None and (p.get("start") is None or start == p["start"])

    def _signal(self, p: dict[str, Any], sig: int) -> None:
        try:
            os.killpg(int(p["pid"]), sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass

    def _reap(self, name: str, block: bool = False) -> None:
        popen = self._popen.get(name)
        if popen is None:
            return
        try:
            popen.wait(timeout=5 if block else 0.001)
            del self._popen[name]
        except subprocess.TimeoutExpired:
            pass

    def _check_alive(self) -> None:
        for name, p in self._state().get("processes", {}).items():
            self._reap(name)
            if not self._alive(p):
                log = self.logs_dir / f"{name}.log"
                raise DevClusterError(f"{name} exited; last lines of {log}:\n{_tail(log)}")

    def _wait(self, what: str, check: Callable[[], bool], deadline: float) -> None:
        last: Exception | None = None
        while True:
            self._check_alive()
            try:
                if check():
                    return
                last = None
            except (OSError, urllib.error.URLError, ValueError, KeyError) as e:
                last = e
            if time.monotonic() > deadline:
                raise DevClusterError(f"timed out waiting for {what} (last error: {last}); logs in {self.logs_dir}")
            time.sleep(0.2)

    # ---- small HTTP helpers ------------------------------------------------------------------------
    @staticmethod
    def _http_text(url: str) -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def _http_json(self, url: str) -> dict[str, Any]:
        return dict(json.loads(self._http_text(url)))

    @staticmethod
    def _https_ok(url: str) -> bool:
        # The components' serving certificates are self-signed; this only checks they answer "ok".
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
            return bool(r.read().decode() == "ok")

    def _write_kubeconfig(self, server: str, keys: pki.Pki) -> None:
        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "finetune-dev", "cluster": {"server": server, "certificate-authority-data": b64(keys.ca_crt)}}
            ],
            "users": [
                {
                    "name": "finetune-dev-admin",
                    "user": {"client-certificate-data": b64(keys.admin_crt), "client-key-data": b64(keys.admin_key)},
                }
            ],
            "contexts": [
                {"name": "finetune-dev", "context": {"cluster": "finetune-dev", "user": "finetune-dev-admin"}}
            ],
            "current-context": "finetune-dev",
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.kubeconfig.chmod(0o600)


def _apply(api: _Api, doc: dict[str, Any]) -> None:
    """Create ``doc`` (a 409 means it is there already: fine for these fixed objects)."""
    meta = doc["metadata"]
    group_version = doc["apiVersion"]
    plural = {
        "Service": "services",
        "EndpointSlice": "endpointslices",
        "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings",
        "StorageClass": "storageclasses",
        "PersistentVolume": "persistentvolumes",
        "PersistentVolumeClaim": "persistentvolumeclaims",
    }[doc["kind"]]
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    ns = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
    try:
        api.request("POST", f"{base}{ns}/{plural}", doc)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise DevClusterError(f"creating {doc['kind']} {meta['name']}: {_status_message(e)}") from e


def _kubernetes_endpoints(port: int) -> dict[str, Any]:
    """The endpoint of the ``default/kubernetes`` Service (port ``https``, 443) on a real node: the bridge
    address, where the forwarder to the apiserver listens (the apiserver's own reconciler is off)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes-real-node",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": FIELD_MANAGER,
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [realnode.GATEWAY], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
    }


def _coredns_objects() -> list[dict[str, Any]]:
    labels = {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "clusterIP": realnode.CLUSTER_DNS,
                "ports": [{"name": n, "port": 53, "protocol": p, "targetPort": 53} for n, p in ports],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": FIELD_MANAGER,
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [realnode.GATEWAY], "conditions": {"ready": True}}],
            "ports": [{"name": n, "port": 53, "protocol": p} for n, p in ports],
        },
    ]


def _local_pv(name: str, host: Path, size: str, namespace: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": LOCAL_STORAGE_CLASS["metadata"]["name"],
            "claimRef": {"namespace": namespace, "name": claim},
            "local": {"path": str(host)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [realnode.NODE_NAME]}
                            ]
                        }
                    ]
                }
            },
        },
    }
