"""Container images for the dev cluster's real node, built on this machine: no Docker, no registry.

Three things, each cached under ``$FINETUNE_CACHE_DIR/images`` (default ``~/.cache/finetune-operator``)
by a key of its inputs:

- **base**: a Debian root filesystem (``mmdebstrap``, suite ``DEBIAN_SUITE``, from the apt mirror this
  machine is configured with) holding Python 3.13 (trixie's ``python3``), ``venv``, bash, wget, procps and
  CA certificates: what KubeRay's pods need (it runs ``ray start`` through ``bash -lc`` and probes with
  ``wget``). ``base_image()`` is it as a one-layer image, the operator image's base.
- **venv** per stack: ``/opt/venv`` as the Ray Train DLC has it, built inside the base by ``python3 -m venv``
  and pip. Stack ``dlc`` pins ``requirements/dlc.txt`` (the DLC's Python stack); ``project`` the project's
  own ``requirements/constraints.txt``. Kept as its own tree (bind-mounted at ``/opt/venv`` when used), so
  the base exists once on disk whatever the number of stacks.
- **images**: ``ray_image(stack)`` is base + venv as a two-layer OCI image with the DLC's image env
  (``FI_PROVIDER=efa``, ``NCCL_DEBUG=INFO``, ``/opt/venv/bin`` first on PATH); ``operator_image()`` is
  ``Dockerfile.operator`` built by ``buildah`` (chroot isolation, vfs storage, no daemon) from the base.
  Both are written as OCI image archives that ``ctr -n k8s.io images import`` accepts: each index entry
  carries ``io.containerd.image.name`` = :attr:`ImageArchive.ref`.

``run_in_stack(stack, argv)`` runs a command inside base + venv (a private mount and PID namespace, the
repository bind-mounted at ``/src``): ``scripts/test-training-dlc`` runs ``tests/training`` there.

Needs root (mounts, chroot), ``mmdebstrap`` and, for the operator image, ``buildah`` and ``zstd``: Debian
packages, installed with apt-get when missing (:func:`ensure_tools`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from .build import apt_install
from .filelock import file_lock
from .oci import (
    Blob,
    ImageArchive,
    file_digest,
    images_dir,
    tar_layout,
    write_index,
    write_layout,
)

Log = Callable[[str], None]

REPO = Path(__file__).resolve().parents[2]
DEBIAN_SUITE = "trixie"  # its python3 is 3.13, the Ray Train DLC's Python
# libstdc++6: torch, pyarrow, grpcio and Ray's binaries link it (the essential set lacks it).
BASE_PACKAGES = ("python3", "python3-venv", "libstdc++6", "ca-certificates", "wget", "procps", "bash")
STACKS = ("dlc", "project")
# Scratch in the base tree that never belongs in an image (a user's private /tmp is mounted over it anyway).
BASE_EXCLUDE = ("./tmp/*", "./root/.cache/*", "./var/cache/apt/*", "./var/lib/apt/lists/*")
# The Ray Train DLC's image environment (its docs: "FI_PROVIDER=efa and NCCL_DEBUG=INFO are set in the image").
DLC_ENV = {"FI_PROVIDER": "efa", "NCCL_DEBUG": "INFO"}
DLC_NCCL_CONF = "NCCL_SOCKET_IFNAME=^docker0,lo\n"
PROFILE_VENV = 'case ":$PATH:" in *:/opt/venv/bin:*) ;; *) PATH="/opt/venv/bin:$PATH"; export PATH ;; esac\n'
VENV = "/opt/venv"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
SRC = "/src"
# Reproducible archives: every file and the image config carry this time (2026-01-01T00:00:00Z).
EPOCH = 1767225600
# Each layer's history entry in an image config (part of the image bytes: keep it).
CREATED_BY = "finetune_devcluster.images"
APT_PACKAGES = {"mmdebstrap": "mmdebstrap", "buildah": "buildah", "zstd": "zstd", "unshare": "util-linux"}


class ImageError(RuntimeError):
    """A build step failed; the message names the step and the log file."""


def _key(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


# Bump a recipe when the code that builds that thing changes what it builds (the keys cover the inputs).
BASE_RECIPE = "base-2"
VENV_RECIPE = "venv-1"
IMAGE_RECIPE = "oci-1"


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 ``.sources`` or one-line ``sources.list``)."""
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        for m in re.finditer(r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, re.M):
            uri = m.group(1).rstrip("/")
            if uri.endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


