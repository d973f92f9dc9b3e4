"""The two tiny images every real node imports, built here and packed by :mod:`.oci`; nothing is pulled.

- :func:`pause_image`: the pod sandbox ("pause") image, ``build/pause/linux/pause.c`` from the
  ``k8s.io/kubernetes`` module compiled with ``gcc -static``.
- :func:`busybox_image`: Debian's ``busybox-static`` binary plus its applet links: the smoke tests'
  image (``sh``, ``wget``, ``nslookup``, ...).

Both are cached in ``$FINETUNE_CACHE_DIR/images`` by a key of their inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from . import build
from .oci import Entry, ImageArchive, ImageConfig, images_dir, layer_tar, write_archive
from .versions import KUBERNETES_VERSION

PACKER_VERSION = "1"  # part of every cache key: bump when the archive layout changes
PAUSE_REF = "localhost/finetune/pause:3.10"
BUSYBOX_REF = "localhost/finetune/busybox:1"

Log = Callable[[str], None]


def _cached(name: str, ref: str, key: str, make: Callable[[Path], None], log: Log) -> ImageArchive:
    path = images_dir() / f"{name}-{key[:16]}.oci.tar"
    if not path.is_file():
        log(f"[image] building {ref} -> {path}")
        make(path)
    return ImageArchive(ref=ref, path=path, key=key)


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


def pause_image(log: Log = print) -> ImageArchive:
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


def busybox_image(log: Log = print) -> ImageArchive:
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
