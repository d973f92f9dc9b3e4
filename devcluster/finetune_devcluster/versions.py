"""Pinned versions of the upstream components the dev cluster is built from.

Bump a version here, then run ``python -m finetune_devcluster.gen_tools`` to regenerate the
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
# The real node (``dev-cluster up --real-node``); kubelet and kube-proxy come from KUBERNETES_VERSION.
CONTAINERD_VERSION = "v2.4.2"
RUNC_VERSION = "v1.5.3"
CNI_PLUGINS_VERSION = "v1.10.0"
COREDNS_VERSION = "v1.15.0"
# The device-plugin API module our simulated-accelerator plugin is built against (k8s.io/kubelet).
KUBELET_API_VERSION = "v0" + KUBERNETES_VERSION[KUBERNETES_VERSION.index(".") :]
# Argo CD (GitOps tests only; never part of the running dev cluster). Its go.mod says `go 1.27.0`, so
# it is built with that toolchain (fetched through the Go module proxy like any module). kustomize, for
# kustomize sources: Argo CD v3.6.1 ships 5.8.3 (hack/tool-versions.sh), whose go.mod needs a
# kube-openapi pseudo-version the proxy does not serve; v5.8.1 links the same kustomize/api v0.21.1
# as argo-cd itself.
ARGOCD_VERSION = "v3.6.1"
ARGOCD_GO_TOOLCHAIN = "go1.27.3"
ARGOCD_KUSTOMIZE_VERSION = "v5.8.1"
# Tools the tests of deploy/ run (never part of the running dev cluster). Prometheus's Go module
# versions v0.3XX.Y are Prometheus 3.XX.Y.
PROMETHEUS_VERSION = "v0.316.0"
HELM_VERSION = "v4.3.2"
GRAFANA_FOUNDATION_SDK_VERSION = "v0.0.22"
# The S3-protocol server the tests run (`finetune_devcluster.s3server`): moto's standalone server, a Python
# package installed into a virtualenv of its own (its pins: s3server-requirements.txt), not a Go build.
MOTO_VERSION = "5.2.5"


@dataclass(frozen=True)
class Component:
    """One Go wrapper module under ``tools/<name>/`` and the binaries built from it."""

    name: str
    module: str
    version: str
    # package path -> binary file name
    binaries: dict[str, str]
    # cgo + build tags (runc's seccomp support needs both and Debian's libseccomp-dev).
    cgo: bool = False
    tags: tuple[str, ...] = ()
    # -X name=value link flags (version strings the binaries report).
    xflags: tuple[tuple[str, str], ...] = ()
    # Our own module whose source lives in tools/<name>/ (not a wrapper around an upstream module).
    local: bool = False
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


# Built only for a real node; the kwok-only dev cluster never pays for them.
NODE_COMPONENTS: dict[str, Component] = {
    "kubernetes-node": Component(
        name="kubernetes-node",
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        binaries={
            "k8s.io/kubernetes/cmd/kubelet": "kubelet",
            "k8s.io/kubernetes/cmd/kube-proxy": "kube-proxy",
            "k8s.io/kubernetes/cmd/kubectl": "kubectl",
        },
    ),
    "containerd": Component(
        name="containerd",
        module="github.com/containerd/containerd/v2",
        version=CONTAINERD_VERSION,
        binaries={
            "github.com/containerd/containerd/v2/cmd/containerd": "containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2": "containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr": "ctr",
        },
        tags=("no_btrfs", "no_devmapper", "no_zfs"),
        xflags=(
            ("github.com/containerd/containerd/v2/version.Version", CONTAINERD_VERSION),
            ("github.com/containerd/containerd/v2/version.Package", "github.com/containerd/containerd/v2"),
        ),
    ),
    "runc": Component(
        name="runc",
        module="github.com/opencontainers/runc",
        version=RUNC_VERSION,
        binaries={"github.com/opencontainers/runc": "runc"},
        cgo=True,
        tags=("seccomp",),
        xflags=(("main.version", RUNC_VERSION.lstrip("v")),),
    ),
    "cni-plugins": Component(
        name="cni-plugins",
        module="github.com/containernetworking/plugins",
        version=CNI_PLUGINS_VERSION,
        binaries={
            "github.com/containernetworking/plugins/plugins/main/bridge": "bridge",
            "github.com/containernetworking/plugins/plugins/main/loopback": "loopback",
            "github.com/containernetworking/plugins/plugins/ipam/host-local": "host-local",
            "github.com/containernetworking/plugins/plugins/meta/portmap": "portmap",
        },
        xflags=(("github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion", CNI_PLUGINS_VERSION),),
    ),
    "coredns": Component(
        name="coredns",
        module="github.com/coredns/coredns",
        version=COREDNS_VERSION,
        binaries={"github.com/coredns/coredns": "coredns"},
    ),
    "deviceplugin": Component(
        name="deviceplugin",
        module="k8s.io/kubelet",
        version=KUBELET_API_VERSION,
        binaries={"finetune.dev/devcluster/tools/deviceplugin": "fake-device-plugin"},
        local=True,
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
    "promtool": Component(
        name="promtool",
        module="github.com/prometheus/prometheus",
        version=PROMETHEUS_VERSION,
        binaries={"github.com/prometheus/prometheus/cmd/promtool": "promtool"},
        # Prometheus's own switch to leave out every service-discovery plugin (and with them the AWS,
        # Azure and GCP SDKs): rule checks and rule unit tests need none, and the build is far shorter.
        tags=("remove_all_sd",),
    ),
    "helm": Component(
        name="helm",
        module="helm.sh/helm/v4",
        version=HELM_VERSION,
        binaries={"helm.sh/helm/v4/cmd/helm": "helm"},
    ),
    # Grafana publishes its dashboard schema as generated code (the foundation SDK); our own main
    # package in tools/grafana/dashboard-check/ decodes a dashboard strictly with it and validates it.
    "grafana": Component(
        name="grafana",
        module="github.com/grafana/grafana-foundation-sdk/go",
        version=GRAFANA_FOUNDATION_SDK_VERSION,
        binaries={"finetune.dev/devcluster/tools/grafana/dashboard-check": "grafana-dashboard-check"},
    ),
}
ALL_COMPONENTS: dict[str, Component] = {**COMPONENTS, **NODE_COMPONENTS, **OPTIONAL_COMPONENTS}

# CRDs of projects whose objects deploy/ ships but the dev cluster does not run: read from their Go
# modules (downloaded through the module proxy; nothing is built). See upstream_crds.py.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
KARPENTER_AWS_VERSION = "v1.15.2"
KARPENTER_GO_TOOLCHAIN = "go1.27.3"
# eksctl's ClusterConfig JSON schema (pkg/apis/eksctl.io/v1alpha5/assets/schema.json in its module).
EKSCTL_VERSION = "v0.215.0"
