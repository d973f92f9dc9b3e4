"""Pure parts of the dev cluster's real node: wrapper modules, build selection, the OCI packer, configs."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml
from finetune_devcluster import build, gen_tools, oci, realnode, tiny_images
from finetune_devcluster.versions import COMPONENTS, KUBELET_API_VERSION, NODE_COMPONENTS

TOOLS = Path(gen_tools.__file__).parent / "tools"


@pytest.mark.parametrize("name", sorted(NODE_COMPONENTS), ids=sorted(NODE_COMPONENTS))
def test_committed_node_wrapper_module_matches_versions(name: str) -> None:
    comp = NODE_COMPONENTS[name]
    gomod = (TOOLS / name / "go.mod").read_text()
    if comp.local:
        assert re.search(rf"^\s*{re.escape(comp.module)} {re.escape(comp.version)}$", gomod, re.M)
        assert list((TOOLS / name).glob("*.go"))
    else:
        assert f"\t{comp.module} {comp.version}" in gomod
        for pkg in comp.binaries:
            assert re.search(rf"^(tool |\t){re.escape(pkg)}$", gomod, re.M), pkg
    assert (TOOLS / name / "go.sum").stat().st_size > 0


def test_device_plugin_builds_against_the_kubelet_api_of_our_kubernetes() -> None:
    assert NODE_COMPONENTS["deviceplugin"].version == KUBELET_API_VERSION == "v0.37.2"
    assert "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1" in (TOOLS / "deviceplugin" / "main.go").read_text()


def test_kubelet_gets_its_own_cache_key_and_the_control_plane_stamp_is_unchanged() -> None:
    assert NODE_COMPONENTS["kubernetes-node"].key != COMPONENTS["kubernetes"].key
    cp = COMPONENTS["kubernetes"]
    assert not (cp.cgo or cp.tags or cp.xflags)  # so its stamp (and cache) stays what it was
    assert NODE_COMPONENTS["runc"].cgo and "seccomp" in NODE_COMPONENTS["runc"].tags


def test_control_plane_build_never_selects_node_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    assert set(build.missing()) == set(COMPONENTS)
    assert set(build.missing(NODE_COMPONENTS)) == set(NODE_COMPONENTS)
    assert "kubelet" not in build.binaries() and "kubelet" in build.node_binaries()


def _read_layout(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_oci_archive_is_a_valid_deterministic_layout(tmp_path: Path) -> None:
    layer = oci.layer_tar(
        [oci.Entry("bin/tool", b"#!/bin/sh\necho hi\n", 0o755), oci.Entry("bin/sh", link="/bin/tool")]
    )
    assert layer == oci.layer_tar(
        [oci.Entry("bin/sh", link="/bin/tool"), oci.Entry("bin/tool", b"#!/bin/sh\necho hi\n", 0o755)]
    )
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    cfg = oci.ImageConfig(cmd=["sh"])
    digest = oci.write_archive(a, "localhost/x/y:1", [layer], cfg)
    assert oci.write_archive(b, "localhost/x/y:1", [layer], cfg) == digest
    assert a.read_bytes() == b.read_bytes()

    files = _read_layout(a)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in files.items():  # every blob is named by its digest
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    index = json.loads(files["index.json"])
    desc = index["manifests"][0]
    assert desc["digest"] == digest
    assert desc["annotations"]["io.containerd.image.name"] == "localhost/x/y:1"
    manifest = json.loads(files[f"blobs/sha256/{digest.split(':')[1]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"])
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert config["config"]["Cmd"] == ["sh"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "/bin/tool"
    assert members["bin"].isdir() and members["bin/tool"].mode == 0o755
    assert all(m.mtime == 0 and m.uid == 0 for m in members.values())


def test_node_configs_keep_to_the_machine_rules(tmp_path: Path) -> None:
    rn = realnode.RealNode(tmp_path)
    rn.dir.mkdir(parents=True)
    for sub in ("kubelet", "cni/net.d", "containerd", "coredns"):
        (rn.dir / sub).mkdir(parents=True, exist_ok=True)
    ports = {
        n: 1
        for n in (
            "kubelet",
            "kubelet-healthz",
            "kube-proxy-healthz",
            "kube-proxy-metrics",
            "coredns-health",
            "coredns-ready",
        )
    }
    keys = type("K", (), {"ca_crt": tmp_path / "ca.crt"})()
    kubelet = yaml.safe_load(rn.write_kubelet_config(keys, ports, "/process_api/x/finetune-node").read_text())  # type: ignore[arg-type]
    assert kubelet["cgroupRoot"] == "/process_api/x/finetune-node"
    assert kubelet["cgroupDriver"] == "cgroupfs" and kubelet["failCgroupV1"] is False
    assert kubelet["clusterDNS"] == [realnode.CLUSTER_DNS] and kubelet["readOnlyPort"] == 0
    cni = json.loads(rn.write_cni_config().read_text())
    bridge = cni["plugins"][0]
    assert bridge["isGateway"] is False and bridge["ipMasq"] is False
    assert all(r["dst"] != "0.0.0.0/0" for r in bridge["ipam"]["routes"])  # no default route out of pods
    bins = {n: Path(f"/b/{n}") for n in ("runc", "bridge")}
    toml = rn.write_containerd_config(bins).read_text()
    assert "restrict_oom_score_adj = true" in toml and "SystemdCgroup = false" in toml
    assert '"io.containerd.nri.v1.nri"' in toml and tiny_images.PAUSE_REF in toml
    corefile = rn.write_corefile(tmp_path / "kc", ports).read_text()
    assert f"bind {realnode.GATEWAY}" in corefile and "forward" not in corefile  # no upstream resolvers


def test_sysctl_snapshot_skips_volatile_values() -> None:
    snap = realnode.sysctl_snapshot()
    assert "vm/overcommit_memory" in snap and "kernel/panic" in snap
    assert not any(k.startswith(realnode.SYSCTL_VOLATILE) for k in snap)


def test_own_cgroup_is_read_from_proc() -> None:
    path = realnode.own_cgroup()
    assert path.startswith("/")
    assert any(line.endswith(":" + path) for line in Path("/proc/self/cgroup").read_text().splitlines())
