"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the KubeRay operator, and kwok playing kubelet for simulated EKS GPU/EFA nodes.

Everything listens on 127.0.0.1 (free ports picked at start), talks TLS with generated certificates,
and runs in its own process group with its log in ``<workdir>/logs/``. ``<workdir>/state.json`` records
the processes, so ``down()``/``status()``/``restart()`` work from another process (the CLI). Each ``up()``
starts a fresh cluster (etcd data is wiped); ``down()`` stops every process and is safe to repeat.

    cluster = DevCluster("/tmp/dev", nodes=2)
    cluster.up()
    print(cluster.kubeconfig)          # admin (system:masters) kubeconfig
    cluster.add_gpu_node()             # one more g6.12xlarge
    cluster.restart("kube-apiserver")  # stop one component, start it again with the same command line
    cluster.down()

This module is the facade and the start order; the parts: :mod:`.supervisor` (processes, state file,
logs), :mod:`.controlplane` (the control plane's flags), :mod:`.crds`, :mod:`.realnode_wiring` (a real
node's processes) over :mod:`.realnode` (its host side), :mod:`.addons` (CoreDNS, local volumes),
:mod:`.apiclient` (bootstrap REST, kubeconfig, probes), :mod:`.kwok_nodes` (simulated Node manifests).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.error
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import build, controlplane, crds, kwok_nodes, pki, realnode, realnode_wiring
from .addons import local_claim, local_pv
from .apiclient import Api, apply, node_ready, write_kubeconfig
from .controlplane import Launch
from .ports import free_port
from .supervisor import DevClusterError, Log, Supervisor, alive
from .versions import KUBERNETES_VERSION

__all__ = ["DevCluster", "DevClusterError", "default_workdir"]

GPU_NODEGROUP = "gpu-efa"
CPU_NODEGROUP = "cpu"


def default_workdir() -> Path:
    env = os.environ.get("FINETUNE_DEVCLUSTER_DIR")
    if env:
        return Path(env)
    return build.cache_dir() / "dev-cluster"


class DevCluster:
    """A local control plane with simulated nodes.

    ``nodes`` GPU nodes of ``instance_type`` (node group ``gpu-efa``, named ``gpu-node-0``...) plus one
    ``cpu_instance_type`` node (``cpu-node-0``) for the Ray head. ``crd_dirs``: every ``*.yaml`` in them
    is installed (default: the checkout's ``crds/``), as are KubeRay's CRDs from its module.
    ``die_with_parent``: components get SIGKILL if this process dies (for test sessions; the CLI leaves
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
        self.crd_dirs = crds.default_crd_dirs() if crd_dirs is None else list(crd_dirs)
        self.die_with_parent = die_with_parent
        self.log = log
        self.real_node = real_node
        self.apiserver_args = list(apiserver_args or [])  # extra kube-apiserver flags (benchmarks: audit log)
        self.node = realnode.RealNode(self.workdir, log=log)
        self.processes = Supervisor(self.workdir, self.kubeconfig, die_with_parent)

    # ---- paths and facts ---------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        return self.processes.logs_dir

    @property
    def state_file(self) -> Path:
        return self.processes.state_file

    @property
    def certs(self) -> pki.Pki:
        return pki.Pki(self.workdir / "pki")

    def port(self, name: str) -> int:
        """A control-plane port picked at ``up()``: ``etcd``, ``etcd-peer``, ``apiserver``, ``kcm``,
        ``scheduler`` or ``ray-probe`` (KubeRay's health probe: ``/readyz``)."""
        ports = self.processes.state().get("ports", {})
        if name not in ports:
            raise DevClusterError(f"no port {name!r} in {self.state_file} (known: {', '.join(ports) or 'none'})")
        return int(ports[name])

    def crd_files(self) -> list[Path]:
        return crds.crd_files(self.crd_dirs)

    def _api(self) -> Api:
        server = self.processes.state().get("server")
        if not server:
            raise DevClusterError(f"no dev cluster state in {self.workdir}; run up() first")
        return Api(server, self.certs)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def is_running(self) -> bool:
        procs = self.processes.processes()
        return bool(procs) and all(alive(p) for p in procs.values())

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
        keys = pki.generate(self.workdir / "pki", controlplane.SERVICE_IP)
        ports = {n: free_port() for n in controlplane.PORTS}
        server = f"https://127.0.0.1:{ports['apiserver']}"
        self.processes.save_state(
            {"server": server, "ports": ports, "processes": {}, "phase": "starting", "kubeconfig": str(self.kubeconfig)}
        )
        write_kubeconfig(self.kubeconfig, server, keys)
        c = Launch(self.processes, self.workdir, self.kubeconfig, bins, ports, keys, server, deadline)

        controlplane.start_etcd(c)
        api = controlplane.start_apiserver(c, self.real_node, self.apiserver_args)
        controlplane.start_controllers(c)
        controlplane.start_kwok(c)
        crds.install(api, self.crd_files(), c.wait)
        controlplane.start_ray_operator(c, self.real_node)
        for i in range(self.gpu_nodes):
            self._create_node(api, f"gpu-node-{i}", self.instance_type, GPU_NODEGROUP)
        self._create_node(api, "cpu-node-0", self.cpu_instance_type, CPU_NODEGROUP)
        if self.real_node:
            realnode_wiring.start_real_node(c, self.node, api, self.log)
        c.wait("nodes Ready", lambda: self._nodes_ready(api))
        controlplane.wait_controllers_healthy(c)
        # The service-account controller (in the controller manager) creates "default" in every
        # namespace; pods cannot be admitted before it exists.
        c.wait("default ServiceAccount", lambda: bool(api.get("/api/v1/namespaces/default/serviceaccounts/default")))
        controlplane.wait_ray_operator_ready(c)
        state = self.processes.state()
        state["phase"] = "ready"
        self.processes.save_state(state)

    def down(self, quiet: bool = False) -> None:
        """Stop every component (SIGTERM, SIGKILL after 10s); idempotent. Logs are kept.

        In stages: the apiserver's clients first, then the apiserver, then etcd. (An apiserver whose
        etcd vanished first keeps retrying instead of exiting.)"""
        state = self.processes.state()
        stopped = []
        node_state = self.node.state_file.exists()
        for i, stage in enumerate([*realnode_wiring.NODE_STOP_STAGES, *controlplane.STOP_STAGES]):
            if node_state and i == 1:
                self.node.kill_containers()  # before containerd goes: its shims are found by its socket
            if node_state and i == len(realnode_wiring.NODE_STOP_STAGES):
                problems = self.node.teardown()
                if problems:
                    self.log("[dev-cluster] real node teardown left: " + "; ".join(problems))
            stopped += self.processes.stop(stage)
        self.processes.reap_all()
        if state:
            state["processes"] = {}
            state["phase"] = "down"
            self.processes.save_state(state)
        if stopped and not quiet:
            self.log(f"[dev-cluster] stopped {', '.join(stopped)}; logs kept in {self.logs_dir}")

    def restart(
        self, component: str, *, sig: int = signal.SIGTERM, grace: float = 15, env: dict[str, str] | None = None
    ) -> None:
        """Stop one component (``sig``, SIGKILL after ``grace`` seconds) and start it again with the same
        command line and environment, plus ``env``; returns once it is spawned (readiness is the caller's
        to wait for). ``component``: a name from ``status()["components"]``, e.g. ``kube-apiserver``."""
        self.processes.restart(component, sig, grace, env)

    def __enter__(self) -> DevCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def status(self) -> dict[str, Any]:
        """Processes (pid, alive, log), apiserver health and nodes; works from any process."""
        state = self.processes.state()
        procs = state.get("processes", {})
        out: dict[str, Any] = {
            "workdir": str(self.workdir),
            "kubeconfig": str(self.kubeconfig),
            "phase": state.get("phase", "absent"),
            "server": state.get("server"),
            "components": {
                name: {"pid": p["pid"], "alive": alive(p), "log": str(self.processes.log_file(name))}
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
                        "ready": node_ready(n),
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
        self.processes.wait(f"node {name} Ready", lambda: node_ready(api.get(f"/api/v1/nodes/{name}")), deadline)
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

    def _create_node(self, api: Api, name: str, instance_type: str, nodegroup: str, index: int | None = None) -> None:
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

    def _nodes_ready(self, api: Api) -> bool:
        items = api.get("/api/v1/nodes")["items"]
        expected = self.gpu_nodes + 1 + (1 if self.real_node else 0)
        return len(items) == expected and all(node_ready(n) for n in items)

    # ---- the real node -----------------------------------------------------------------------------
    def import_image(self, image: realnode.ImageLike, tags: Sequence[str] = ()) -> None:
        """Import an OCI image archive (``oci.ImageArchive``) into the real node, also under the references
        ``tags`` (e.g. ``localhost/finetune/ray:local`` for the examples)."""
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
        apply(api, local_pv(pv_name, host, size, namespace, claim))
        apply(api, local_claim(namespace, claim, pv_name, size))
        return host
