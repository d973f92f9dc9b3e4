"""Start-up network health probe: which network NCCL chose, EFA devices and counters, bus bandwidth.

The parsing (`parse_nccl_log`, `assess`) is pure and tested on logs rebuilt from the upstream format
strings (tests/training/fixtures/nccl/, each file names the source lines it follows); `run_probe` does the
I/O in a training worker: it times a short all-reduce (whose first call initialises NCCL and makes it log
its network choice), reads this process's NCCL debug file, counts the EFA devices the pod was given,
diffs their hardware counters, gathers every rank's view and decides.

What NCCL 2.27-2.29 and aws-ofi-nccl 1.14-1.17 write into the NCCL debug file (the `NCCL INFO` /
`[file:line] NCCL WARN` lines of src/debug.cc) and what the probe makes of it:
- the choice: `Assigned NET plugin <name> to comm` (src/plugin/net.cc) is authoritative, then `Using
  network <name>` (src/init.cc), then the channel lines `via NET/<name>/<dev>` (src/transport/net.cc).
  `Initialized NET plugin <name>` is not a choice: 2.27 initialises Socket even when `NCCL_NET` then
  refuses it.
- aws-ofi-nccl names its network `Libfabric`, or `OFI` / `AWS Libfabric` when `NCCL_NET` is set to those
  (nccl_ofi_interface_nvidia.cpp). On that network the transport is EFA only when its `NET/OFI Selected
  provider is efa, ...` line says so; without a provider line it stays "unknown" (never assumed socket).
- why the plugin is not in use: `NET/Plugin: Could not find: <names>` (absent), `NET/Plugin: [<lib>: ]
  <dlerror>` (present but not loadable), `External network plugin <lib> is unsupported` (2.28+; 2.27 logs
  `Failed to find ncclNetPlugin_v6 symbol.`), or it loaded and failed to initialise: `Failed to initialize
  NET plugin <name>` (2.28+; 2.27 is silent) with aws-ofi-nccl's `No eligible providers were found` (1.15+;
  1.14 warns `OFI fi_getinfo() call failed: No data available`), `Unable to find a protocol that worked`,
  `aws-ofi-nccl initialization failed`. `Failed to find ncclCollNetPlugin_vN symbol.` (2.27) only says the
  plugin has no CollNet, which aws-ofi-nccl never has: not a failure.
- `Failed to initialize any NET plugin` (WARN): no network at all, which happens only when every plugin
  failed or `NCCL_NET` names one that did; with requireEFA the renderer pins `NCCL_NET=Libfabric` so
  that NCCL itself refuses to fall back, and the probe says which of the two caught it.
Text that never reaches the NCCL debug file is not looked for there: PyTorch's exception text (`NCCL
error in: ...`, `unhandled system error`, `remote process exited or there was a network error`, the
watchdog's `Watchdog caught collective operation timeout`) comes back as the all-reduce's exception and
is summarised from it; libfabric's own warnings (`fi_getinfo: provider efa ...`) go through libfabric's
logger to stderr (only with `FI_LOG_LEVEL` set) and are not read.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_operator.api.status import NetworkHealth

from .errors import DeterministicError

INFINIBAND_ROOT = "/sys/class/infiniband"
DEV_INFINIBAND = "/dev/infiniband"
# ports/1/hw_counters of the efa driver (amzn-drivers kernel/linux/efa, EFA_DEFINE_PORT_STATS): tx/rx
# always; rdma_read_* from r1.10.1, rdma_write_* from r2.5.0, retrans_* and the remote events from r2.17.0.
COUNTERS = (
    "tx_bytes", "rx_bytes", "rx_drops", "rdma_read_bytes", "rdma_read_resp_bytes", "rdma_write_bytes",
    "rdma_write_recv_bytes", "retrans_bytes", "retrans_pkts", "retrans_timeout_events",
    "unresponsive_remote_events", "impaired_remote_conn_events",
)
# aws-ofi-nccl's network names: "Libfabric" by default, renamed by NCCL_NET=OFI / "AWS Libfabric".
LIBFABRIC_NAMES = ("libfabric", "ofi", "aws libfabric")
PLUGIN_NETWORK = "Libfabric"  # what the renderer pins NCCL_NET to with requireEFA
# Message prefixes the operator's status derivation keys the NetworkHealthy reason on.
CAUGHT_BY_NCCL = "requireEFA (caught by NCCL)"
CAUGHT_BY_PROBE = "requireEFA (caught by the probe)"

_I = re.IGNORECASE
_RE_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
# Messages, matched from the start of what follows "NCCL INFO " / "NCCL WARN ".
_RE_OFI_INIT = re.compile(r"NET/OFI Initializing aws-ofi-nccl (\S+)")
_RE_LIBFABRIC = re.compile(r"NET/OFI Using Libfabric version (\S+)")
# "Selected Provider is %s (found %d nics)" up to v1.11; ", fabric is %s" since.
_RE_PROVIDER = re.compile(r"NET/OFI Selected provider is ([^,\s]+)(?:, fabric is (\S+))?(?: \(found (\d+) nics\))?", _I)
_RE_OFI_NO_PROVIDER = re.compile(r"NET/OFI (?:No eligible providers were found|OFI fi_getinfo\(\) call failed: No data)")
_RE_OFI_FAILED = re.compile(r"NET/OFI (?:Unable to find a protocol that worked|aws-ofi-nccl initialization failed"
                            r"|Initializing plugin failed|OFI fi_getinfo\(\) call failed)")
_RE_LOADED = re.compile(r"NET/Plugin: Loaded net plugin (.+) \(v(\d+)\)$")
_RE_NET_SYMBOL = re.compile(r"NET/Plugin: Failed to find ncclNetPlugin_v(\d+) symbol")
_RE_NOT_FOUND = re.compile(r"NET/Plugin: Could not find:(.*)$")
_RE_NO_PLUGIN = re.compile(r"NET/Plugin ?: ?No plugin found")  # NCCL before 2.19
_RE_LIB = re.compile(r"(?:NET/Plugin: Plugin name set by env to|Successfully loaded external (?:network )?plugin) (.+)$")
_RE_UNSUPPORTED = re.compile(r"External network plugin (.+) is unsupported$")
_RE_DLERROR = re.compile(r"NET/Plugin: (.*(?:cannot open shared object file|undefined symbol|ELF|file too short"
                         r"|not found \(required by|static TLS).*)$")
_RE_INITIALIZED = re.compile(r"Initialized NET plugin (.+)$")
_RE_INIT_FAILED = re.compile(r"Failed to initialize NET plugin (.+)$")
_RE_ASSIGNED = re.compile(r"Assigned NET plugin (.+) to comm$")
_RE_NETWORK = re.compile(r"Using network (.+)$")
_RE_NO_NETWORK = re.compile(r"Failed to initialize any NET plugin")
_RE_NO_IB = re.compile(r"NET/IB ?: ?No device found")
_RE_VIA = re.compile(r" via (NET/[^/]+|P2P|SHM|CollNet)")
# PyTorch's exception text (ProcessGroupNCCL / NCCLUtils), never in the NCCL debug file.
_TORCH_FAILURES = (
    ("Failed to initialize any NET plugin", "NCCL found no usable network"),
    ("remote process exited or there was a network error", "a peer exited or the network failed"),
    ("unhandled system error", "NCCL system error"),
    ("Watchdog caught collective operation timeout", "collective timed out"),
)


class NetworkProbeError(RuntimeError):
    """The network is not what the spec requires (requireEFA and no EFA, or NCCL failed)."""

    def __init__(self, message: str, health: NetworkHealth | None = None) -> None:
        super().__init__(message)
        self.health = health


class RequireEFAError(NetworkProbeError, DeterministicError):
    """requireEFA and the network is not EFA: the same nodes and image give the same verdict on a restart."""


def is_libfabric(name: str | None) -> bool:
    return (name or "").strip().lower() in LIBFABRIC_NAMES


@dataclass
class NcclLogFacts:
    nccl_version: str | None = None
    plugin_version: str | None = None  # aws-ofi-nccl
    libfabric_version: str | None = None
    plugin_name: str | None = None  # the network name the external plugin gave ("Libfabric", "OFI", ...)
    plugin_api: int | None = None  # ncclNet_vN NCCL loaded
    plugin_lib: str | None = None
    provider: str | None = None
    fabric: str | None = None
    nics: int | None = None
    assigned: str | None = None  # "Assigned NET plugin X to comm"
    network: str | None = None  # "Using network X"
    initialized: list[str] = field(default_factory=list)
    init_failed: list[str] = field(default_factory=list)
    via: set[str] = field(default_factory=set)  # "NET/Libfabric", "NET/Socket", "P2P", "SHM"
    not_found: list[str] = field(default_factory=list)  # "Could not find:" names
    unloadable: str | None = None  # the dlerror text
    unsupported: bool = False  # loaded but no ncclNetPlugin_vN NCCL knows
    ofi_no_provider: bool = False
    ofi_failed: bool = False
    no_network: bool = False  # "Failed to initialize any NET plugin"
    ib_missing: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def selected(self) -> str | None:
        """The network NCCL chose, from the most authoritative line logged."""
        if self.assigned or self.network:
            return self.assigned or self.network
        nets = sorted(v[4:] for v in self.via if v.startswith("NET/"))
        return nets[0] if len(nets) == 1 else None

    @property
    def on_libfabric(self) -> bool:
        sel = self.selected
        return sel is not None and (is_libfabric(sel) or (sel == self.plugin_name and self.plugin_version is not None))

    @property
    def transport(self) -> str:
        sel = self.selected
        if sel is None:
            return "none" if self.no_network else "unknown"
        if self.on_libfabric:
            if self.provider is None:
                return "unknown"  # a libfabric network without its provider line: not proven either way
            return "efa" if self.provider.startswith("efa") else "socket"
        return sel.lower()  # "socket", "ib", or another plugin's name

    @property
    def inter_node(self) -> bool | None:
        """Whether any channel goes over the network (None when no channel lines were logged)."""
        if not self.via:
            return None
        return any(v.startswith(("NET/", "CollNet")) for v in self.via)

    @property
    def plugin_problem(self) -> str | None:
        """Why the external plugin is not NCCL's network, in words (None when it is, or nothing says)."""
        if self.on_libfabric:
            return None
        if self.unloadable:
            return f"network plugin present but not loadable: {self.unloadable}"
        if self.unsupported:
            return "network plugin loaded but exports no ncclNetPlugin version this NCCL supports"
        if self.plugin_name is not None or self.plugin_version is not None:
            what = f"aws-ofi-nccl {self.plugin_version or '?'}"
            if self.ofi_failed or self.ofi_no_provider or self.plugin_name in self.init_failed:
                return f"{what} failed to initialise" + (": no eligible libfabric provider (no EFA device?)"
                                                         if self.ofi_no_provider else "")
            if self.plugin_name in self.initialized:
                return f"network {self.plugin_name} initialised but NCCL chose another (NCCL_NET?)"
            if self.selected is not None or self.no_network:
                return f"{what} did not initialise"
        if self.not_found:
            return f"aws-ofi-nccl plugin not found (NCCL looked for {' '.join(self.not_found)})"
        return None


