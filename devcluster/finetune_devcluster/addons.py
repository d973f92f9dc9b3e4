"""The fixed objects a real node needs besides its processes: CoreDNS's RBAC, Service and endpoint, the
``kubernetes`` Service's endpoint, and local volumes (a StorageClass, a PersistentVolume per claim).
Pure: manifests only; ``apiclient.apply`` creates them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import realnode
from .apiclient import FIELD_MANAGER

LOCAL_STORAGE_CLASS: dict[str, Any] = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "finetune-local"},
    "provisioner": "kubernetes.io/no-provisioner",
    "volumeBindingMode": "Immediate",
    "reclaimPolicy": "Retain",
}


def kubernetes_endpoints(port: int) -> dict[str, Any]:
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


def coredns_objects() -> list[dict[str, Any]]:
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


def local_pv(name: str, host: Path, size: str, namespace: str, claim: str) -> dict[str, Any]:
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


def local_claim(namespace: str, claim: str, pv_name: str, size: str) -> dict[str, Any]:
    """A claim bound to the PersistentVolume ``pv_name`` up front (no provisioner runs)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": LOCAL_STORAGE_CLASS["metadata"]["name"],
            "volumeName": pv_name,
            "resources": {"requests": {"storage": size}},
        },
    }
