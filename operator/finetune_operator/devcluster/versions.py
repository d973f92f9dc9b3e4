"""Pinned versions of the upstream components the dev cluster is built from.

Bump a version here, then run ``python -m finetune_operator.devcluster.gen_tools`` to regenerate the
Go wrapper modules under ``tools/`` (needs the Go module proxy), and commit the result.
"""

from __future__ import annotations

from dataclasses import dataclass

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
# v1.7.0 is listed by the Go proxy but its zip is not downloadable ("not available"); v1.6.1 is the
# newest that is. Bump here once it is.
KUBERAY_VERSION = "v1.6.1"
KWOK_VERSION = "v0.8.0"


@dataclass(frozen=True)
class Component:
    """One Go wrapper module under ``tools/<name>/`` and the binaries built from it."""

    name: str
    module: str
    version: str
    # package path -> binary file name
    binaries: dict[str, str]

    @property
    def key(self) -> str:
        """Cache directory name: binaries of different versions never mix."""
        return f"{self.name}-{self.version}"


COMPONENTS: dict[str, Component] = {
    "kubernetes": Component(
        name="kubernetes",
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        binaries={
            "k8s.io/kubernetes/cmd/kube-apiserver": "kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager": "kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler": "kube-scheduler",
        },
    ),
    "etcd": Component(
        name="etcd",
        module="go.etcd.io/etcd/server/v3",
        version=ETCD_VERSION,
        binaries={"go.etcd.io/etcd/server/v3": "etcd"},
    ),
    "kuberay": Component(
        name="kuberay",
        module="github.com/ray-project/kuberay/ray-operator",
        version=KUBERAY_VERSION,
        binaries={"github.com/ray-project/kuberay/ray-operator": "ray-operator"},
    ),
    "kwok": Component(
        name="kwok",
        module="sigs.k8s.io/kwok",
        version=KWOK_VERSION,
        binaries={"sigs.k8s.io/kwok/cmd/kwok": "kwok"},
    ),
}
