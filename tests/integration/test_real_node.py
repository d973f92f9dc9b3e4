"""The dev cluster's real node: pods really run (containerd + runc + kubelet), logs stream through the
apiserver, Services route (kube-proxy) and resolve (CoreDNS), the simulated GPU/EFA devices are
allocatable, a local PersistentVolume is writable, and ``down`` leaves nothing behind on the host.

One dev cluster with a real node for the session's real-node tests (``real_node_cluster``, shared with the
end-to-end tests, which run first; start ~1 min warm); the last test takes it down and compares the host with
what it was before ``up``.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from finetune_devcluster import DevCluster, build, realnode, tiny_images
from kubernetes import client, config

from .conftest import RealNodeCluster, create_namespace, wait_for
from .host import _node_processes, host_snapshot

pytestmark = pytest.mark.real_node


@dataclass
class RealCluster:
    cluster: DevCluster
    core: client.CoreV1Api
    before: dict[str, Any]


@pytest.fixture(scope="module")
def real(real_node_cluster: RealNodeCluster) -> RealCluster:
    api = config.new_client_from_config(config_file=str(real_node_cluster.cluster.kubeconfig))
    return RealCluster(real_node_cluster.cluster, client.CoreV1Api(api), real_node_cluster.before)


@pytest.fixture
def ns(real: RealCluster) -> Iterator[str]:
    name = f"rn-{uuid.uuid4().hex[:8]}"
    create_namespace(real.core, name)
    yield name
    real.core.delete_namespace(name)


def _pod(name: str, command: str, **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": tiny_images.BUSYBOX_REF, "command": ["sh", "-c", command]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"finetune.dev/real-node": "true"},
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
            **spec,
        },
    }


def _run_pod(real: RealCluster, ns: str, manifest: dict[str, Any], timeout: float = 180) -> str:
    """Create the pod, wait until it Succeeded, return its logs (read through the apiserver -> kubelet)."""
    name = manifest["metadata"]["name"]
    real.core.create_namespaced_pod(ns, manifest)

    def done() -> str | None:
        phase = real.core.read_namespaced_pod(name, ns).status.phase
        if phase == "Failed":
            logs = real.core.read_namespaced_pod_log(name, ns)
            pytest.fail(f"pod {name} failed; logs:\n{logs}")
        return phase if phase == "Succeeded" else None

    wait_for(f"pod {name} Succeeded", done, timeout=timeout, interval=0.5)
    return str(real.core.read_namespaced_pod_log(name, ns))


def test_pod_runs_in_the_nodes_cgroup_and_its_logs_are_readable(real: RealCluster, ns: str) -> None:
    logs = _run_pod(real, ns, _pod("hello", "echo hello-from-a-real-pod; cat /proc/self/cgroup; ip -4 addr show eth0"))
    assert "hello-from-a-real-pod" in logs
    # The same through kubectl (apiserver -> kubelet's /containerLogs, authenticated both ways).
    kubectl = build.node_binaries()["kubectl"]
    out = subprocess.run(
        [str(kubectl), "--kubeconfig", str(real.cluster.kubeconfig), "logs", "-n", ns, "hello"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "hello-from-a-real-pod" in out.stdout, out.stderr
    memory = next(line for line in logs.splitlines() if ":memory:" in line)
    # Below this process's own cgroup (the machine's rule), under kubelet's cgroupRoot.
    assert f"{realnode.own_cgroup()}/finetune-node/kubepods" in memory, memory
    assert "inet 10.244.250." in logs  # an address of the node's bridge subnet


def test_service_clusterip_and_dns(real: RealCluster, ns: str) -> None:
    server = _pod(
        "echo",
        "mkdir -p /www && echo pong-$(hostname) > /www/index.html && exec httpd -f -p 8080 -h /www",
        container={
            "ports": [{"containerPort": 8080}],
            "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
        },
    )
    server["spec"]["restartPolicy"] = "Always"
    real.core.create_namespaced_pod(ns, server)
    real.core.create_namespaced_service(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo"},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    wait_for(
        "echo pod Ready",
        lambda: any(
            c.type == "Ready" and c.status == "True"
            for c in (real.core.read_namespaced_pod("echo", ns).status.conditions or [])
        ),
        timeout=120,
    )
    fqdn = f"echo.{ns}.svc.cluster.local"
    # Retry briefly: kube-proxy programs the new Service within its sync period.
    logs = _run_pod(
        real,
        ns,
        _pod(
            "client",
            f"cat /etc/resolv.conf; nslookup {fqdn}; ip=$(nslookup {fqdn} | awk '/^Address: /{{print $2}}' | tail -n1); "
            # (busybox-static's wget segfaults here (glibc NSS in a static binary): plain HTTP over nc.)
            "for i in $(seq 30); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 $ip 80 | grep pong && exit 0; sleep 1; done; exit 1",
        ),
    )
    cluster_ip = real.core.read_namespaced_service("echo", ns).spec.cluster_ip
    assert f"nameserver {realnode.CLUSTER_DNS}" in logs
    assert cluster_ip in logs  # nslookup answered the Service's ClusterIP
    assert "pong-echo" in logs  # and HTTP through the ClusterIP reached the server pod


def test_pods_reach_the_apiserver_through_the_kubernetes_service(real: RealCluster, ns: str) -> None:
    """In-cluster config's path: KUBERNETES_SERVICE_HOST/PORT (the `kubernetes` Service, injected by kubelet)
    -> kube-proxy -> the node's forwarder -> the apiserver on 127.0.0.1. Plain HTTP to it gets the answer
    of a Go HTTPS server (the TLS itself is the operator's, in test_e2e_real_node.py)."""
    logs = _run_pod(
        real,
        ns,
        _pod(
            "apiclient",
            "echo host=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT; nslookup kubernetes.default.svc.cluster.local; "
            "for i in $(seq 30); do printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' "
            "| nc -w 2 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT | grep 'HTTPS server' && exit 0; sleep 1; done; exit 1",
        ),
    )
    service = real.core.read_namespaced_service("kubernetes", "default")
    assert f"host={service.spec.cluster_ip}:443" in logs
    assert "Client sent an HTTP request to an HTTPS server" in logs


def test_simulated_devices_are_allocatable_and_allocated(real: RealCluster, ns: str) -> None:
    node = real.core.read_node(realnode.NODE_NAME)
    for resource, count in realnode.FAKE_RESOURCES.items():
        assert node.status.allocatable[resource] == str(count)
        assert node.status.capacity[resource] == str(count)
    limits = {"nvidia.com/gpu": "2", "vpc.amazonaws.com/efa": "1"}
    logs = _run_pod(
        real,
        ns,
        _pod(
            "gpu",
            "env | grep ^FAKE_ | sort; ls /dev",
            container={"resources": {"limits": limits, "requests": limits}},
        ),
    )
    gpu_line = next(line for line in logs.splitlines() if line.startswith("FAKE_NVIDIA_COM_GPU="))
    assert len(gpu_line.split("=", 1)[1].split(",")) == 2
    assert "FAKE_VPC_AMAZONAWS_COM_EFA=fake-0" in logs
    assert "nvidia0" not in logs  # simulated: no device nodes in the container


def test_local_volume_is_writable_and_readable_from_the_host(real: RealCluster, ns: str) -> None:
    host = real.cluster.create_local_claim(ns, "data")
    wait_for(
        "claim Bound",
        lambda: real.core.read_namespaced_persistent_volume_claim("data", ns).status.phase == "Bound",
        timeout=60,
    )
    token = uuid.uuid4().hex
    pod = _pod(
        "writer",
        f"mkdir -p /data/run1 && echo {token} > /data/run1/out.txt",
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
    )
    _run_pod(real, ns, pod)
    assert (host / "run1" / "out.txt").read_text().strip() == token


def test_down_leaves_nothing_behind(real: RealCluster) -> None:
    # Runs last in this module (pytest keeps file order): the fixture's own down() is then a no-op.
    workdir = real.cluster.workdir
    assert _node_processes(workdir), "the node's processes should be running before down"
    real.cluster.down()
    after = host_snapshot(workdir)
    for key, value in real.before.items():
        if key == "sysctls":
            changed = {k: (v, after[key].get(k)) for k, v in value.items() if after[key].get(k) != v}
            assert not changed, f"sysctls changed by the node: {changed}"
        else:
            assert after[key] == value, f"{key} differs after down: before {value!r}, after {after[key]!r}"
    assert not real.cluster.node.state_file.exists()
