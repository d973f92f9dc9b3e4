"""A local Kubernetes control plane for development and integration tests.

Real upstream components built from Go modules (kube-apiserver, etcd, kube-controller-manager,
kube-scheduler, the KubeRay operator) plus kwok playing kubelet for simulated EKS GPU/EFA nodes.
See docs/dev-cluster.md.
"""

from .build import BuildError
from .cluster import DevCluster, DevClusterError, default_workdir

__all__ = ["BuildError", "DevCluster", "DevClusterError", "default_workdir"]