def _message(line: str) -> tuple[str | None, str]:
    """(level, message) of an NCCL debug line: what follows `NCCL INFO ` / `NCCL WARN ` (src/debug.cc)."""
    for level in ("WARN", "INFO"):
        i = line.find(f"NCCL {level} ")
        if i >= 0:
            return level, line[i + len(level) + 6:].strip()
    return None, line.strip()


def parse_nccl_log(text: str) -> NcclLogFacts:
    f = NcclLogFacts()
    for raw in text.splitlines():
        level, msg = _message(raw)
        if f.nccl_version is None and (m := _RE_VERSION.search(raw)):
            f.nccl_version = m.group(1)
        if level is None or not msg:
            continue
        if level == "WARN":
            f.warnings.append(msg[:300])
        if m := _RE_OFI_INIT.match(msg):
            f.plugin_version = m.group(1)
        elif m := _RE_LIBFABRIC.match(msg):
            f.libfabric_version = m.group(1)
        elif m := _RE_PROVIDER.match(msg):
            f.provider, f.fabric = m.group(1).lower(), m.group(2)
            f.nics = int(m.group(3)) if m.group(3) else f.nics
        elif m := _RE_LOADED.match(msg):
            f.plugin_name, f.plugin_api = m.group(1), int(m.group(2))
        elif m := _RE_LIB.match(msg):
            f.plugin_lib = m.group(1).strip()
        elif m := _RE_UNSUPPORTED.match(msg):
            f.unsupported, f.plugin_lib = True, m.group(1)
        elif _RE_NET_SYMBOL.match(msg):
            f.unsupported = f.plugin_name is None  # 2.27 tries v10..v6; only all of them missing matters
        elif m := _RE_NOT_FOUND.match(msg):
            f.not_found = [n.rstrip(". ") for n in m.group(1).split() if n.rstrip(". ")]
        elif _RE_NO_PLUGIN.match(msg):
            f.not_found = ["libnccl-net.so"]
        elif m := _RE_DLERROR.match(msg):
            f.unloadable = m.group(1)[:300]
        elif m := _RE_INITIALIZED.match(msg):
            f.initialized.append(m.group(1))
        elif m := _RE_INIT_FAILED.match(msg):
            f.init_failed.append(m.group(1))
        elif m := _RE_ASSIGNED.match(msg):
            f.assigned = m.group(1)
        elif m := _RE_NETWORK.match(msg):
            f.network = m.group(1)
        elif _RE_NO_NETWORK.match(msg):
            f.no_network = True
        elif _RE_NO_IB.match(msg):
            f.ib_missing = True
        else:
            f.via.update(_RE_VIA.findall(msg))
        if _RE_OFI_NO_PROVIDER.match(msg):
            f.ofi_no_provider = True
        if _RE_OFI_FAILED.match(msg):
            f.ofi_failed = True
    if f.plugin_name is not None:
        f.unsupported = False
    return f


