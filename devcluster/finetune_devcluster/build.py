"""Build the dev cluster's binaries from Go modules and cache them outside the repository.

Layout of the cache (``$FINETUNE_CACHE_DIR``, default ``~/.cache/finetune-operator``)::

    bin/kubernetes-v1.37.2/{kube-apiserver,kube-controller-manager,kube-scheduler}
    bin/etcd-v3.7.3/etcd
    bin/kuberay-<KUBERAY_VERSION>/ray-operator   bin/kuberay-<KUBERAY_VERSION>/crds/ray.io_*.yaml
    bin/kwok-v0.8.0/kwok              bin/kwok-v0.8.0/stages/*.yaml
    bin/kubernetes-node-v1.37.2/{kubelet,kube-proxy,kubectl}   bin/containerd-v2.4.2/{containerd,ctr,...}
    bin/runc-v1.5.3/runc  bin/cni-plugins-v1.10.0/{bridge,...}  bin/coredns-v1.15.0/coredns
    bin/deviceplugin-v0.37.2/fake-device-plugin          (the real-node parts: NODE_COMPONENTS)
    bin/argocd-v3.6.1/{argocd,argocd-lua-health}   bin/argocd-v3.6.1/crds/*.yaml   (only when asked for)
    src/<component>-<version>/{go.mod,go.sum}   (the wrapper module the build ran in)

One ``go build`` per wrapper module (the three Kubernetes binaries share one), all sharing the normal Go
build cache. A ``.stamp`` file records what a directory was built from; a changed wrapper module or Go
version rebuilds it. The only network access is the Go module proxy (module downloads).

The real-node parts are built only on demand (``ensure_node_built``, ``build --real-node``), under their
own lock, so a kwok-only cluster never waits for them. runc is the one cgo build (seccomp needs Debian's
``libseccomp-dev``, installed with apt-get when its header is missing).

``KUBEBUILDER_ASSETS`` (the envtest convention) names a directory of prebuilt binaries: a component whose
binaries are all there is not built, and those binaries are used instead of the cached ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import yaml

from .filelock import file_lock
from .versions import ALL_COMPONENTS, COMPONENTS, NODE_COMPONENTS, Component

TOOLS_DIR = Path(__file__).parent / "tools"
Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The Go toolchain is missing or a build failed; the message says which and where the log is."""


def cache_dir() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE_DIR") or Path.home() / ".cache" / "finetune-operator")


def find_go() -> str:
    candidates = [os.environ.get("GO", ""), shutil.which("go") or ""]
    goroot = os.environ.get("GOROOT")
    if goroot:
        candidates.append(str(Path(goroot) / "bin" / "go"))
    candidates.append("/usr/local/go/bin/go")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise BuildError("no Go toolchain found (looked at $GO, PATH, $GOROOT/bin, /usr/local/go/bin)")


def component_dir(comp: Component) -> Path:
    return cache_dir() / "bin" / comp.key


def _assets_dir() -> Path | None:
    value = os.environ.get("KUBEBUILDER_ASSETS")
    return Path(value) if value else None


def _from_assets(comp: Component) -> dict[str, Path] | None:
    """The component's binaries from ``KUBEBUILDER_ASSETS``, if all of them are there."""
    assets = _assets_dir()
    if assets is None:
        return None
    found = {name: assets / name for name in comp.binaries.values()}
    if all(os.access(p, os.X_OK) for p in found.values()):
        return found
    return None


