"""The one writer of OCI image archives, and the directory every image of the dev cluster is cached in.

An archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) in one tar,
which ``ctr -n k8s.io images import`` accepts (each index entry carries ``io.containerd.image.name`` =
:attr:`ImageArchive.ref`). Every tar header is fixed (uid/gid 0, a fixed mtime, sorted names), so the
same inputs give byte-identical archives and the same image digest. Two ways in:

- small images, in memory: :func:`layer_tar` + :func:`write_archive` (gzip layers; the real node's
  pause and busybox images, :mod:`.tiny_images`);
- large images, on disk: a layout directory whose layer blobs the caller streams in (``images._layer``:
  GNU tar + zstd), then :func:`json_blob`, :func:`write_layout` / :func:`write_index` and
  :func:`tar_layout` (the Ray, base and operator images, :mod:`.images`).

:func:`verify_oci_archive` checks an archive the way an importer would.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from . import build

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

@dataclass(frozen=True)
class ImageArchive:
    """An OCI image archive on disk: import with ``ctr -n k8s.io images import <path>``, use ``ref`` in pods;
    ``key``: the cache key of its inputs."""

    ref: str
    path: Path
    key: str


class OciError(RuntimeError):
    """An archive is not what an importer accepts; the message names the first mismatch."""


def images_dir() -> Path:
    """Where every built image (and the base/venv trees of :mod:`.images`) is cached."""
    return build.cache_dir() / "images"


@dataclass(frozen=True)
class Entry:
    """One file system entry of a layer: a regular file (``data``), a symlink (``link``) or a dir."""

    path: str
    data: bytes | None = None
    mode: int = 0o644
    link: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.data is None and self.link is None


@dataclass
class ImageConfig:
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(
        default_factory=lambda: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    )
    workdir: str = "/"
    user: str = ""


def _tarinfo(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = link
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """An uncompressed, deterministic layer tar (parent directories added, names sorted)."""
    by_path: dict[str, Entry] = {}
    for e in entries:
        p = e.path.strip("/")
        parts = p.split("/")
        for i in range(1, len(parts)):
            by_path.setdefault("/".join(parts[:i]), Entry("/".join(parts[:i]), mode=0o755))
        by_path[p] = Entry(p, e.data, e.mode, e.link)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(by_path):
            e = by_path[p]
            if e.link is not None:
                tar.addfile(_tarinfo(p, tarfile.SYMTYPE, 0o777, link=e.link))
            elif e.data is not None:
                tar.addfile(_tarinfo(p, tarfile.REGTYPE, e.mode, len(e.data)), io.BytesIO(e.data))
            else:
                tar.addfile(_tarinfo(p + "/", tarfile.DIRTYPE, e.mode))
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file, read in chunks (layers are GiBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_archive(out: Path, ref: str, layers: list[bytes], config: ImageConfig) -> str:
    """Write an OCI layout tar for ``ref`` to ``out`` (atomically); returns the manifest digest."""
    blobs: dict[str, bytes] = {}
    layer_descs = []
    diff_ids = []
    for raw in layers:
        gz = gzip.compress(raw, compresslevel=6, mtime=0)
        blobs[_sha(gz)] = gz
        diff_ids.append(_sha(raw))
        layer_descs.append({"mediaType": MEDIA_LAYER_GZIP, "digest": _sha(gz), "size": len(gz)})
    cfg: dict[str, Any] = {"Env": config.env, "WorkingDir": config.workdir}
    if config.entrypoint:
        cfg["Entrypoint"] = config.entrypoint
    if config.cmd:
        cfg["Cmd"] = config.cmd
    if config.user:
        cfg["User"] = config.user
    config_blob = _json(
        {"architecture": "amd64", "os": "linux", "config": cfg, "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    )
    blobs[_sha(config_blob)] = config_blob
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": _sha(config_blob), "size": len(config_blob)},
            "layers": layer_descs,
        }
    )
    blobs[_sha(manifest)] = manifest
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": _sha(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    # containerd takes the full name from its own annotation, as is.
                    "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
                }
            ],
        }
    )
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": index}
    files.update({f"blobs/sha256/{d.split(':', 1)[1]}": b for d, b in blobs.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("blobs/", "blobs/sha256/"):
            tar.addfile(_tarinfo(d, tarfile.DIRTYPE, 0o755))
        for name in sorted(files):
            tar.addfile(_tarinfo(name, tarfile.REGTYPE, 0o644, len(files[name])), io.BytesIO(files[name]))
    tmp.replace(out)
    return _sha(manifest)


# ------------------------------------------------------------------------------------- layout on disk


@dataclass(frozen=True)
class Blob:
    """A blob written into a layout's ``blobs/sha256`` (a layer also has its ``diff_id``)."""

    digest: str
    size: int
    media_type: str
    diff_id: str = ""


def json_blob(blobs: Path, doc: dict[str, Any], media_type: str) -> Blob:
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (blobs / digest.split(":")[1]).write_bytes(data)
    return Blob(digest, len(data), media_type)


