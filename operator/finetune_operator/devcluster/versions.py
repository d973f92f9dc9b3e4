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
# Tools the tests of deploy/ run (never part of the running dev cluster). Prometheus's Go module
# versions v0.3XX.Y are Prometheus 3.XX.Y.
PROMETHEUS_VERSION = "v0.316.0"
HELM_VERSION = "v4.3.2"
GRAFANA_FOUNDATION_SDK_VERSION = "v0.0.22"


@dataclass(frozen=True)
class Component:
    """One Go wrapper module under ``tools/<name>/`` and the binaries built from it."""

    name: str
    module: str
    version: str
    # package path -> binary file name
    binaries: dict[str, str]
    # Further modules the wrapper requires (module -> version), for main packages of our own.
    requires: tuple[tuple[str, str], ...] = ()
    # Go build tags.
    tags: tuple[str, ...] = ()

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
OPTIONAL_COMPONENTS: dict[str, Component] = {
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
ALL_COMPONENTS: dict[str, Component] = {**COMPONENTS, **OPTIONAL_COMPONENTS}

# CRDs of projects whose objects deploy/ ships but the dev cluster does not run: read from their Go
# modules (downloaded through the module proxy; nothing is built). See upstream_crds.py.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
KARPENTER_AWS_VERSION = "v1.15.2"
KARPENTER_GO_TOOLCHAIN = "go1.27.3"
# eksctl's ClusterConfig JSON schema (pkg/apis/eksctl.io/v1alpha5/assets/schema.json in its module).
EKSCTL_VERSION = "v0.215.0"