def torch_error_summary(text: str) -> str:
    """One line from PyTorch's NCCL exception: its first line, what it means, and NCCL's last error."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    head = lines[0][:240] if lines else ""
    meaning = next((m for pat, m in _TORCH_FAILURES if pat in text), None)
    last = None
    for i, ln in enumerate(lines):
        if ln.startswith("Last error:"):
            rest = ln[len("Last error:"):].strip()
            last = rest or (lines[i + 1] if i + 1 < len(lines) else None)
    return head + (f" ({meaning})" if meaning else "") + (f"; NCCL's last error: {last[:200]}" if last else "")


def _network_words(facts: NcclLogFacts) -> str:
    t = facts.transport
    if t == "efa":
        return (f"NCCL uses EFA via aws-ofi-nccl {facts.plugin_version or '?'} (network {facts.selected}"
                + (f", fabric {facts.fabric}" if facts.fabric else "")
                + (f", {facts.nics} NIC(s)" if facts.nics else "")
                + (f", libfabric {facts.libfabric_version}" if facts.libfabric_version else "") + ")")
    if facts.on_libfabric:
        if facts.provider is None:
            return f"NCCL uses network {facts.selected} (aws-ofi-nccl) but logged no provider line: transport unknown"
        return f"NCCL uses network {facts.selected} with libfabric provider {facts.provider}, not efa"
    if t == "none":
        return "NCCL initialised no network plugin (Failed to initialize any NET plugin)"
    if facts.selected is None:
        return "NCCL logged no network choice"
    return f"NCCL uses network {facts.selected}"


def assess(facts: NcclLogFacts | None, *, efa_expected: bool, efa_devices: int | None,
           bus_bandwidth_gbps: float | None, backend: str, counters_delta: dict[str, int] | None = None,
           nodes: int = 1, efa_on_node: int | None = None, failure: str | None = None) -> NetworkHealth:
    """Turn what the probe saw into the status' NetworkHealth.

    `failure` is the all-reduce's exception text (PyTorch), when NCCL did not come up at all.
    """
    if backend == "gloo":
        return NetworkHealth(
            transport="gloo", provider=None, efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
            healthy=not efa_expected and failure is None,
            message=("CPU run: collectives use gloo over TCP; NCCL/EFA not in use"
                     + ("; EFA was requested but there are no GPUs" if efa_expected else "")
                     + (f"; all-reduce failed: {torch_error_summary(failure)}" if failure else "")),
        )
    if facts is None:
        notes = ["NCCL init log not captured (set network.ncclDebug: INFO); transport unknown"]
        if failure:
            notes.insert(0, f"NCCL failed: {torch_error_summary(failure)}")
        return NetworkHealth(
            transport="none" if failure and "Failed to initialize any NET plugin" in failure else "unknown",
            efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
            healthy=False if (efa_expected or failure) else None, message="; ".join(notes)[:1000],
        )
    transport = facts.transport
    intra = facts.inter_node is False and nodes <= 1
    healthy = failure is None and transport != "none"
    if efa_expected and transport != "efa":
        healthy = False
        notes = ["EFA expected but NCCL " + ("has no network" if transport == "none" else f"uses {transport}")
                 + (f" (network {facts.selected})" if facts.selected and transport != facts.selected.lower() else "")]
        if facts.on_libfabric or transport == "none":
            notes.append(_network_words(facts))
    else:
        notes = [_network_words(facts)]
    if failure:
        notes.append(f"NCCL failed: {torch_error_summary(failure)}")
    problem = facts.plugin_problem if transport != "efa" else None
    if problem:
        notes.append(problem)
    if efa_expected and not efa_devices:
        notes.append("no EFA device given to the pod" + (f" ({efa_on_node} on the node)" if efa_on_node else "")
                     + "; is vpc.amazonaws.com/efa requested?" if transport != "efa" else
                     "NCCL selected efa but the pod shows no EFA uverbs device")
    if facts.nccl_version:
        notes.append(f"NCCL {facts.nccl_version}")
    if intra:
        notes.append("single node: all channels intra-node (P2P/SHM), no traffic crossed the network")
    if counters_delta:
        tx, rx = counters_delta.get("tx_bytes", 0), counters_delta.get("rx_bytes", 0)
        notes.append(f"EFA counters during probe: tx +{tx / 1e6:.1f} MB, rx +{rx / 1e6:.1f} MB")
        retrans = counters_delta.get("retrans_timeout_events", 0) + counters_delta.get("unresponsive_remote_events", 0)
        if retrans:
            notes.append(f"{retrans} EFA retransmit-timeout/unresponsive-remote event(s)")
        if efa_expected and transport == "efa" and nodes > 1 and tx + rx == 0:
            notes.append("no EFA traffic counted during the all-reduce")
    # Warnings not already explained above (the plugin's own failure, NCCL's "no network").
    other = [w for w in facts.warnings if not (problem and w.startswith("NET/OFI")) and not _RE_NO_NETWORK.match(w)]
    if other and healthy:
        notes.append(f"{len(other)} NCCL warning(s): {other[0]}")
    return NetworkHealth(
        transport="intra-node" if intra and transport not in ("none", "unknown") else transport,
        provider=facts.provider if facts.on_libfabric else None, plugin_version=facts.plugin_version,
        nccl_version=facts.nccl_version, efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
        healthy=healthy, message="; ".join(notes)[:1000] or None,
    )


def meets_require_efa(health: NetworkHealth) -> bool:
    """EFA proven: NCCL's network is aws-ofi-nccl on the efa provider (on one node, even if unused)."""
    if health.transport == "efa":
        return True
    return health.transport == "intra-node" and (health.provider or "").startswith("efa")


