"""A real kubelet node for the dev cluster: containerd + runc + the CNI bridge + kubelet + kube-proxy +
CoreDNS + a device plugin advertising simulated accelerators, all upstream, built from Go modules.

How it fits this machine (see docs/dev-cluster.md, "The real node"):

- cgroups v1: every cgroup the node makes lives below the cgroup this process already is in
  (``/process_api/<id>`` in ``/proc/self/cgroup``, read at run time), in every hierarchy; nothing is
  moved out of it, nothing is remounted. kubelet: ``cgroupDriver: cgroupfs``, ``failCgroupV1: false``,
  ``cgroupRoot`` = that directory.
- Network: one bridge (``ftn0``) with the gateway address of a /24 that only the node's pods use; the
  CNI bridge plugin runs with ``isGateway: false`` (it would turn on ``ip_forward``), pods get routes to
  the pod subnet and the Service range only (no default route), forwarding is switched on for the
  bridge alone and a FORWARD rule drops anything leaving it for another interface. kube-proxy
  (iptables mode) makes ClusterIPs work; CoreDNS runs as a host process bound to the gateway address
  behind the ``kube-dns`` Service (``10.96.0.10``) and answers only ``cluster.local`` (no forwarding).
  The ``kubernetes`` Service's endpoint is a forwarder on the gateway address to the apiserver on
  127.0.0.1 (``realnode_wiring.serve_apiserver_to_pods``): pods use in-cluster config as anywhere.
- :meth:`RealNode.teardown` undoes everything: container processes, shims, mounts under the node's
  directories, the bridge and veths, kube-proxy's rules, the cgroups in every hierarchy, the sysctls
  kubelet changes, and files written outside the work directory.

One real node per machine at a time (kube-proxy's iptables chains are global): ``/run/finetune-real-node``
says whose it is.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from . import build, pki, tiny_images
from .oci import ImageArchive

NODE_NAME = "real-node-0"
BRIDGE = "ftn0"
POD_SUBNET = "10.244.250.0/24"
GATEWAY = "10.244.250.1"
CLUSTER_DNS = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
MARKER = Path("/run/finetune-real-node")
NAMESPACE = "k8s.io"  # containerd namespace of the CRI plugin
FORWARD_CHAIN = "FINETUNE-NODE-FWD"
# Simulated accelerators the device plugin advertises (a g6.12xlarge-like shape; no real devices).
FAKE_RESOURCES = {"nvidia.com/gpu": 4, "vpc.amazonaws.com/efa": 1}
# Paths kubelet/containerd/CNI write to outside their configured roots; removed on teardown if the
# node created them.
OUTSIDE_PATHS = [
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/containerd",
    "/run/nri",
    "/opt/containerd",
    "/etc/cni",
    "/opt/cni",
    "/var/lib/containerd",
]
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
# sysctls compared/restored: these trees, less counters and values that change by themselves.
SYSCTL_TREES = ["vm", "kernel", "net/ipv4", "net/netfilter", "net/bridge", "net/core"]
SYSCTL_VOLATILE = (
    "kernel/random/",
    "kernel/ns_last_pid",
    "kernel/pty/nr",
    "kernel/tainted",
    "kernel/keys/",
    "net/netfilter/nf_conntrack_count",
    "vm/stat_refresh",
    "vm/drop_caches",
    "vm/compact_memory",
    "net/ipv4/route/flush",
    "net/ipv4/conf/" + BRIDGE,
    "net/ipv4/conf/veth",
    "net/ipv4/neigh/" + BRIDGE,
    "net/ipv4/neigh/veth",
)

Log = Callable[[str], None]
Spawn = Callable[[str, list[str], dict[str, str] | None], None]


class ImageLike(Protocol):
    """An OCI archive and its image reference (``oci.ImageArchive``)."""

    @property
    def ref(self) -> str: ...

    @property
    def path(self) -> Path: ...


class RealNodeError(RuntimeError):
    """The real node could not be set up here; the message says what and why."""


# ---- small host helpers -------------------------------------------------------------------------------
def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RealNodeError(f"{' '.join(args)} failed (rc={r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def own_cgroup() -> str:
    """The cgroup path this process lives in for the memory controller (``/process_api/<id>`` here)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # pure cgroup v2
            return path
    raise RealNodeError("cannot find this process's memory cgroup in /proc/self/cgroup")


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, named ones, and the unified one)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0] if right else ""
        if fstype in ("cgroup", "cgroup2"):
            out.append(Path(left.split()[4]))
    return sorted(set(out))