# ---------------------------------------------------------------------------------------------- tools


def ensure_tools(names: Sequence[str], log: Log = print) -> None:
    """apt-get install the Debian packages providing ``names`` when a command is missing (CI is a fresh machine)."""
    missing = sorted({APT_PACKAGES[n] for n in names if shutil.which(n) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise ImageError(f"missing {', '.join(missing)} (Debian packages) and not root to install them")
    log(f"[images] apt-get install {' '.join(missing)}")
    ok, out = apt_install(missing)
    if not ok:
        raise ImageError(f"apt-get install {' '.join(missing)} failed:\n{out}")


def _lock(name: str) -> AbstractContextManager[None]:
    return file_lock(images_dir() / f".{name}.lock")


def _run_logged(cmd: Sequence[str], logfile: Path, step: str, **kw: Any) -> None:
    with open(logfile, "a") as lf:
        lf.write(f"$ {shlex.join(cmd)}\n")
        lf.flush()
        rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-30:])
        raise ImageError(f"{step} failed (rc={rc}); log {logfile}:\n{tail}")


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------------------------- base


def base_key() -> str:
    return _key(BASE_RECIPE, DEBIAN_SUITE, " ".join(BASE_PACKAGES), debian_mirror(), DLC_NCCL_CONF, PROFILE_VENV)


def base_rootfs(log: Log = print) -> Path:
    """The Debian root filesystem (built once per key); read-only by convention: users bind-mount into it."""
    key = base_key()
    out = images_dir() / f"base-{key}"
    if (out / ".stamp").is_file():
        return out / "rootfs"
    ensure_tools(["mmdebstrap"], log)
    with _lock("base"):
        if (out / ".stamp").is_file():
            return out / "rootfs"
        for old in images_dir().glob("base-*"):  # one base on disk: drop other keys'
            shutil.rmtree(old, ignore_errors=True)
        tmp = out.with_name(f".base-{key}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        logfile = images_dir() / "base.build.log"
        logfile.write_text("")
        start = time.monotonic()
        log(f"[images] base: Debian {DEBIAN_SUITE} + {' '.join(BASE_PACKAGES)} (mmdebstrap; log {logfile})")
        cmd = ["mmdebstrap", "--mode=root", "--variant=essential", f"--include={','.join(BASE_PACKAGES)}",
               "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
               "--dpkgopt=path-exclude=/usr/share/locale/*", DEBIAN_SUITE, str(tmp / "rootfs"), debian_mirror()]
        _run_logged(cmd, logfile, "mmdebstrap", env={**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH)})
        root = tmp / "rootfs"
        for d in (VENV, SRC, "/root/.cache"):
            (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / "etc/nccl.conf").write_text(DLC_NCCL_CONF)
        # KubeRay runs `bash -lc`: Debian's /etc/profile resets PATH, so a login shell would lose /opt/venv/bin
        # (the DLC's Amazon Linux profile keeps it). Put it back first, as the image's env has it.
        (root / "etc/profile.d/finetune-venv.sh").write_text(PROFILE_VENV)
        resolv = root / "etc/resolv.conf"  # a mount point; the runtime (containerd, us) provides the content
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        resolv.write_text("")
        (tmp / ".stamp").write_text(key + "\n")
        tmp.rename(out)
        log(f"[images] base: done in {time.monotonic() - start:.0f}s, {_gib(_du(out))} -> {out}")
    return out / "rootfs"


# ----------------------------------------------------------------------------------------------- venv