def require_efa_failure(health: NetworkHealth, *, pinned_net: str | None) -> NetworkProbeError:
    """The requireEFA error, saying whether NCCL refused (no network, NCCL_NET pinned) or the probe caught it."""
    if health.transport == "none":
        who = CAUGHT_BY_NCCL + (f": NCCL_NET={pinned_net} is pinned and NCCL refused to fall back" if pinned_net
                                else ": NCCL initialised no network at all")
    else:
        who = f"{CAUGHT_BY_PROBE}: NCCL is not using EFA (transport {health.transport}, provider {health.provider or 'none'})"
    message = f"{who}: {health.message}"
    hint = ("Check the vpc.amazonaws.com/efa resource, FI_PROVIDER=efa, NCCL_NET_PLUGIN and the aws-ofi-nccl "
            "plugin in the image.")
    return RequireEFAError(f"network.{message} {hint}",
                             health.model_copy(update={"healthy": False, "message": message[:1000]}))


# ------------------------------------------------------------------------------------------- I/O


@dataclass(frozen=True)
class EfaDevices:
    node: tuple[str, ...]  # RDMA devices bound to the efa driver (sysfs shows the whole node's)
    pod: tuple[str, ...]  # those whose uverbs node the pod was given (the EFA device plugin's doing)


def _driver(dev: Path) -> str:
    try:
        return os.path.basename(os.path.realpath(dev / "device" / "driver"))
    except OSError:
        return ""


