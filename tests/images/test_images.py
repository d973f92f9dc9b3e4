"""The real node's images: valid OCI archives that containerd can import, with what KubeRay's pods need.

Real builds (mmdebstrap, pip in a chroot, buildah): they need root and the network to Debian and PyPI, and
are cached under ~/.cache/finetune-operator/images, so only the first run pays (see docs/training.md).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from finetune_operator.devcluster import images

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="building images needs root")]


def layer_names(archive: Path, layer: dict[str, object]) -> set[str]:
    """File names in one zstd layer of an OCI archive."""
    digest = str(layer["digest"]).split(":")[1]
    with tarfile.open(archive) as tf:
        f = tf.extractfile(f"blobs/sha256/{digest}")
        assert f is not None
        listing = subprocess.run("zstd -dc | tar -t", shell=True, input=f.read(), capture_output=True, check=True)
    return {n.removeprefix("./").rstrip("/") for n in listing.stdout.decode().splitlines()}


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
    images._write_layout(layout, [layer], {"Cmd": ["/bin/sh"]}, "localhost/tiny:t1")
    good = tmp_path / "good.tar"
    images._tar_layout(layout, good)
    info = images.verify_oci_archive(good)
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
    with pytest.raises(images.ImageError, match=f"blob {layer.digest} has size"):
        images.verify_oci_archive(bad)


def test_base_image_has_python_313_bash_wget_and_the_dlc_nccl_conf() -> None:
    img = images.base_image()
    info = images.verify_oci_archive(img.path)
    assert info["ref"] == img.ref == f"localhost/finetune-base:{img.key}"
    names = layer_names(img.path, info["manifest"]["layers"][0])
    for f in ("usr/bin/python3.13", "usr/bin/bash", "usr/bin/wget", "usr/bin/ps", "etc/nccl.conf",
              "etc/ssl/certs/ca-certificates.crt", "opt/venv"):
        assert f in names, f
    assert images.base_image() == img  # cached: same key, same archive


def test_ray_image_is_base_plus_the_dlc_venv_with_the_dlc_env() -> None:
    img = images.ray_image("dlc")
    assert img.ref == f"localhost/finetune-ray:dlc-{img.key}"
    info = images.verify_oci_archive(img.path, check_diff_ids=False)  # digests checked; 2 GiB not re-hashed
    config = info["config"]["config"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_DEBUG"] == "INFO"
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert config["Labels"]["dev.finetune.stack"] == "dlc"
    _, venv_layer = info["manifest"]["layers"]
    base = images.verify_oci_archive(images.base_image().path)
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
        [sys.executable, "-m", "finetune_operator.devcluster.images", "run", "dlc",
         "--", "bash", "-lc", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "/opt/venv/bin/python3"  # a login shell keeps the venv first (Debian's profile resets PATH)
    assert "2.58.0" in lines[1]
    assert lines[2].startswith("python 3.13.") and "ray 2.58.0" in lines[2] and "torch 2.13.0" in lines[2]


def test_operator_image_is_built_by_buildah_from_the_local_base() -> None:
    img = images.operator_image()
    info = images.verify_oci_archive(img.path)
    config = info["config"]["config"]
    assert info["ref"] == img.ref == f"localhost/finetune-operator:{img.key}"
    assert config["Entrypoint"] == ["finetune"] and config["Cmd"] == ["operator"]
    assert config["User"] == "10001"
    assert any(e.startswith("PATH=/opt/operator/bin:") for e in config["Env"])
    # Its first layer is the local base's (same uncompressed content, whatever buildah's compression).
    base = images.verify_oci_archive(images.base_image().path)
    assert info["config"]["rootfs"]["diff_ids"][0] == base["config"]["rootfs"]["diff_ids"][0]
    assert images.operator_image() == img
