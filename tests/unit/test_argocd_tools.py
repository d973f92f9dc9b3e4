"""The Argo CD wrapper module (devcluster/tools/argocd): generated from versions.py, built on demand."""

from __future__ import annotations

import re
from pathlib import Path

from finetune_devcluster import build, gen_tools
from finetune_devcluster.versions import (
    ARGOCD_GO_TOOLCHAIN,
    ARGOCD_VERSION,
    COMPONENTS,
    OPTIONAL_COMPONENTS,
)

TOOLS = Path(gen_tools.__file__).parent / "tools" / "argocd"
COMP = OPTIONAL_COMPONENTS["argocd"]


def test_module_replaces_copy_versioned_replaces_only() -> None:
    modfile = {
        "Replace": [
            {"Old": {"Path": "k8s.io/api"}, "New": {"Path": "k8s.io/api", "Version": "v0.37.0"}},
            {"Old": {"Path": "github.com/golang/protobuf"}, "New": {"Path": "github.com/golang/protobuf", "Version": "v1.5.4"}},
            {"Old": {"Path": "github.com/argoproj/argo-cd/gitops-engine/v3"}, "New": {"Path": "./gitops-engine"}},
            {"Old": {"Path": "x.io/y", "Version": "v1.0.0"}, "New": {"Path": "x.io/y", "Version": "v1.0.1"}},
        ]
    }
    assert gen_tools.module_replaces(modfile) == [
        ("github.com/golang/protobuf", "github.com/golang/protobuf", "v1.5.4"),
        ("k8s.io/api", "k8s.io/api", "v0.37.0"),
    ]


def test_committed_module_matches_versions() -> None:
    gomod = (TOOLS / "go.mod").read_text()
    assert re.search(rf"^\s*{re.escape(COMP.module)} {ARGOCD_VERSION}$", gomod, re.M)
    for mod, version in COMP.requires:
        assert re.search(rf"^\s*{re.escape(mod)} {version}$", gomod, re.M), mod
    # argo-cd's own k8s.io pins, repeated (Go ignores a dependency's replaces); not its local one.
    assert "\tk8s.io/client-go => k8s.io/client-go v0.37.0\n" in gomod
    assert "./gitops-engine" not in gomod
    assert re.search(r"^go 1\.27", gomod, re.M) and ARGOCD_GO_TOOLCHAIN.startswith("go1.27")
    for pkg in COMP.binaries:  # our own main packages, in the module
        assert (TOOLS / pkg.removeprefix(gen_tools._own_module(COMP) + "/") / "main.go").is_file(), pkg


def test_optional_component_is_not_part_of_the_dev_cluster() -> None:
    assert "argocd" not in COMPONENTS
    assert "argocd" in build.ALL_COMPONENTS


def test_stamp_covers_our_sources() -> None:
    sources = [p.relative_to(TOOLS).as_posix() for p in build._own_sources(COMP)]
    assert sorted(sources) == ["argocd-lua-health/main.go", "argocd/main.go"]
    assert build._own_sources(COMPONENTS["etcd"]) == []  # plain wrappers: stamp unchanged


def test_gomod_rendering_lists_tools_only_for_upstream_packages() -> None:
    text = gen_tools.render_gomod(COMP, "1.27.0", [], [("k8s.io/api", "k8s.io/api", "v0.37.0")])
    assert "\ntool" not in text  # our own main packages build without tool directives
    assert "\tk8s.io/api => k8s.io/api v0.37.0\n" in text
    assert f"\t{COMP.module} {COMP.version}\n" in text
    etcd = COMPONENTS["etcd"]
    assert "tool (\n\tgo.etcd.io/etcd/server/v3\n)\n" in gen_tools.render_gomod(etcd, "1.24", [])