def find_efa_devices(root: str = INFINIBAND_ROOT, dev_dir: str = DEV_INFINIBAND) -> EfaDevices:
    """EFA devices: `device/driver` resolves to `efa` (mlx5 and others are not EFA), and, for the pod, the
    device's `device/infiniband_verbs/uverbsN` is present under /dev/infiniband."""
    try:
        names = sorted(p.name for p in Path(root).iterdir())
    except OSError:
        return EfaDevices((), ())
    efa = tuple(n for n in names if _driver(Path(root) / n) == "efa")
    try:
        given = {p.name for p in Path(dev_dir).iterdir() if p.name.startswith("uverbs")}
    except OSError:
        given = set()
    pod = []
    for n in efa:
        try:
            verbs = {p.name for p in (Path(root) / n / "device" / "infiniband_verbs").iterdir()}
        except OSError:
            continue
        if verbs & given:
            pod.append(n)
    return EfaDevices(efa, tuple(pod))


def count_efa_devices(root: str = INFINIBAND_ROOT, dev_dir: str = DEV_INFINIBAND) -> int:
    return len(find_efa_devices(root, dev_dir).pod)


def read_efa_counters(devices: Iterable[str], root: str = INFINIBAND_ROOT) -> dict[str, int]:
    """Sum of each port-1 hw counter over the given devices; counters an older driver lacks are absent."""
    total: dict[str, int] = {}
    for dev in devices:
        base = Path(root) / dev / "ports" / "1" / "hw_counters"
        for name in COUNTERS:
            try:
                total[name] = total.get(name, 0) + int((base / name).read_text().strip())
            except (OSError, ValueError):
                continue
    return total


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in set(before) & set(after)}


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """All-reduce bus bandwidth in GB/s: algbw = S/t, busbw = algbw * 2(n-1)/n."""
    if seconds <= 0 or world < 1:
        return 0.0
    return nbytes / seconds * (2 * (world - 1) / world) / 1e9


