"""Starting a real node's processes against the running control plane: containerd, kubelet, the device
plugin, CoreDNS, kube-proxy and the apiserver forwarder, each with its identity and readiness check.
The host side (cgroups, bridge, configs, teardown) is :class:`~.realnode.RealNode`'s."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path

from . import pki, realnode
from .addons import LOCAL_STORAGE_CLASS, coredns_objects, kubernetes_endpoints
from .apiclient import Api, apply, http_text, node_ready
from .controlplane import Launch
from .ports import free_port
from .supervisor import Log

# The real node's processes stop first; its containers are killed before containerd goes.
NODE_STOP_STAGES = [["fake-device-plugin", "kube-proxy", "coredns", "kubelet", "apiserver-forward"], ["containerd"]]
REAL_NODE_LABELS = {
    "node.kubernetes.io/instance-type": "local-real",
    "finetune.dev/real-node": "true",
    "kubernetes.io/os": "linux",
}


def start_real_node(c: Launch, rn: realnode.RealNode, api: Api, log: Log) -> None:
    """containerd + kubelet + device plugin + CoreDNS + kube-proxy, and the local volumes' class."""
    bins, keys, server = c.bins, c.keys, c.server
    t0 = time.monotonic()
    rn.prepare_host(bins)
    cgroup_root = rn.make_cgroups()
    rn.make_bridge()
    rn.write_cni_config()
    serve_apiserver_to_pods(c, api)
    ports = {n: free_port() for n in ("kubelet", "kubelet-healthz", "kube-proxy-healthz", "kube-proxy-metrics")}
    ports.update({n: free_port() for n in ("coredns-health", "coredns-ready")})
    path_env = {"PATH": f"{bins['containerd'].parent}:{bins['runc'].parent}:{os.environ.get('PATH', '')}"}
    c.sup.spawn(
        "containerd",
        [str(bins["containerd"]), "--config", str(rn.write_containerd_config(bins)), "--log-level", "warn"],
        path_env,
    )
    c.wait("containerd", lambda: rn.ctr(bins, "version", check=False).returncode == 0)
    for image in realnode.node_images(log=log):
        rn.import_image(bins, image)

    kubelet_kc = rn.write_kubeconfig(
        "kubelet",
        server,
        keys,
        *pki.issue_client(keys, "kubelet", f"system:node:{realnode.NODE_NAME}", "system:nodes"),
    )
    c.sup.spawn(
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
    c.wait(f"node {realnode.NODE_NAME} Ready", lambda: node_ready(api.get(f"/api/v1/nodes/{realnode.NODE_NAME}")))
    c.sup.spawn(
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

    c.wait("simulated GPU/EFA devices allocatable on the real node", advertised)

    # CoreDNS as a host process behind the kube-dns Service (selector-less: one endpoint, the bridge
    # gateway address, where it listens).
    for doc in coredns_objects():
        apply(api, doc)
    coredns_kc = rn.write_kubeconfig("coredns", server, keys, *pki.issue_client(keys, "coredns", "system:coredns"))
    c.sup.spawn("coredns", [str(bins["coredns"]), "-conf", str(rn.write_corefile(coredns_kc, ports)), "-dns.port", "53"])
    c.wait("CoreDNS ready", lambda: http_text(f"http://127.0.0.1:{ports['coredns-ready']}/ready").strip() == "OK")
    proxy_kc = rn.write_kubeconfig("kube-proxy", server, keys, *pki.issue_client(keys, "kube-proxy", "system:kube-proxy"))
    c.sup.spawn(
        "kube-proxy", [str(bins["kube-proxy"]), f"--config={rn.write_kube_proxy_config(proxy_kc, ports)}", "--v=2"]
    )
    c.wait(
        "kube-proxy healthy",
        lambda: '"lastUpdated"' in http_text(f"http://127.0.0.1:{ports['kube-proxy-healthz']}/healthz"),
    )
    apply(api, LOCAL_STORAGE_CLASS)
    log(f"[dev-cluster] real node {realnode.NODE_NAME} ready in {time.monotonic() - t0:.1f}s")


def serve_apiserver_to_pods(c: Launch, api: Api) -> None:
    """Pods reach the apiserver as in any cluster: the ``kubernetes`` Service (``KUBERNETES_SERVICE_HOST``,
    what in-cluster config uses) -> kube-proxy -> its endpoint, a forwarder on the bridge's address and
    the apiserver's port -> the apiserver on 127.0.0.1. The apiserver takes one bind address and keeps
    loopback (kwok-only clusters are unchanged); its certificate names the Service's address already."""
    port = urllib.parse.urlsplit(c.server).port
    assert port is not None
    c.sup.spawn(
        "apiserver-forward",
        [sys.executable, str(Path(__file__).with_name("tcpforward.py")), f"{realnode.GATEWAY}:{port}",
         f"127.0.0.1:{port}"],
    )

    def accepts() -> bool:
        with socket.create_connection((realnode.GATEWAY, port), timeout=2):
            return True

    c.wait("the apiserver forwarder on the node's bridge", accepts)
    apply(api, kubernetes_endpoints(port))