def _go_env(comp: Component | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if comp is not None and comp.toolchain:
        env["GOTOOLCHAIN"] = comp.toolchain  # downloaded once through the module proxy, then cached
    # Static binaries, no C toolchain needed, and faster to build; runc needs cgo for seccomp.
    env["CGO_ENABLED"] = "1" if comp is not None and comp.cgo else "0"
    env["GOWORK"] = "off"
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -mod=readonly -buildvcs=false").strip()
    return env


def _go_version(go: str, comp: Component | None = None) -> str:
    env = _go_env(comp) if comp is not None and comp.toolchain else None
    return subprocess.run([go, "env", "GOVERSION"], check=True, capture_output=True, text=True, env=env).stdout.strip()


def _own_sources(comp: Component) -> list[Path]:
    """Source files of our own main packages in the wrapper module (``tools/<name>/<dir>/*.go``)."""
    return sorted(p for p in (TOOLS_DIR / comp.name).rglob("*.go"))


def _module_files(comp: Component) -> list[Path]:
    """The files of the wrapper module (plus the Go source of a local module)."""
    d = TOOLS_DIR / comp.name
    return [d / "go.mod", d / "go.sum", *(sorted(d.glob("*.go")) if comp.local else [])]


# The generated go.mod's first line names the generator, which is no input of the build: stamps hash it as it
# read when the caches were first filled, so moving the generator (finetune_operator.devcluster ->
# finetune_devcluster) rebuilt nothing.
_STAMPED_HEADER = b"// Code generated by python -m finetune_operator.devcluster.gen_tools; DO NOT EDIT.\n"


def _stamp_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name == "go.mod" and data.startswith(b"// Code generated by "):
        data = _STAMPED_HEADER + data.split(b"\n", 1)[1]
    return data


def _stamp(comp: Component, go_version: str) -> str:
    h = hashlib.sha256()
    for path in _module_files(comp):
        h.update(_stamp_bytes(path))
    if not comp.local:
        for src in _own_sources(comp):
            h.update(str(src.relative_to(TOOLS_DIR / comp.name)).encode())
            h.update(src.read_bytes())
    h.update(go_version.encode())
    h.update(json.dumps(sorted(comp.binaries.items())).encode())
    # (Absent for the control plane: its stamps stay as they were.)
    if comp.cgo or comp.xflags:
        h.update(json.dumps([comp.cgo, list(comp.tags), list(comp.xflags)]).encode())
    elif comp.tags:
        h.update(",".join(comp.tags).encode())
    return h.hexdigest()


def is_built(comp: Component, go_version: str | None = None) -> bool:
    d = component_dir(comp)
    if not all((d / b).is_file() for b in comp.binaries.values()):
        return False
    stamp = d / ".stamp"  # written last: its presence means the directory is complete
    if not stamp.is_file():
        return False
    # Without a Go version this is the quick check (no Go needed): presence is enough.
    return go_version is None or stamp.read_text().strip() == _stamp(comp, go_version)


def binaries(components: dict[str, Component] | None = None) -> dict[str, Path]:
    """Every binary the dev cluster runs, by name; prebuilt ``KUBEBUILDER_ASSETS`` ones win."""
    out: dict[str, Path] = {}
    for comp in (COMPONENTS if components is None else components).values():
        found = _from_assets(comp)
        if found is None:
            found = {name: component_dir(comp) / name for name in comp.binaries.values()}
        out.update(found)
    return out


def kuberay_crds() -> list[Path]:
    return sorted((component_dir(COMPONENTS["kuberay"]) / "crds").glob("*.yaml"))


def kwok_stages() -> list[Path]:
    return sorted((component_dir(COMPONENTS["kwok"]) / "stages").glob("*.yaml"))


def node_binaries() -> dict[str, Path]:
    """The real node's binaries (kubelet, kube-proxy, kubectl, containerd, runc, CNI plugins, ...)."""
    return binaries(NODE_COMPONENTS)


def missing(components: dict[str, Component] | None = None) -> list[str]:
    """Names of components that still need building (a cheap check: no Go invoked)."""
    comps = COMPONENTS if components is None else components
    return [c.name for c in comps.values() if _needs_build(c, None, force=False)]


def _lock(name: str = ".build.lock") -> AbstractContextManager[None]:
    """Serialise builds between processes (two test sessions starting at once share the cache)."""
    return file_lock(cache_dir() / "bin" / name)


def _ldflags(comp: Component, info: dict[str, Any]) -> str:
    flags = ["-s", "-w"]  # no symbol table / DWARF: links much faster, binaries ~30% smaller
    flags += [f"-X {k}={v}" for k, v in comp.xflags]
    if comp.module == "k8s.io/kubernetes":
        # What hack/lib/version.sh sets: components read their own version (and derive the emulated
        # version from it), so an unset one ("v0.0.0-master") misbehaves.
        major, minor = comp.version.lstrip("v").split(".")[:2]
        values = {
            "gitVersion": comp.version,
            "gitMajor": major,
            "gitMinor": minor,
            "gitTreeState": "clean",
            "buildDate": info.get("Time", "1970-01-01T00:00:00Z"),
        }
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [f"-X {pkg}.{k}={v}" for k, v in values.items()]
    return " ".join(flags)


def _kustomize_files(directory: Path) -> Iterable[Path]:
    """Resource files of a kustomization, following directory references (kwok's stage layout)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for res in kust.get("resources", []):
        p = (directory / res).resolve()
        if p.is_dir():
            yield from _kustomize_files(p)
        else:
            yield p


def _copy_assets(comp: Component, module_dir: Path, out: Path) -> None:
    if comp.name == "kuberay":
        (out / "crds").mkdir()
        for crd in sorted((module_dir / "config" / "crd" / "bases").glob("ray.io_*.yaml")):
            shutil.copyfile(crd, out / "crds" / crd.name)
    elif comp.name == "argocd":
        (out / "crds").mkdir()
        for crd in sorted((module_dir / "manifests" / "crds").glob("*-crd.yaml")):
            shutil.copyfile(crd, out / "crds" / crd.name)
        # The repo-server runs it on every git checkout (commit signature check, even when unused).
        shutil.copyfile(module_dir / "hack" / "git-verify-wrapper.sh", out / "git-verify-wrapper.sh")
        (out / "git-verify-wrapper.sh").chmod(0o755)
        (out / "config").mkdir()  # upstream's argocd-cm etc., the base our deploy/argocd/ patches
        for cfg in sorted((module_dir / "manifests" / "base" / "config").glob("*.yaml")):
            shutil.copyfile(cfg, out / "config" / cfg.name)
    elif comp.name == "kwok":
        # The stage set kwokctl uses by default: nodes initialise and heartbeat, pods become Ready and
        # complete (Job pods too), deletion is honoured.
        (out / "stages").mkdir()
        for stage in _kustomize_files(module_dir / "kustomize" / "stage" / "fast"):
            shutil.copyfile(stage, out / "stages" / stage.name)


def apt_install(packages: Sequence[str]) -> tuple[bool, str]:
    """``apt-get install -y`` (then ``apt-get update`` and once more if that failed: a fresh machine's lists
    may be stale or empty). Returns (ok, the output's tail). Serialised across our processes (``make
    prebuild`` builds images beside the Go builds, both may install packages), and apt itself waits for a
    dpkg lock held by anyone else instead of failing at once."""
    apt = shutil.which("apt-get")
    if apt is None:
        return False, "there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    with file_lock(cache_dir() / ".apt.lock"):
        r = subprocess.run([apt, *wait, "install", "-y", "-q", *packages], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run([apt, *wait, "update", "-q"], env=env, capture_output=True)
            r = subprocess.run([apt, *wait, "install", "-y", "-q", *packages], env=env, capture_output=True, text=True)
    return r.returncode == 0, f"{r.stdout[-2000:]}{r.stderr[-2000:]}"


def _ensure_libseccomp(log: Log) -> None:
    """runc's seccomp build links libseccomp: install Debian's -dev package when its header is missing."""
    if Path("/usr/include/seccomp.h").is_file():
        return
    log("[build] runc: installing libseccomp-dev (apt-get)")
    ok, out = apt_install(["libseccomp-dev"])
    if not ok:
        raise BuildError(f"runc: needs libseccomp's headers (/usr/include/seccomp.h); apt-get install libseccomp-dev "
                         f"failed:\n{out}")


def _build_one(comp: Component, go: str, go_version: str, log: Log) -> float:
    start = time.monotonic()
    src = cache_dir() / "src" / comp.key
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True, exist_ok=True)
    for path in _module_files(comp):
        shutil.copyfile(path, src / path.name)
    if not comp.local:
        for own in _own_sources(comp):
            dest = src / own.relative_to(TOOLS_DIR / comp.name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(own, dest)
    logfile = cache_dir() / "bin" / f"{comp.key}.build.log"
    env = _go_env(comp)
    if "seccomp" in comp.tags:
        _ensure_libseccomp(log)
    dl = subprocess.run([go, "mod", "download", "-json", comp.module], cwd=src, env=env, capture_output=True, text=True)
    if dl.returncode != 0:
        raise BuildError(f"{comp.name}: go mod download {comp.module} failed:\n{dl.stdout}{dl.stderr}")
    info = json.loads(dl.stdout)
    try:
        info.update(json.loads(Path(info["Info"]).read_text()))
    except (KeyError, OSError, ValueError):
        pass
    final = component_dir(comp)
    tmp = final.with_name(f".{comp.key}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pkgs = list(comp.binaries)
    target = str(tmp / comp.binaries[pkgs[0]]) if len(pkgs) == 1 else str(tmp) + os.sep
    tags = ["-tags", ",".join(comp.tags)] if comp.tags else []
    cmd = [go, "build", *tags, "-ldflags", _ldflags(comp, info), "-o", target, *pkgs]
    log(f"[build] {comp.name} {comp.version}: {' '.join(comp.binaries.values())} (log: {logfile})")
    with open(logfile, "w") as lf:
        lf.write(f"$ (cd {src} && {' '.join(cmd)})\n")
        lf.flush()
        rc = subprocess.run(cmd, cwd=src, env=env, stdout=lf, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(logfile.read_text().splitlines(keepends=True)[-40:])
        raise BuildError(f"{comp.name}: go build failed (rc={rc}); log {logfile}:\n{tail}")
    for name in comp.binaries.values():
        if not (tmp / name).is_file():
            raise BuildError(f"{comp.name}: go build did not produce {name} in {tmp}")
    _copy_assets(comp, Path(info["Dir"]), tmp)
    (tmp / ".stamp").write_text(_stamp(comp, go_version) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    took = time.monotonic() - start
    log(f"[build] {comp.name} {comp.version}: done in {took:.0f}s -> {final}")
    return took


def _needs_build(comp: Component, go_version: str | None, force: bool) -> bool:
    if force:
        return True
    # KubeRay's CRDs and kwok's stages come from the module, so those two are always cached by us.
    if comp.name not in ("kuberay", "kwok") and _from_assets(comp) is not None:
        return False
    return not is_built(comp, go_version)


def build(names: Iterable[str] | None = None, force: bool = False, log: Log = print) -> dict[str, float]:
    """Build what is missing or stale; return seconds spent per component built (empty: nothing to do).

    No names: the control plane. Real-node and optional (Argo CD, helm, promtool, ...) components are
    built only when named; control-plane and the other components build under separate locks.
    """
    comps = [ALL_COMPONENTS[n] for n in (names or COMPONENTS)]
    go = find_go()
    timings: dict[str, float] = {}
    others = {name: comp for name, comp in ALL_COMPONENTS.items() if name not in COMPONENTS}
    for lock, group in ((".build.lock", COMPONENTS), (".build-node.lock", others)):
        todo = [c for c in comps if c.name in group]
        if not todo:
            continue
        with _lock(lock):
            for comp in todo:
                go_version = _go_version(go, comp)
                if _needs_build(comp, go_version, force):
                    timings[comp.name] = _build_one(comp, go, go_version, log)
    return timings


def missing_optional(names: Iterable[str]) -> list[str]:
    """Which of these optional components (e.g. ``argocd``) still need building (no Go invoked)."""
    return [n for n in names if not is_built(ALL_COMPONENTS[n])]


def optional_binaries(name: str, log: Log = print) -> Path:
    """The directory of an optional component (e.g. ``argocd``, ``helm``), built first if it is not cached."""
    comp = ALL_COMPONENTS[name]
    if not is_built(comp):
        build([name], log=log)
    return component_dir(comp)


def ensure_built(log: Log = print) -> dict[str, Path]:
    """Build whatever is missing (cheap when everything is cached) and return the binaries."""
    if missing():
        build(log=log)
    return binaries()


def ensure_node_built(log: Log = print) -> dict[str, Path]:
    """Build the real node's parts if missing (cheap when cached) and return their binaries."""
    todo = missing(NODE_COMPONENTS)
    if todo:
        build(todo, log=log)
    return node_binaries()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the dev cluster's binaries from Go modules.")
    parser.add_argument(
        "components", nargs="*", help=f"subset of {sorted(ALL_COMPONENTS)} (default: the control plane)"
    )
    parser.add_argument("--real-node", action="store_true", help="also the real node's parts")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--print-dir", action="store_true", help="print the binary directories and exit")
    args = parser.parse_args(argv)
    unknown = set(args.components) - set(ALL_COMPONENTS)
    if unknown:
        parser.error(f"unknown components {sorted(unknown)}; known: {sorted(ALL_COMPONENTS)}")
    names = list(args.components) or (list(ALL_COMPONENTS) if args.real_node else list(COMPONENTS))
    if args.print_dir:
        for name, path in binaries(ALL_COMPONENTS if args.real_node else None).items():
            print(f"{name}\t{path}")
        return 0
    start = time.monotonic()
    try:
        timings = build(names, force=args.force)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    total = time.monotonic() - start
    if timings:
        parts = ", ".join(f"{k} {v:.0f}s" for k, v in timings.items())
        print(f"[build] built {parts}; total {total:.0f}s (cache: {cache_dir() / 'bin'})")
    else:
        print(f"[build] everything up to date in {cache_dir() / 'bin'} ({total:.1f}s)")
    return 0


if __name__ == "__main__":  # prefer `python -m finetune_devcluster.cli build`
    sys.exit(main())
