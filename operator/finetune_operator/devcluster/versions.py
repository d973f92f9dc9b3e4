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
# Argo CD (GitOps tests only; never part of the running dev cluster). Its go.mod says `go 1.27.0`, so
# it is built with that toolchain (fetched through the Go module proxy like any module). kustomize, for
# kustomize sources: Argo CD v3.6.1 ships 5.8.3 (hack/tool-versions.sh), whose go.mod needs a
# kube-openapi pseudo-version the proxy does not serve; v5.8.1 links the same kustomize/api v0.21.1
# as argo-cd itself.
ARGOCD_VERSION = "v3.6.1"
ARGOCD_GO_TOOLCHAIN = "go1.27.3"
ARGOCD_KUSTOMIZE_VERSION = "v5.8.1"


@dataclass(frozen=True)
class Component:
    """One Go wrapper module under ``tools/<name>/`` and the binaries built from it."""

    name: str
    module: str
    version: str
    # package path -> binary file name
    binaries: dict[str, str]
    # GOTOOLCHAIN for this module's build, when upstream needs a newer Go than the one installed.
    toolchain: str = ""
    # Further modules the wrapper requires (module -> version), for main packages of our own.
    requires: tuple[tuple[str, str], ...] = ()
    # Copy upstream's replace block (Go ignores a dependency's replaces; argo-cd needs its own).
    copy_replaces: bool = False

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


# Components a test builds on demand (the dev cluster itself neither needs nor builds them).
ARGOCD_MODULE = "finetune.dev/devcluster/tools/argocd"
OPTIONAL_COMPONENTS: dict[str, Component] = {
    "argocd": Component(
        name="argocd",
        module="github.com/argoproj/argo-cd/v3",
        version=ARGOCD_VERSION,
        # Main packages of our own in tools/argocd/ (see their doc comments): upstream's cmd/main.go
        # links the API server, CLI, Dex and every SCM SDK; ours links only what the tests run.
        binaries={
            f"{ARGOCD_MODULE}/argocd": "argocd",
            f"{ARGOCD_MODULE}/argocd-lua-health": "argocd-lua-health",
        },
        toolchain=ARGOCD_GO_TOOLCHAIN,
        requires=(("sigs.k8s.io/kustomize/kustomize/v5", ARGOCD_KUSTOMIZE_VERSION),),
        copy_replaces=True,
    ),
}
ALL_COMPONENTS: dict[str, Component] = {**COMPONENTS, **OPTIONAL_COMPONENTS}