def ensure_nccl_debug_file() -> str | None:
    """Point NCCL's debug output at a per-process file (before NCCL initialises); returns the pattern."""
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return None
    os.environ.setdefault("NCCL_DEBUG_FILE", "/tmp/finetune-nccl.%h.%p.log")
    return os.environ["NCCL_DEBUG_FILE"]


def expand_nccl_debug_file(pattern: str, hostname: str, pid: int, *, dashes: bool) -> str:
    """NCCL_DEBUG_FILE as NCCL expands it (src/debug.cc): `%h` is the hostname cut at the first `.`,
    `%p` the pid, `%%` a `%`, any other `%x` stays; from 2.29 (`dashes`) `%` and `/` in the hostname
    become `-`."""
    host = hostname.split(".", 1)[0]
    if dashes:
        host = host.replace("%", "-").replace("/", "-")
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c != "%" or i + 1 >= len(pattern):
            out.append(c)
            i += 1
            continue
        nxt = pattern[i + 1]
        out.append({"%": "%", "h": host, "p": str(pid)}.get(nxt, "%" + nxt))
        i += 2
    return "".join(out)


def find_nccl_debug_file(pattern: str, hostname: str | None = None, pid: int | None = None) -> str | None:
    """The file this process's NCCL wrote, under either version's hostname rule."""
    host = socket.gethostname() if hostname is None else hostname
    me = os.getpid() if pid is None else pid
    for dashes in (True, False):
        path = expand_nccl_debug_file(pattern, host, me, dashes=dashes)
        if os.path.isfile(path):
            return path
    return None


