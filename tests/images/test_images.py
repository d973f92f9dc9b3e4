"""The real node's images: valid OCI archives that containerd can import, with what KubeRay's pods need.

Real builds (mmdebstrap, pip in a chroot, buildah): they need root and the network to Debian and PyPI, and
are cached under ~/.cache/finetune-operator/images, so only the first run pays (see docs/training.md).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
from finetune_devcluster import images, oci, realnode

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def as_root() -> None:
    """Not a skip: `make test` and CI run as root, and a run that is not must say why these tests did not."""
    if os.geteuid() != 0:
        pytest.fail("tests/images builds the real node's images (mmdebstrap, a chroot pip install, buildah): "
                    "it needs root, as `make test` and CI run; deselect it (--ignore=tests/images) to run the "
                    "rest of the suite unprivileged", pytrace=False)


def layer_names(archive: Path, layer: dict[str, object]) -> set[str]:
    """File names in one zstd layer of an OCI archive."""
    digest = str(layer["digest"]).split(":")[1]
    with tarfile.open(archive) as tf:
        f = tf.extractfile(f"blobs/sha256/{digest}")
        assert f is not None
        with tempfile.TemporaryFile() as out:
            p = subprocess.Popen("zstd -dc | tar -t", shell=True, stdin=subprocess.PIPE, stdout=out)
            assert p.stdin is not None
            shutil.copyfileobj(f, p.stdin, 1 << 20)  # streamed: the Ray image's venv layer is GiBs
            p.stdin.close()
            assert p.wait() == 0
            out.seek(0)
            listing = out.read().decode()
    return {n.removeprefix("./").rstrip("/") for n in listing.splitlines()}


def test_verify_rejects_a_tampered_blob(tmp_path: Path) -> None:
    """A tiny image built by the same code: valid, then one byte of its layer changed -> named mismatch."""
    images.ensure_tools(["zstd"])
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hello").write_text("hi\n")
    layout = tmp_path / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    layer = images._layer(blobs, tree, ["."])
    oci.write_layout(layout, [layer], {"Cmd": ["/bin/sh"]}, "localhost/tiny:t1", created=images.EPOCH,
                     created_by=images.CREATED_BY)
    good = tmp_path / "good.tar"
    oci.tar_layout(layout, good, mtime=images.EPOCH)
    info = oci.verify_oci_archive(good)
    assert info["ref"] == "localhost/tiny:t1"
    assert info["config"]["rootfs"]["diff_ids"] == [layer.diff_id]
    # Same tree, same digest: the layers are reproducible.
    again = tmp_path / "again"
    (again / "blobs" / "sha256").mkdir(parents=True)
    assert images._layer(again / "blobs" / "sha256", tree, ["."]).digest == layer.digest

    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as src, tarfile.open(bad, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None  # type: ignore[union-attr]
            if data is not None and m.name == f"blobs/sha256/{layer.digest.split(':')[1]}":
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(m, None if data is None else io.BytesIO(data))
    with pytest.raises(oci.OciError, match=f"blob {layer.digest} has size"):
        oci.verify_oci_archive(bad)


def test_base_image_has_python_313_bash_wget_and_the_dlc_nccl_conf() -> None:
    img = images.base_image()
    info = oci.verify_oci_archive(img.path)
    assert info["ref"] == img.ref == f"localhost/finetune-base:{img.key}"
    names = layer_names(img.path, info["manifest"]["layers"][0])
    for f in ("usr/bin/python3.13", "usr/bin/bash", "usr/bin/wget", "usr/bin/ps", "etc/nccl.conf",
              "etc/ssl/certs/ca-certificates.crt", "opt/venv"):
        assert f in names, f
    assert images.base_image() == img  # cached: same key, same archive


def test_ray_image_is_base_plus_the_dlc_venv_with_the_dlc_env() -> None:
    img = images.ray_image("dlc")
    assert img.ref == f"localhost/finetune-ray:dlc-{img.key}"
    info = oci.verify_oci_archive(img.path, check_diff_ids=False)  # digests checked; 2 GiB not re-hashed
    config = info["config"]["config"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_DEBUG"] == "INFO"
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert config["Labels"]["dev.finetune.stack"] == "dlc"
    _, venv_layer = info["manifest"]["layers"]
    base = oci.verify_oci_archive(images.base_image().path)
    assert info["config"]["rootfs"]["diff_ids"][0] == base["config"]["rootfs"]["diff_ids"][0]  # the same base tree
    names = layer_names(img.path, venv_layer)
    for f in ("opt/venv/bin/ray", "opt/venv/bin/python3", "opt/venv/lib/python3.13/site-packages/torch",
              "opt/venv/lib/python3.13/site-packages/ray-2.58.0.dist-info"):
        assert f in names, f


def test_the_ray_stack_runs_ray_cli_under_bash_lc_like_kuberay() -> None:
    """KubeRay starts Ray with `bash -lc 'ulimit -n 65536; ray start ...'`: the image's PATH must survive a login
    shell, and `ray`, python3 and the runtime's imports must be there."""
    script = ("ulimit -n 65536; command -v python3; ray --version; "
              "python3 -c 'import finetune_training.stackcheck as s; print(s.describe(s.check()))'")
    out = subprocess.run(
        [sys.executable, "-m", "finetune_devcluster.images", "run", "dlc",
         "--", "bash", "-lc", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "/opt/venv/bin/python3"  # a login shell keeps the venv first (Debian's profile resets PATH)
    assert "2.58.0" in lines[1]
    assert lines[2].startswith("python 3.13.") and "ray 2.58.0" in lines[2] and "torch 2.13.0" in lines[2]


def test_operator_image_is_built_by_buildah_from_the_local_base() -> None:
    img = images.operator_image()
    info = oci.verify_oci_archive(img.path)
    config = info["config"]["config"]
    assert info["ref"] == img.ref == f"localhost/finetune-operator:{img.key}"
    assert config["Entrypoint"] == ["finetune"] and config["Cmd"] == ["operator"]
    assert config["User"] == "10001"
    assert any(e.startswith("PATH=/opt/operator/bin:") for e in config["Env"])
    # Its first layer is the local base's (same uncompressed content, whatever buildah's compression).
    base = oci.verify_oci_archive(images.base_image().path)
    assert info["config"]["rootfs"]["diff_ids"][0] == base["config"]["rootfs"]["diff_ids"][0]
    assert images.operator_image() == img


def test_operator_image_holds_the_operator_and_no_dev_cluster() -> None:
    # The dev cluster is development tooling (its own package): no module of it, and no Go module, ships.
    names = _layer_files(images.operator_image().path)
    site = [n for n in names if "/site-packages/" in n]
    assert any(n.endswith("site-packages/finetune_operator/controller/reconcile.py") for n in site)
    assert [n for n in names if "devcluster" in n or n.endswith(("go.mod", "go.sum", ".go"))] == []


def _layer_files(archive: Path) -> list[str]:
    """Every path in an OCI archive's layers (gzip or plain tar layers, as buildah and our writer make them)."""
    out: list[str] = []
    with tarfile.open(archive) as outer:
        def read(name: str) -> bytes:
            member = outer.extractfile(name)
            assert member is not None, name
            return member.read()

        index = json.loads(read("index.json"))
        manifest = json.loads(read("blobs/sha256/" + index["manifests"][0]["digest"].split(":", 1)[1]))
        for layer in manifest["layers"]:
            blob = read("blobs/sha256/" + layer["digest"].split(":", 1)[1])
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:*") as inner:
                out += inner.getnames()
    return out


def test_containerd_imports_and_unpacks_the_archives_under_their_ref(tmp_path: Path) -> None:
    """A private containerd (its own root, state and socket; CRI off) imports the archives as the node will."""
    # The node's containerd, as the dev cluster builds it (cached by version; `make prebuild` has built it).
    bindir = realnode.node_binaries()["containerd"].parent
    sock = tmp_path / "c.sock"
    (tmp_path / "config.toml").write_text(
        f'version = 3\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime"]\n'
        f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n[debug]\n  address = "{tmp_path}/d.sock"\n')
    with open(tmp_path / "containerd.log", "w") as log:
        proc = subprocess.Popen([str(bindir / "containerd"), "-c", str(tmp_path / "config.toml")], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            if sock.exists():
                break
            proc.poll()
            assert proc.returncode is None, (tmp_path / "containerd.log").read_text()
            time.sleep(0.1)
        ctr = [str(bindir / "ctr"), "--address", str(sock), "-n", "k8s.io"]
        refs = []
        for img in (images.base_image(), images.operator_image()):
            subprocess.run([*ctr, "images", "import", str(img.path)], check=True, capture_output=True, timeout=300)
            refs.append(img.ref)
        listed = subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
        assert set(refs) <= set(listed)
        # Unpacked into the snapshotter: the base layer's files are there.
        assert list((tmp_path / "root").glob("io.containerd.snapshotter.v1.overlayfs/snapshots/*/fs/usr/bin/python3.13"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["umount", "-R", str(tmp_path / "root")], capture_output=True)
