"""Pure parts of the dev cluster: Go wrapper generation, node shapes, certificates, binary lookup."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from finetune_devcluster import build, gen_tools, kwok_nodes, pki
from finetune_devcluster.versions import ALL_COMPONENTS, KUBERNETES_VERSION

TOOLS = Path(gen_tools.__file__).parent / "tools"


def test_staging_replaces_keep_only_required_staging_modules() -> None:
    modfile = {
        "Require": [{"Path": "k8s.io/api"}, {"Path": "k8s.io/client-go"}, {"Path": "github.com/x/y"}],
        "Replace": [
            {"Old": {"Path": "k8s.io/api"}, "New": {"Path": "./staging/src/k8s.io/api"}},
            {"Old": {"Path": "k8s.io/client-go"}, "New": {"Path": "./staging/src/k8s.io/client-go"}},
            {"Old": {"Path": "k8s.io/sample-controller"}, "New": {"Path": "./staging/src/k8s.io/sample-controller"}},
            {"Old": {"Path": "github.com/x/y"}, "New": {"Path": "github.com/x/y", "Version": "v1.0.0"}},
        ],
    }
    assert gen_tools.staging_replaces(modfile, "v1.37.2") == [
        ("k8s.io/api", "v0.37.2"),
        ("k8s.io/client-go", "v0.37.2"),
    ]


@pytest.mark.parametrize("name", sorted(ALL_COMPONENTS), ids=sorted(ALL_COMPONENTS))
def test_committed_wrapper_module_matches_versions(name: str) -> None:
    comp = ALL_COMPONENTS[name]
    gomod = (TOOLS / name / "go.mod").read_text()
    assert re.search(rf"^(require |\t){re.escape(comp.module)} {re.escape(comp.version)}( // indirect)?$", gomod, re.M)
    own = f"finetune.dev/devcluster/tools/{name}/"
    for pkg in comp.binaries:  # `tool pkg` or a line of a `tool (...)` block; or a main package of our own
        if comp.local and pkg == own.rstrip("/"):  # a local module: its main package is the module root
            assert (TOOLS / name / "main.go").is_file(), pkg
        elif pkg.startswith(own):
            assert (TOOLS / name / pkg.removeprefix(own) / "main.go").is_file(), pkg
        else:
            assert re.search(rf"^(tool |\t){re.escape(pkg)}$", gomod, re.M), pkg
    assert (TOOLS / name / "go.sum").stat().st_size > 0


def test_kubernetes_wrapper_replaces_staging_with_published_versions() -> None:
    gomod = (TOOLS / "kubernetes" / "go.mod").read_text()
    published = "v0" + KUBERNETES_VERSION[KUBERNETES_VERSION.index(".") :]
    for mod in ("k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go", "k8s.io/component-base"):
        assert f"\t{mod} => {mod} {published}\n" in gomod


@pytest.mark.parametrize(
    ("instance_type", "cpu", "memory", "gpus", "efa", "hugepages", "taints"),
    [
        ("g6.12xlarge", "47810m", "189923Mi", "4", "1", "5120Mi", 2),
        ("m5.2xlarge", "7910m", "31203Mi", None, None, "0Mi", 0),
    ],
    ids=["gpu-efa", "cpu"],
)
def test_node_shape(
    instance_type: str, cpu: str, memory: str, gpus: str | None, efa: str | None, hugepages: str, taints: int
) -> None:
    node = kwok_nodes.node_manifest("n", instance_type, "group", 0)
    alloc = node["status"]["allocatable"]
    assert (alloc["cpu"], alloc["memory"], alloc["hugepages-2Mi"], alloc["pods"]) == (cpu, memory, hugepages, "110")
    assert alloc.get("nvidia.com/gpu") == gpus
    assert alloc.get("vpc.amazonaws.com/efa") == efa
    assert len(node["spec"]["taints"]) == taints
    labels = node["metadata"]["labels"]
    assert labels["node.kubernetes.io/instance-type"] == instance_type
    assert labels["topology.kubernetes.io/zone"] == kwok_nodes.ZONE
    assert node["metadata"]["annotations"][kwok_nodes.KWOK_ANNOTATION] == "fake"


def test_unknown_instance_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown instance type 'x1.huge'"):
        kwok_nodes.node_manifest("n", "x1.huge", "group", 0)


@pytest.mark.parametrize("backend", ["cryptography", "openssl"])
def test_certificates_chain_to_the_ca(backend: str, tmp_path: Path) -> None:
    if backend == "openssl":
        if shutil.which("openssl") is None:
            pytest.skip("no openssl")
        keys = pki.Pki(tmp_path)
        pki._generate_openssl(keys, ["localhost"], ["127.0.0.1", "10.96.0.1"])
    else:
        pytest.importorskip("cryptography")
        keys = pki.generate(tmp_path, "10.96.0.1")
    ctx = ssl.create_default_context(cafile=str(keys.ca_crt))
    ctx.load_cert_chain(str(keys.admin_crt), str(keys.admin_key))  # key matches certificate
    if shutil.which("openssl"):
        for crt in (keys.serving_crt, keys.admin_crt):
            out = subprocess.run(
                ["openssl", "verify", "-CAfile", str(keys.ca_crt), str(crt)], capture_output=True, text=True
            )
            assert out.returncode == 0, out.stdout + out.stderr
    assert keys.sa_pub.read_text().startswith("-----BEGIN PUBLIC KEY-----")


def test_kubebuilder_assets_win_for_complete_components(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("kube-apiserver", "etcd"):  # an envtest bundle: no controller-manager/scheduler
        (assets / name).write_text("#!/bin/sh\n")
        (assets / name).chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "cache"))
    bins = build.binaries()
    assert bins["etcd"] == assets / "etcd"
    assert bins["kube-apiserver"].parent.name == f"kubernetes-{KUBERNETES_VERSION}"  # not mixed with cached ones
    assert set(build.missing()) == {"kubernetes", "kuberay", "kwok"}


def test_tcp_forwarder_passes_bytes_both_ways_and_the_half_close(tmp_path: Path) -> None:
    """devcluster/tcpforward.py (the real node's path from pods to the apiserver), run as the cluster runs it:
    a process of its own, by path, between a client and a server on loopback."""
    import socket
    import sys
    import threading

    from finetune_devcluster import tcpforward
    from finetune_devcluster.ports import free_port

    server = socket.create_server(("127.0.0.1", 0))
    target = server.getsockname()[1]

    def echo_upper() -> None:  # answers after the client's EOF: only a passed-on half-close gets a reply
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(data.upper())

    threading.Thread(target=echo_upper, daemon=True).start()
    listen = free_port()
    proc = subprocess.Popen([sys.executable, tcpforward.__file__, f"127.0.0.1:{listen}", f"127.0.0.1:{target}"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "forwarding" in proc.stdout.readline()
        payload = b"x" * 300_000 + b"end"
        with socket.create_connection(("127.0.0.1", listen), timeout=10) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := c.recv(65536):
                got += chunk
        assert got == payload.upper()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        server.close()