def time_allreduce(nbytes: int, device: Any, iters: int = 5, warmup: int = 2) -> float:
    import torch
    import torch.distributed as dist

    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def backend_for(backend: str, device_type: str) -> str:
    """The backend that carries collectives on this device. A process group made for cpuOffload reports
    ``cpu:gloo,cuda:nccl`` (one backend per device type); a plain one reports ``nccl`` or ``gloo``."""
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return per_device.get(device_type) or next(iter(per_device.values()), backend)


def run_probe(device: Any, *, efa_expected: bool, require_efa: bool, nodes: int) -> NetworkHealth:
    """Collective over all ranks. Raises NetworkProbeError on every rank if requireEFA is violated or NCCL
    does not come up."""
    import torch.distributed as dist

    backend = backend_for(str(dist.get_backend()), device.type)  # the probe's all-reduce runs on `device`
    world = dist.get_world_size()
    log_pattern = os.environ.get("NCCL_DEBUG_FILE") if backend == "nccl" else None
    pinned = os.environ.get("NCCL_NET") if backend == "nccl" else None
    efa = find_efa_devices()
    before = read_efa_counters(efa.pod)
    nbytes = 64 << 20 if device.type == "cuda" else 8 << 20
    failure: str | None = None
    seconds = 0.0
    try:
        seconds = time_allreduce(nbytes, device)
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
    delta = counters_delta(before, read_efa_counters(efa.pod)) if before else None
    facts: NcclLogFacts | None = None
    path = find_nccl_debug_file(log_pattern) if log_pattern else None
    if path:
        try:
            facts = parse_nccl_log(Path(path).read_text(errors="replace"))
        except OSError:
            facts = None
    busbw = round(bus_bandwidth(nbytes, seconds, world), 3) if world > 1 and not failure else None
    mine = assess(facts, efa_expected=efa_expected, efa_devices=len(efa.pod), bus_bandwidth_gbps=busbw,
                  backend=backend, counters_delta=delta, nodes=nodes, efa_on_node=len(efa.node), failure=failure)
    if failure:
        # NCCL is down, so no collective can gather the ranks' views: each rank raises with its own.
        if require_efa and mine.transport == "none":
            raise require_efa_failure(mine, pinned_net=pinned)
        raise NetworkProbeError(f"network probe all-reduce failed: {mine.message}", mine)
    views: list[Any] = [None] * world
    dist.all_gather_object(views, mine.model_dump(mode="json"))
    health = _combine([NetworkHealth.model_validate(v) for v in views], mine)
    if require_efa and not meets_require_efa(health):
        raise require_efa_failure(health, pinned_net=pinned)
    return health


def _combine(views: list[NetworkHealth], mine: NetworkHealth) -> NetworkHealth:
    """Rank 0's view, made unhealthy (with that rank's reason) if any rank saw a problem."""
    bad = [(r, v) for r, v in enumerate(views) if v.healthy is False]
    base = views[0] if views else mine
    if not bad:
        return base
    rank, v = bad[0]
    transports = {x.transport for x in views}
    transport = base.transport if len(transports) == 1 else "mixed:" + ",".join(sorted(t or "?" for t in transports))
    return base.model_copy(update={"healthy": False, "transport": transport,
                                   "message": f"rank {rank}: {v.message}"})