def _constraint_pins(names: Sequence[str]) -> list[str]:
    want = {n.lower() for n in names}
    pins = []
    for line in (REPO / "requirements" / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==", line)
        if m and m.group(1).lower() in want:
            pins.append(line.strip())
    return pins


TEST_PACKAGES = ("pytest", "pytest-timeout", "iniconfig", "pluggy")


def _requirements(stack: str) -> str:
    """The requirements file the venv is built from: the stack's pins plus the test runner (pytest)."""
    if stack == "dlc":
        body = (REPO / "requirements" / "dlc.txt").read_text()
    elif stack == "project":
        # The runtime's imports at the project's pins: the `train` extra and the base deps it uses.
        body = "\n".join(["ray[default,train,tune,data]", "torch", "transformers", "datasets", "safetensors",
                          "pyarrow", "pydantic", "PyYAML", f"-c {SRC}/constraints.txt"])
    else:
        raise ImageError(f"unknown stack {stack!r}; known: {', '.join(STACKS)}")
    return body.rstrip() + "\n# test runner\n" + "\n".join(_constraint_pins(TEST_PACKAGES)) + "\n"


def venv_key(stack: str) -> str:
    extra = (REPO / "requirements" / "constraints.txt").read_bytes() if stack == "project" else b""
    # The venv depends on the base's interpreter, i.e. on the suite, not on every package of the base:
    # adding a shared library to the base does not reinstall 5 GiB of wheels.
    return _key(VENV_RECIPE, DEBIAN_SUITE, debian_mirror(), stack, _requirements(stack), extra)


def _ns_script(root: Path, binds: Sequence[tuple[str, str, bool]], argv: Sequence[str], env: dict[str, str],
               cwd: str = "/") -> list[str]:
    """``unshare`` argv: private mount + PID namespace, proc/dev/sys/tmp and ``binds`` (host, target, ro) mounted
    under ``root``, then ``chroot`` and exec ``argv`` with exactly ``env``. Mounts vanish with the namespace;
    every process left behind (a Ray daemon) is killed when its init exits."""
    r = shlex.quote(str(root))
    lines = ["set -e", "mount --make-rprivate /",
             f"mount -t proc proc {r}/proc", f"mount --rbind /dev {r}/dev", f"mount --rbind /sys {r}/sys",
             f"mount -o bind,ro /etc/resolv.conf {r}/etc/resolv.conf"]
    host_ca = Path(HOST_CA)
    if host_ca.is_file() and (root / HOST_CA.lstrip("/")).is_file():
        # This machine's CA bundle (it may hold a TLS-inspecting proxy's CA) instead of the rootfs's, for pip.
        lines.append(f"mount -o bind,ro {HOST_CA} {r}{HOST_CA}")
    for host, target, ro in binds:
        t = f"{r}{shlex.quote(target)}"
        lines.append(f"mount --bind {shlex.quote(host)} {t}")
        if ro:
            lines.append(f"mount -o remount,bind,ro {t}")
    envs = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    inner = shlex.quote(f"cd {shlex.quote(cwd)} && exec \"$@\"")
    lines.append(f"exec chroot {r} /usr/bin/env -i {envs} /bin/sh -c {inner} sh {shlex.join(argv)}")
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", "sh", "-c", "\n".join(lines)]


def _stack_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"PIP_CERT": HOST_CA, "SSL_CERT_FILE": HOST_CA, "REQUESTS_CA_BUNDLE": HOST_CA,
           "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "LANG": "C.UTF-8", "VIRTUAL_ENV": VENV, "TMPDIR": "/tmp", **DLC_ENV}
    for k in ("PIP_DEFAULT_TIMEOUT", "TERM"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.update(extra or {})
    return env


def venv_dir(stack: str, log: Log = print) -> Path:
    """``/opt/venv`` of a stack, built inside the base rootfs (so paths and the interpreter are the image's)."""
    root = base_rootfs(log)
    key = venv_key(stack)
    out = images_dir() / f"venv-{stack}-{key}"
    if (out / ".stamp").is_file():
        return out / "venv"
    ensure_tools(["unshare"], log)
    with _lock(f"venv-{stack}"):
        if (out / ".stamp").is_file():
            return out / "venv"
        for old in images_dir().glob(f"venv-{stack}-*"):  # one venv per stack on disk
            shutil.rmtree(old, ignore_errors=True)
        tmp = out.with_name(f".venv-{stack}-{key}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "venv").mkdir(parents=True)
        (tmp / "req").mkdir()
        (tmp / "req" / "requirements.txt").write_text(_requirements(stack))
        shutil.copyfile(REPO / "requirements" / "constraints.txt", tmp / "req" / "constraints.txt")
        logfile = images_dir() / f"venv-{stack}.build.log"
        logfile.write_text("")
        start = time.monotonic()
        log(f"[images] venv {stack}: python3 -m venv {VENV} + pip install (log {logfile})")
        (tmp / "tmp").mkdir(mode=0o1777)
        binds = [(str(tmp / "venv"), VENV, False), (str(tmp / "req"), SRC, True), (str(tmp / "tmp"), "/tmp", False)]
        # Debian's pip (bundled with python3-venv) as is: no "upgrade pip" that would change with the day.
        script = f"python3 -m venv {VENV} && {VENV}/bin/python -m pip install --no-cache-dir -r {SRC}/requirements.txt"
        _run_logged(_ns_script(root, binds, ["sh", "-c", script], _stack_env()), logfile, f"venv {stack}")
        (tmp / "req" / "requirements.txt").rename(tmp / "requirements.txt")
        shutil.rmtree(tmp / "req")
        shutil.rmtree(tmp / "tmp")
        (tmp / ".stamp").write_text(key + "\n")
        tmp.rename(out)
        log(f"[images] venv {stack}: done in {time.monotonic() - start:.0f}s, {_gib(_du(out))} -> {out}")
    return out / "venv"


def run_in_stack(stack: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 repo: Path = REPO, log: Log = print) -> int:
    """Run ``argv`` in base + the stack's venv with ``repo`` at ``/src`` (read-write) and a fresh ``/tmp``."""
    root = base_rootfs(log)
    venv = venv_dir(stack, log)
    with tempfile.TemporaryDirectory(prefix=f"finetune-{stack}-tmp-") as tmpdir:
        os.chmod(tmpdir, 0o1777)
        binds = [(str(venv), VENV, True), (str(repo), SRC, False), (tmpdir, "/tmp", False)]
        # PYTHONFAULTHANDLER: a crash (also one at interpreter exit, after pytest's own handler is gone)
        # prints every thread's Python stack instead of a bare signal number.
        env = {"PYTHONPATH": f"{SRC}/operator:{SRC}/training", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONFAULTHANDLER": "1", **(env or {})}
        # /dev/shm comes from the host's /dev (Ray's object store lives there).
        return subprocess.run(_ns_script(root, binds, argv, _stack_env(env), cwd=SRC)).returncode


# ------------------------------------------------------------------------------------------------ OCI


def _layer(blobs: Path, root: Path, members: Sequence[str], prefix: str = "", exclude: Sequence[str] = ()) -> Blob:
    """A zstd-compressed tar layer of ``members`` (relative to ``root``), stored as prefix/<member> in the tar.

    GNU tar with sorted names, numeric owners and a fixed mtime: the same tree gives the same digest.
    """
    tmp = blobs / f".layer.tmp{os.getpid()}"
    tar = ["tar", "--sort=name", "--numeric-owner", "--owner=0", "--group=0", f"--mtime=@{EPOCH}",
           "--xattrs", "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
           "-C", str(root), *[f"--exclude={e}" for e in exclude]]
    if prefix:
        tar += [f"--transform=s,^\\.,{prefix},S"]
    tar += ["-cf", "-", *members]
    diff = hashlib.sha256()
    with open(tmp, "wb") as out:
        t = subprocess.Popen(tar, stdout=subprocess.PIPE)
        z = subprocess.Popen(["zstd", "-q", "-T0", "-3", "-c"], stdin=subprocess.PIPE, stdout=out)
        assert t.stdout is not None and z.stdin is not None
        while chunk := t.stdout.read(1 << 20):
            diff.update(chunk)
            z.stdin.write(chunk)
        z.stdin.close()
        if t.wait() != 0 or z.wait() != 0:
            raise ImageError(f"packing a layer of {root} failed (tar rc={t.returncode}, zstd rc={z.returncode})")
    digest = file_digest(tmp)
    final = blobs / digest.split(":")[1]
    tmp.rename(final)
    return Blob(digest, final.stat().st_size, "application/vnd.oci.image.layer.v1.tar+zstd",
                 "sha256:" + diff.hexdigest())



# --------------------------------------------------------------------------------------------- images


def base_image(log: Log = print) -> ImageArchive:
    """The base rootfs as a one-layer image (the operator image's ``BASE_IMAGE``)."""
    root = base_rootfs(log)
    key = base_key()
    ref = f"localhost/finetune-base:{key}"
    out = images_dir() / f"finetune-base-{key}.oci.tar"
    if out.is_file():
        return ImageArchive(ref, out, key)
    ensure_tools(["zstd"], log)
    with _lock("base-image"), tempfile.TemporaryDirectory(dir=images_dir(), prefix=".base-oci-") as t:
        if out.is_file():
            return ImageArchive(ref, out, key)
        for old in images_dir().glob("finetune-base-*.oci.tar"):
            old.unlink()
        layout = Path(t)
        (layout / "blobs" / "sha256").mkdir(parents=True)
        layer = _layer(layout / "blobs" / "sha256", root, ["."], exclude=BASE_EXCLUDE)
        write_layout(layout, [layer], {"Env": [f"PATH={_stack_env()['PATH']}"], "Cmd": ["/bin/bash"]}, ref,
                     created=EPOCH, created_by=CREATED_BY)
        tar_layout(layout, out, mtime=EPOCH)
    return ImageArchive(ref, out, key)


def _freeze(venv: Path) -> str:
    """``pip freeze`` of a venv, from its dist-info directories (no interpreter run)."""
    found = []
    for meta in sorted(venv.glob("lib/python3*/site-packages/*.dist-info/METADATA")):
        name = version = ""
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Name: "):
                name = line[6:].strip()
            elif line.startswith("Version: "):
                version = line[9:].strip()
            if not line:
                break
        found.append(f"{name}=={version}")
    return "\n".join(sorted(found, key=str.lower))


def ray_image(stack: str = "dlc", log: Log = print) -> ImageArchive:
    """The Ray image of the real node: base + ``/opt/venv`` of ``stack`` ("dlc": the Ray Train DLC's Python
    stack, the default; "project": the project's own pins), with the DLC's image env and ``/etc/nccl.conf``."""
    venv = venv_dir(stack, log)
    root = base_rootfs(log)
    key = _key(IMAGE_RECIPE, base_key(), venv_key(stack), json.dumps(DLC_ENV))
    ref = f"localhost/finetune-ray:{stack}-{key}"
    out = images_dir() / f"finetune-ray-{stack}-{key}.oci.tar"
    if out.is_file():
        return ImageArchive(ref, out, key)
    ensure_tools(["zstd"], log)
    with _lock(f"ray-image-{stack}"), tempfile.TemporaryDirectory(dir=images_dir(), prefix=".ray-oci-") as t:
        if out.is_file():
            return ImageArchive(ref, out, key)
        for old in images_dir().glob(f"finetune-ray-{stack}-*.oci.tar"):
            old.unlink()
        start = time.monotonic()
        log(f"[images] ray image ({stack}): packing base + {VENV} as OCI layers")
        layout = Path(t)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layers = [_layer(blobs, root, ["."], exclude=BASE_EXCLUDE), _layer(blobs, venv, ["."], prefix=f".{VENV}")]
        env = {k: v for k, v in _stack_env().items() if k in ("PATH", "LANG", "VIRTUAL_ENV", *DLC_ENV)}
        config = {
            "Env": [f"{k}={v}" for k, v in sorted(env.items())],
            "Cmd": ["/bin/bash"], "WorkingDir": "/",
            "ExposedPorts": {"6379/tcp": {}, "8265/tcp": {}, "10001/tcp": {}},
            "Labels": {"dev.finetune.stack": stack, "dev.finetune.python-packages-sha256": _key(_freeze(venv))},
        }
        write_layout(layout, layers, config, ref, created=EPOCH, created_by=CREATED_BY)
        tar_layout(layout, out, mtime=EPOCH)
        log(f"[images] ray image ({stack}): done in {time.monotonic() - start:.0f}s, {_gib(out.stat().st_size)} "
            f"-> {out}")
    return ImageArchive(ref, out, key)


OPERATOR_INPUTS = ("Dockerfile.operator", "pyproject.toml", "README.md", "operator", "training", "crds")


def _tree_digest(paths: Sequence[str]) -> str:
    h = hashlib.sha256()
    for rel in paths:
        p = REPO / rel
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                              and "__pycache__" not in f.parts and f.suffix != ".pyc")
        for f in files:
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _buildah(store: Path, *args: str) -> list[str]:
    return ["buildah", "--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver", "vfs",
            *args]


def _host_ca_args() -> list[str]:
    """This machine's CA bundle for pip in the build's RUN steps (it may hold a TLS-inspecting proxy's CA)."""
    if not Path(HOST_CA).is_file():
        return []
    return ["--volume", f"{HOST_CA}:/run/finetune-host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/finetune-host-ca.crt"]


def operator_image(log: Log = print) -> ImageArchive:
    """``Dockerfile.operator`` built by buildah (chroot isolation, vfs storage, no daemon) from :func:`base_image`
    passed as ``BASE_IMAGE``, written as an OCI archive."""
    base = base_image(log)
    key = _key(IMAGE_RECIPE, base.key, _tree_digest(OPERATOR_INPUTS))
    ref = f"localhost/finetune-operator:{key}"
    out = images_dir() / f"finetune-operator-{key}.oci.tar"
    if out.is_file():
        return ImageArchive(ref, out, key)
    ensure_tools(["buildah", "zstd"], log)
    with _lock("operator-image"), tempfile.TemporaryDirectory(dir=images_dir(), prefix=".operator-build-") as t:
        if out.is_file():
            return ImageArchive(ref, out, key)
        for old in images_dir().glob("finetune-operator-*.oci.tar"):
            old.unlink()
        start = time.monotonic()
        logfile = images_dir() / "operator.build.log"
        logfile.write_text("")
        log(f"[images] operator image: buildah bud Dockerfile.operator FROM {base.ref} (log {logfile})")
        store = Path(t) / "store"
        layout = Path(t) / "layout"
        policy = Path(t) / "policy.json"  # accept the local archive (no registry, nothing to verify)
        policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
        env = {**os.environ, "BUILDAH_ISOLATION": "chroot", "TMPDIR": t}
        _run_logged(_buildah(store, "bud", "--isolation", "chroot", "--signature-policy", str(policy),
                             "--layers=false",
                             "--build-arg", f"BASE_IMAGE=oci-archive:{base.path}", *_host_ca_args(),
                             "-f", str(REPO / "Dockerfile.operator"), "-t", ref, str(REPO)),
                    logfile, "buildah bud", env=env)
        _run_logged(_buildah(store, "push", "--signature-policy", str(policy), ref, f"oci:{layout}"),
                    logfile, "buildah push", env=env)
        index = json.loads((layout / "index.json").read_text())
        desc = index["manifests"][0]
        write_index(layout, desc["digest"], desc["size"], ref)
        shutil.rmtree(store, ignore_errors=True)  # vfs keeps a full copy per layer: drop it now
        tar_layout(layout, out, mtime=EPOCH)
        log(f"[images] operator image: done in {time.monotonic() - start:.0f}s, {_gib(out.stat().st_size)} -> {out}")
    return ImageArchive(ref, out, key)


# ------------------------------------------------------------------------------------------------ CLI


IMAGE_NAMES = ("ray", "operator", "base")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="finetune dev-cluster images",
                                description="Build the real node's images (cached) and print their archives.")
    # No `choices` here: Python 3.11's argparse checks an empty `nargs="*"` list against them and
    # rejects a plain `finetune dev-cluster images` (checked below instead).
    p.add_argument("which", nargs="*", metavar="{ray,operator,base}", help="images to build (default: ray and operator)")
    p.add_argument("--stack", choices=STACKS, default="dlc", help="the Ray image's Python stack (default dlc)")
    p.add_argument("--json", action="store_true", help="print {name: {ref, path, key}} as JSON")
    sub = argv if argv is not None else sys.argv[1:]
    if sub[:1] == ["run"]:  # images run STACK -- ARGV: a command inside base + the stack's venv
        rest = sub[1:]
        stack = rest[0] if rest else ""
        if stack not in STACKS:
            print(f"error: images run: stack must be one of {', '.join(STACKS)}", file=sys.stderr)
            return 2
        cmd = rest[2:] if rest[1:2] == ["--"] else rest[1:]
        try:
            rc = run_in_stack(stack, cmd or ["python3", "--version"], log=_stderr)
        except ImageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if rc < 0:  # killed by a signal: say which (a bare "exit 245" tells nobody it was SIGSEGV)
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            print(f"error: images run {stack}: {shlex.join(cmd)} was killed by {name}", file=sys.stderr)
            return 128 - rc
        return rc
    args = p.parse_args(sub)
    unknown = [w for w in args.which if w not in IMAGE_NAMES]
    if unknown:
        p.error(f"unknown image {unknown[0]!r} (choose from {', '.join(IMAGE_NAMES)})")
    which = args.which or ["ray", "operator"]
    built: dict[str, ImageArchive] = {}
    try:
        for name in which:
            start = time.monotonic()
            img = (ray_image(args.stack, _stderr) if name == "ray" else operator_image(_stderr) if name == "operator"
                   else base_image(_stderr))
            built[name] = img
            _stderr(f"[images] {name}: {img.ref} {img.path} ({_gib(img.path.stat().st_size)}, "
                    f"{time.monotonic() - start:.1f}s)")
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: {"ref": v.ref, "path": str(v.path), "key": v.key} for k, v in built.items()}, indent=2))
    else:
        for k, v in built.items():
            print(f"{k}\t{v.ref}\t{v.path}")
    return 0


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
