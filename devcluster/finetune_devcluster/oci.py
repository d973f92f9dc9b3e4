"""A small deterministic packer of OCI image archives, and the two tiny images the real node needs.

An archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``) in one tar,
which ``ctr -n k8s.io images import`` accepts. Every tar header is fixed (mtime 0, uid/gid 0, sorted
names), so the same inputs give byte-identical archives and the same image digest.

- :func:`pause_image`: the pod sandbox ("pause") image, ``build/pause/linux/pause.c`` from the
  ``k8s.io/kubernetes`` module compiled with ``gcc -static``.
- :func:`busybox_image`: Debian's ``busybox-static`` binary plus its applet links: the smoke tests'
  image (``sh``, ``wget``, ``nslookup``, ...).

Both are cached in ``$FINETUNE_CACHE_DIR/images`` by a key of their inputs. Nothing is ever pulled.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import build
from .versions import KUBERNETES_VERSION

PACKER_VERSION = "1"  # part of every cache key: bump when the archive layout changes
PAUSE_REF = "localhost/finetune/pause:3.10"
BUSYBOX_REF = "localhost/finetune/busybox:1"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

Log = Callable[[str], None]


@dataclass(frozen=True)
class LocalImage:
    """An OCI archive on disk and the reference pods use for it (the shape of images.ImageArchive)."""

    ref: str
    path: Path
    key: str


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


def images_dir() -> Path:
    return build.cache_dir() / "images"


def _cached(name: str, ref: str, key: str, make: Callable[[Path], None], log: Log) -> LocalImage:
    path = images_dir() / f"{name}-{key[:16]}.oci.tar"
    if not path.is_file():
        log(f"[image] building {ref} -> {path}")
        make(path)
    return LocalImage(ref=ref, path=path, key=key)


def _kubernetes_source() -> Path:
    """The k8s.io/kubernetes module directory (downloaded by the Go toolchain, as for the build)."""
    go = build.find_go()
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOWORK": "off"}
    out = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=build.TOOLS_DIR / "kubernetes-node",
    ).stdout
    return Path(json.loads(out)["Dir"])


def pause_image(log: Log = print) -> LocalImage:
    """The sandbox image: kubernetes' ``pause.c`` built with ``gcc -static``."""
    src = _kubernetes_source() / "build" / "pause" / "linux" / "pause.c"
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise build.BuildError("pause image: no C compiler (gcc) found")
    gcc_version = subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    key = hashlib.sha256(
        "\0".join([PACKER_VERSION, src.read_text(), gcc_version, KUBERNETES_VERSION]).encode()
    ).hexdigest()

    def make(path: Path) -> None:
        binary = images_dir() / f".pause.{os.getpid()}"
        binary.parent.mkdir(parents=True, exist_ok=True)
        cmd = [gcc, "-Os", "-Wall", "-Werror", "-static", f'-DVERSION="{KUBERNETES_VERSION}-finetune"']
        r = subprocess.run([*cmd, "-o", str(binary), str(src)], capture_output=True, text=True)
        if r.returncode != 0:
            raise build.BuildError(f"pause image: gcc failed:\n{r.stderr}")
        data = binary.read_bytes()
        binary.unlink()
        layer = layer_tar([Entry("pause", data, 0o755)])
        write_archive(path, PAUSE_REF, [layer], ImageConfig(entrypoint=["/pause"], user="65535:65535"))

    return _cached("pause", PAUSE_REF, key, make, log)


def _ensure_busybox(log: Log) -> Path:
    path = Path("/bin/busybox")
    if path.is_file():
        return path
    log("[image] installing busybox-static (apt-get)")
    ok, out = build.apt_install(["busybox-static"])
    if not ok or not path.is_file():
        raise build.BuildError(f"busybox image: needs /bin/busybox (Debian's busybox-static); apt-get install "
                               f"busybox-static failed:\n{out}")
    return path


def busybox_image(log: Log = print) -> LocalImage:
    """A tiny image with a shell and network tools: Debian's static busybox and its applet links."""
    binary = _ensure_busybox(log)
    data = binary.read_bytes()
    if b"/ld-linux" in data[:8192]:  # an ELF interpreter: not the static build
        raise build.BuildError(f"busybox image: {binary} is dynamically linked; install Debian's busybox-static")
    key = hashlib.sha256(PACKER_VERSION.encode() + b"\0" + data).hexdigest()

    def make(path: Path) -> None:
        applets = subprocess.run([str(binary), "--list-full"], check=True, capture_output=True, text=True).stdout
        entries = [Entry("bin/busybox", data, 0o755), Entry("tmp", mode=0o1777)]
        for applet in applets.split():
            if applet != "bin/busybox":
                entries.append(Entry(applet, link="/bin/busybox"))
        entries += [
            Entry("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"),
            Entry("etc/group", b"root:x:0:\nnogroup:x:65534:\n"),
        ]
        write_archive(path, BUSYBOX_REF, [layer_tar(entries)], ImageConfig(cmd=["sh"]))

    return _cached("busybox", BUSYBOX_REF, key, make, log)