def mounts_under(prefixes: list[Path]) -> list[str]:
    """Mount points at or below any of ``prefixes``, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == str(p) or mp.startswith(str(p).rstrip("/") + "/") for p in prefixes):
            found.append(mp)
    return sorted(set(found), key=lambda m: (-m.count("/"), m))


def _umount(path: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.umount2(path.encode(), 2)  # MNT_DETACH


def sysctl_snapshot() -> dict[str, str]:
    """Current values of the sysctls a node may change (see SYSCTL_TREES / SYSCTL_VOLATILE)."""
    out: dict[str, str] = {}
    root = Path("/proc/sys")
    for tree in SYSCTL_TREES:
        for dirpath, _, files in os.walk(root / tree):
            for f in files:
                p = Path(dirpath) / f
                rel = str(p.relative_to(root))
                if rel.startswith(SYSCTL_VOLATILE) or not os.access(p, os.R_OK):
                    continue
                try:
                    out[rel] = p.read_text().strip()
                except OSError:
                    continue
    return out


def links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


def _pids_in_cgroup_tree(root: Path) -> list[int]:
    pids: list[int] = []
    if not root.is_dir():
        return pids
    for dirpath, _, _ in os.walk(root):
        try:
            pids += [int(x) for x in (Path(dirpath) / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def _pids_with_arg(fragment: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if fragment.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def ensure_debian_packages(commands: dict[str, str], log: Log) -> None:
    """Install Debian packages for the commands that are missing ({command: package})."""
    missing = sorted({pkg for cmd, pkg in commands.items() if shutil.which(cmd) is None})
    if not missing:
        return
    log(f"[real-node] installing {' '.join(missing)} (apt-get)")
    ok, out = build.apt_install(missing)
    if not ok:
        raise RealNodeError(f"the real node needs {', '.join(missing)} (Debian packages); apt-get install failed:\n{out}")


# ---- the node -----------------------------------------------------------------------------------------
class RealNode:
    """The real node of one dev cluster (its files live in ``<workdir>/node``)."""

    def __init__(self, workdir: Path, log: Log = print) -> None:
        self.workdir = workdir
        self.dir = workdir / "node"
        self.log = log

    # paths
    @property
    def state_file(self) -> Path:
        return self.workdir / "node-state.json"

    def _state(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.state_file.read_text()))
        except (OSError, ValueError):
            return {}

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def _update(self, **kv: Any) -> dict[str, Any]:
        state = self._state()
        state.update(kv)
        self._save(state)
        return state

    @property
    def run_dir(self) -> Path:
        # Short: unix socket paths are limited to 108 bytes, and test work dirs are long.
        return Path(self._state().get("run_dir") or f"/run/ftnode-{os.getpid()}")

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    def alive(self) -> bool:
        """Whether any process of this node (containerd, shims, kubelet, ...) still runs."""
        state = self._state()
        return bool(state) and bool(
            [p for p in _pids_with_arg(str(self.run_dir)) + _pids_with_arg(str(self.dir)) if p != os.getpid()]
        )

    # ---- setup ---------------------------------------------------------------------------------------
    def prepare_host(self, bins: dict[str, Path]) -> None:
        """Claim the machine's real-node slot and record what teardown must restore (before any change)."""
        if MARKER.exists():
            other = MARKER.read_text().strip()
            stale = RealNode(Path(other), log=self.log)
            if other != str(self.workdir) and stale.state_file.exists() and not stale.alive():
                self.log(f"[real-node] cleaning up the dead real node of {other}")
                problems = stale.teardown()
                if problems:
                    raise RealNodeError(f"could not clean up the dead real node of {other}: {'; '.join(problems)}")
            elif other != str(self.workdir) and stale.state_file.exists():
                raise RealNodeError(
                    f"another dev cluster's real node is up ({other}); one per machine: "
                    f"run `finetune dev-cluster down --workdir {other}` first"
                )
        if BRIDGE in links():
            raise RealNodeError(f"network link {BRIDGE} exists already (a real node not torn down?)")
        ensure_debian_packages({"iptables": "iptables", "conntrack": "conntrack"}, self.log)
        base = own_cgroup()
        run_dir = Path(f"/run/ftnode-{os.getpid()}")
        state = {
            "run_dir": str(run_dir),
            "cgroup_base": base,
            "cgroup_root": f"{base.rstrip('/')}/finetune-node",
            "cgroups_created": [],
            "sysctls": sysctl_snapshot(),
            "outside_created": [p for p in OUTSIDE_PATHS if not os.path.lexists(p)],
            "kube_proxy": str(bins["kube-proxy"]),
            "links_before": sorted(links()),
        }
        self._save(state)
        MARKER.write_text(str(self.workdir) + "\n")
        shutil.rmtree(self.dir, ignore_errors=True)
        for sub in ("containerd", "kubelet", "cni/net.d", "cni/ipam", "pod-logs", "pv", "coredns"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)

    def make_cgroups(self) -> str:
        """``<own cgroup>/finetune-node`` in every hierarchy (cpuset: cpus/mems copied down)."""
        state = self._state()
        root: str = state["cgroup_root"]
        created: list[str] = []
        for h in cgroup_hierarchies():
            parts = [p for p in root.split("/") if p]
            cur = h
            for part in parts:
                parent, cur = cur, cur / part
                if cur.is_dir():
                    continue
                cur.mkdir()
                created.append(str(cur))
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if (parent / f).is_file() and (cur / f).is_file():
                        (cur / f).write_text((parent / f).read_text())
            self._update(cgroups_created=created)
        return root

    def make_bridge(self) -> None:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{GATEWAY}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        # Forwarding for packets that arrive on the bridge only (pod -> ClusterIP -> pod); the global
        # switch (net.ipv4.ip_forward) is left alone.
        Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/forwarding").write_text("1\n")
        _run(["iptables", "-w", "-N", FORWARD_CHAIN], check=False)
        _run(["iptables", "-w", "-F", FORWARD_CHAIN])
        _run(["iptables", "-w", "-A", FORWARD_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP"])
        _run(["iptables", "-w", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN])

    def write_cni_config(self) -> Path:
        conf = {
            "cniVersion": "1.0.0",
            "name": "finetune-dev",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": False,
                    "isDefaultGateway": False,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.dir / "cni" / "ipam"),
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                        # No default route: pods reach their subnet and the Service range, nothing else.
                        "routes": [{"dst": "10.96.0.0/16", "gw": GATEWAY}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        path = self.dir / "cni" / "net.d" / "10-finetune.conflist"
        path.write_text(json.dumps(conf, indent=2))
        return path

    def write_containerd_config(self, bins: dict[str, Path]) -> Path:
        run = self.run_dir
        cfg = f"""version = 3
root = "{self.dir / "containerd" / "root"}"
state = "{run / "state"}"
disabled_plugins = ["io.containerd.nri.v1.nri", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{run / "containerd.sock.ttrpc"}"
[debug]
  address = ""
[metrics]
  address = ""

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = "{self.dir / "containerd" / "opt"}"
  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "{tiny_images.PAUSE_REF}"
  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = "{bins["runc"]}"
          SystemdCgroup = false
          Root = "{run / "runc"}"
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["{bins["bridge"].parent}"]
      conf_dir = "{self.dir / "cni" / "net.d"}"
"""
        path = self.dir / "containerd" / "config.toml"
        path.write_text(cfg)
        return path

    def ctr(self, bins: dict[str, Path], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([str(bins["ctr"]), "--address", str(self.containerd_socket), "-n", NAMESPACE, *args], check=check)

    def import_image(self, bins: dict[str, Path], image: ImageLike, tags: Sequence[str] = ()) -> None:
        """Import an OCI archive into the CRI namespace (``ctr -n k8s.io images import``); ``tags``: further
        references for the same image (``ctr images tag``), e.g. a stable name an example can use."""
        start = time.monotonic()
        # --discard-unpacked-layers (needs --local): the compressed layers go once unpacked (Ray image: 2.7 GB less).
        self.ctr(bins, "images", "import", "--platform", "linux/amd64", "--local", "--discard-unpacked-layers",
                 str(image.path))
        for tag in tags:
            self.ctr(bins, "images", "tag", "--force", image.ref, tag)
        listed = self.ctr(bins, "images", "ls", "-q").stdout.split()
        missing = [r for r in (image.ref, *tags) if r not in listed]
        if missing:
            raise RealNodeError(f"imported {image.path} but containerd lists no {', '.join(missing)} (has: {listed})")
        self.log(f"[real-node] imported {image.ref} in {time.monotonic() - start:.1f}s")

    def write_kubeconfig(self, name: str, server: str, keys: pki.Pki, crt: Path, key: Path) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": str(keys.ca_crt)}}],
            "users": [{"name": "u", "user": {"client-certificate": str(crt), "client-key": str(key)}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        }
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)
        return path

    def write_kubelet_config(self, keys: pki.Pki, ports: dict[str, int], cgroup_root: str) -> Path:
        resolv = self.dir / "resolv.conf"
        resolv.write_text("")  # pods get the cluster DNS; nothing from the host's resolver
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": GATEWAY,
            "port": ports["kubelet"],
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": ports["kubelet-healthz"],
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": True,
            "cgroupRoot": cgroup_root,
            # Requests still schedule, but CPU limits are not enforced as CFS quotas: a few pods share this
            # small (2-core) machine, and a quota of a fraction of a core makes Ray and torch crawl.
            "cpuCFSQuota": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            # Absolute floors, not a percentage of the (shared, large) host disk: 1% of 250 GB is 2.5 GB, and
            # other work filling the disk got the Ray pods of a running job evicted.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "256Mi", "imagefs.available": "256Mi"},
            "evictionPressureTransitionPeriod": "5s",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "podLogsDir": str(self.dir / "pod-logs"),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(keys.ca_crt)},
            },
            "authorization": {"mode": "Webhook"},
            "serializeImagePulls": False,
            "maxPods": 50,
            "nodeStatusReportFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "5s",
            "protectKernelDefaults": False,
            "shutdownGracePeriod": "0s",
        }
        path = self.dir / "kubelet" / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def write_kube_proxy_config(self, kubeconfig: Path, ports: dict[str, int]) -> Path:
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "hostnameOverride": NODE_NAME,
            "bindAddress": GATEWAY,
            "healthzBindAddress": f"127.0.0.1:{ports['kube-proxy-healthz']}",
            "metricsBindAddress": f"127.0.0.1:{ports['kube-proxy-metrics']}",
            "clusterCIDR": POD_SUBNET,
            "nodePortAddresses": [f"{GATEWAY}/32"],
            # 0 = leave the host's conntrack settings alone.
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
                "udpTimeout": "0s",
                "udpStreamTimeout": "0s",
            },
            # masqueradeAll: replies of a pod reached through a ClusterIP from the same bridge come back
            # through the host, whatever the bridge-netfilter setting. No route_localnet change.
            "iptables": {
                "masqueradeAll": True,
                "localhostNodePorts": False,
                "syncPeriod": "10s",
                "minSyncPeriod": "0s",
            },
        }
        path = self.dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def write_corefile(self, kubeconfig: Path, ports: dict[str, int]) -> Path:
        corefile = f""".:53 {{
    bind {GATEWAY}
    errors
    health 127.0.0.1:{ports["coredns-health"]}
    ready 127.0.0.1:{ports["coredns-ready"]}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
        path = self.dir / "coredns" / "Corefile"
        path.write_text(corefile)
        return path

    # ---- teardown ------------------------------------------------------------------------------------
    def kill_containers(self) -> None:
        """SIGKILL every process in the node's cgroups, then the containerd shims of this node."""
        state = self._state()
        if not state:
            return
        root = state.get("cgroup_root", "")
        hierarchies = cgroup_hierarchies()
        deadline = time.monotonic() + 20
        while True:
            pids = [p for h in hierarchies for p in _pids_in_cgroup_tree(h / root.lstrip("/"))] if root else []
            if not pids or time.monotonic() > deadline:
                break
            _kill(pids)
            time.sleep(0.1)
        shims = [p for p in _pids_with_arg(str(self.containerd_socket)) if p != os.getpid()]
        _kill([p for p in shims if "containerd-shim" in _cmdline(p)])

    def teardown(self, kube_proxy: Path | None = None) -> list[str]:
        """Undo every host change the node made; returns what could not be undone (empty: all clean)."""
        state = self._state()
        problems: list[str] = []
        if not state:
            return problems
        self.kill_containers()
        # Leftover shims or containerd of this node (a crashed run).
        _kill([p for p in _pids_with_arg(str(self.run_dir)) if p != os.getpid()])
        # Mounts: container rootfs, network namespaces, kubelet's volumes and its root bind mount.
        prefixes = [self.dir, self.run_dir, Path("/run/containerd"), DEVICE_PLUGIN_DIR.parent]
        for _ in range(3):
            for mp in mounts_under(prefixes):
                _umount(mp)
        left = mounts_under(prefixes)
        if left:
            problems.append(f"mounts left: {left}")
        # Network: veths on the bridge (gone with their namespaces, normally), the bridge, the rules.
        if BRIDGE in links():
            for name in os.listdir("/sys/class/net"):
                master = Path(f"/sys/class/net/{name}/master")
                if master.exists() and os.path.basename(os.readlink(master)) == BRIDGE:
                    _run(["ip", "link", "del", name], check=False)
            _run(["ip", "link", "del", BRIDGE], check=False)
        if shutil.which("iptables"):
            _run(["iptables", "-w", "-D", "FORWARD", "-j", FORWARD_CHAIN], check=False)
            _run(["iptables", "-w", "-F", FORWARD_CHAIN], check=False)
            _run(["iptables", "-w", "-X", FORWARD_CHAIN], check=False)
        remove_kubelet_chains()
        proxy = kube_proxy or (Path(state["kube_proxy"]) if state.get("kube_proxy") else None)
        if proxy is not None and proxy.is_file() and shutil.which("iptables"):
            r = _run([str(proxy), "--cleanup", "--v=0"], check=False)
            if r.returncode != 0:
                problems.append(f"kube-proxy --cleanup: {r.stderr.strip()[-300:]}")
        before_links = set(state.get("links_before", []))
        extra_links = sorted(links() - before_links) if before_links else []
        if extra_links:
            problems.append(f"network links left: {extra_links}")
        # cgroups: everything below the node's root, in every hierarchy, deepest first; then the
        # parents created for it.
        root = state.get("cgroup_root", "")
        if root:
            for h in cgroup_hierarchies():
                top = h / root.lstrip("/")
                if not top.is_dir():
                    continue
                for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
                    try:
                        os.rmdir(dirpath)
                    except OSError as e:
                        problems.append(f"cgroup {dirpath}: {e.strerror}")
        for d in sorted(state.get("cgroups_created", []), key=lambda p: -p.count("/")):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"cgroup {d}: {e.strerror}")
        # sysctls kubelet (or kube-proxy) changed.
        before: dict[str, str] = state.get("sysctls", {})
        now = sysctl_snapshot()
        for key, value in before.items():
            if now.get(key, value) != value:
                try:
                    Path("/proc/sys", key).write_text(value + "\n")
                    self.log(f"[real-node] restored {key.replace('/', '.')} = {value} (was {now[key]})")
                except OSError as e:
                    problems.append(f"sysctl {key}: {e}")
        # Files outside the work directory that the node created.
        for p in state.get("outside_created", []):
            if os.path.lexists(p):
                shutil.rmtree(p, ignore_errors=True)
        for sock in (
            "kubelet.sock",
            "kubelet_internal_checkpoint",
            *[f"fake-{r.replace('/', '_')}.sock" for r in FAKE_RESOURCES],
        ):
            try:
                (DEVICE_PLUGIN_DIR / sock).unlink()
            except OSError:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if not left:
            # containerd's content store and unpacked snapshots: the imported images (the Ray image alone is
            # ~6 GB there); every `up` imports them again into a fresh root anyway. Logs stay.
            shutil.rmtree(self.dir / "containerd" / "root", ignore_errors=True)
        if MARKER.exists() and MARKER.read_text().strip() == str(self.workdir):
            MARKER.unlink()
        if not problems:
            self.state_file.unlink(missing_ok=True)
        return problems


# kubelet's own chains (kube-proxy --cleanup leaves them): table -> chains.
KUBELET_CHAINS = {
    "filter": ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"],
    "nat": ["KUBE-KUBELET-CANARY"],
    "mangle": ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"],
}


def remove_kubelet_chains() -> None:
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for hook in ("INPUT", "OUTPUT"):
            while _run([tool, "-w", "-t", "filter", "-D", hook, "-j", "KUBE-FIREWALL"], check=False).returncode == 0:
                pass
        for table, chains in KUBELET_CHAINS.items():
            for chain in chains:
                _run([tool, "-w", "-t", table, "-F", chain], check=False)
                _run([tool, "-w", "-t", table, "-X", chain], check=False)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def node_images(log: Log = print) -> list[ImageArchive]:
    """The images every real node imports: the sandbox (pause) and the smoke tests' busybox."""
    return [tiny_images.pause_image(log=log), tiny_images.busybox_image(log=log)]


def node_binaries(log: Log = print) -> dict[str, Path]:
    return build.ensure_node_built(log=log)