def write_layout(layout: Path, layers: Sequence[Blob], config: dict[str, Any], ref: str, *, created: int,
                 created_by: str) -> None:
    """Config, manifest and index of an image whose layer blobs are in ``layout`` already. ``created``: the
    config's time (seconds since the epoch); each layer's history entry says ``{created_by} layer {i}``."""
    blobs = layout / "blobs" / "sha256"
    cfg = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [b.diff_id for b in layers]},
        "history": [{"created_by": f"{created_by} layer {i}"} for i in range(len(layers))],
    }
    cfg_blob = json_blob(blobs, cfg, "application/vnd.oci.image.config.v1+json")
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": cfg_blob.media_type, "digest": cfg_blob.digest, "size": cfg_blob.size},
        "layers": [{"mediaType": b.media_type, "digest": b.digest, "size": b.size} for b in layers],
    }
    man_blob = json_blob(blobs, manifest, "application/vnd.oci.image.manifest.v1+json")
    write_index(layout, man_blob.digest, man_blob.size, ref)


def write_index(layout: Path, digest: str, size: int, ref: str) -> None:
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest, "size": size,
            "platform": {"architecture": "amd64", "os": "linux"},
            # containerd's importer takes io.containerd.image.name as is; ref.name is the OCI tag.
            "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]},
        }],
    }
    (layout / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}) + "\n")


def tar_layout(layout: Path, out: Path, *, mtime: int) -> None:
    """The layout directory as an (uncompressed) tar, every entry at ``mtime``; each file is deleted once in
    the archive (a layer's bytes are never on disk twice)."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        for path in sorted(layout.rglob("*")):
            info = tf.gettarinfo(str(path), arcname=str(path.relative_to(layout)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = mtime
            if path.is_file():
                with open(path, "rb") as f:
                    tf.addfile(info, f)
                path.unlink()  # the layer's bytes now live in the archive only
            else:
                tf.addfile(info)
    tmp.rename(out)


def verify_oci_archive(path: Path, *, check_diff_ids: bool = True) -> dict[str, Any]:
    """Check an OCI image archive the way an importer would; return {ref, manifest, config}.

    ``oci-layout`` and ``index.json`` present; every descriptor's blob exists with that size and sha256;
    the config's ``diff_ids`` are the sha256 of the uncompressed layers (``check_diff_ids``: reads them all).
    Raises :class:`OciError` naming the first mismatch.
    """
    with tarfile.open(path) as tf:
        names = {m.name.lstrip("./"): m for m in tf.getmembers()}

        def read(name: str) -> bytes:
            m = names.get(name)
            f = tf.extractfile(m) if m else None
            if f is None:
                raise OciError(f"{path}: no {name}")
            return f.read()

        def blob(desc: dict[str, Any]) -> IO[bytes]:
            algo, hexd = desc["digest"].split(":")
            name = f"blobs/{algo}/{hexd}"
            m = names.get(name)
            f = tf.extractfile(m) if m is not None else None
            if m is None or f is None:
                raise OciError(f"{path}: blob {desc['digest']} missing")
            h, n = hashlib.sha256(), 0
            data = io.BytesIO() if desc["size"] < (64 << 20) else None
            while chunk := f.read(1 << 20):
                h.update(chunk)
                n += len(chunk)
                if data is not None:
                    data.write(chunk)
            if n != desc["size"] or "sha256:" + h.hexdigest() != desc["digest"]:
                raise OciError(f"{path}: blob {desc['digest']} has size {n}, sha256:{h.hexdigest()}")
            if data is None:  # large: hand out a fresh reader instead of a copy in memory
                again = tf.extractfile(m)
                assert again is not None
                return again
            data.seek(0)
            return data

        if json.loads(read("oci-layout")).get("imageLayoutVersion") != "1.0.0":
            raise OciError(f"{path}: oci-layout is not version 1.0.0")
        index = json.loads(read("index.json"))
        if len(index.get("manifests", [])) != 1:
            raise OciError(f"{path}: index.json should list one manifest")
        desc = index["manifests"][0]
        ref = desc.get("annotations", {}).get("io.containerd.image.name", "")
        manifest = json.loads(blob(desc).read())
        config = json.loads(blob(manifest["config"]).read())
        diff_ids = config["rootfs"]["diff_ids"]
        if len(diff_ids) != len(manifest["layers"]):
            raise OciError(f"{path}: {len(manifest['layers'])} layers but {len(diff_ids)} diff_ids")
        for layer, diff_id in zip(manifest["layers"], diff_ids, strict=True):
            f = blob(layer)
            if not check_diff_ids:
                continue
            if layer["mediaType"].endswith("+zstd"):
                raw = subprocess.run(["zstd", "-dc"], input=f.read(), capture_output=True, check=True).stdout
            elif layer["mediaType"].endswith("+gzip") or layer["mediaType"].endswith(".gzip"):
                raw = gzip.decompress(f.read())
            else:
                raw = f.read()
            if "sha256:" + hashlib.sha256(raw).hexdigest() != diff_id:
                raise OciError(f"{path}: layer {layer['digest']} does not decompress to {diff_id}")
    return {"ref": ref, "manifest": manifest, "config": config}
