"""Start-up network health probe: which transport NCCL chose, EFA devices and counters, bus bandwidth.

The parsing (`parse_nccl_log`, `assess`) is pure and tested on sample logs; `run_probe` does the I/O in a
training worker: it times a short all-reduce (whose first call initialises NCCL and makes it log its
network choice), reads this process's NCCL debug file, counts `/sys/class/infiniband` devices, diffs the
EFA hardware counters, gathers every rank's view and decides. With requireEFA a fallback to sockets is a
`NetworkProbeError` on every rank, before any training step.

Log lines recognised (case-insensitive; aws-ofi-nccl and NCCL 2.1x-2.2x wording):
- EFA: `NET/OFI Initializing aws-ofi-nccl <ver>`, `NET/OFI Selected provider is efa, fabric is ... (found N
  nics)` (older `Selected Provider is efa`), `Using network Libfabric` (older `AWS Libfabric`),
  channels `via NET/Libfabric/<n>`.
- Socket fallback: `NET/Plugin: Could not find: libnccl-net...`/`No plugin found`, `NET/IB : No device
  found.`, `Using network Socket`, channels `via NET/Socket/<n>`.
- Failures: `NCCL WARN`, `unhandled system error`, `remote process exited or there was a network error`,
  `fi_getinfo: provider efa output empty list`, `Failed to initialize any NET plugin`, PyTorch's
  `Watchdog caught collective operation timeout`.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_operator.api.status import NetworkHealth

INFINIBAND_ROOT = "/sys/class/infiniband"
COUNTERS = ("tx_bytes", "rx_bytes", "rdma_read_bytes", "rdma_write_bytes", "rx_drops", "retrans_timeout_events")

_I = re.IGNORECASE
_RE_NCCL_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)", _I)
_RE_PLUGIN = re.compile(r"NET/OFI Initializing aws-ofi-nccl\s+(\S+)", _I)
_RE_PLUGIN_LOADED = re.compile(r"NET/Plugin:? (?:Loaded net plugin|Using) (\S+)", _I)
_RE_PROVIDER = re.compile(r"Selected provider is (\w[\w;-]*)(?:, fabric is (\S+?))?(?: \(found (\d+) nics\))?\s*$", _I)
_RE_NETWORK = re.compile(r"Using network (AWS Libfabric|Libfabric|Socket|IB|\S+)", _I)
_RE_VIA = re.compile(r"via (NET/\w+|P2P|SHM|direct shared memory|CollNet\w*)", _I)
_RE_NO_PLUGIN = re.compile(r"NET/Plugin ?: ?(Could not find|No plugin found|Failed to find)", _I)
_RE_NO_IB = re.compile(r"NET/IB ?: ?No device found", _I)
_FAILURES = [
    re.compile(p, _I)
    for p in (
        r"unhandled system error",
        r"remote process exited or there was a network error",
        r"fi_getinfo.*provider efa output empty list",
        r"Failed to initialize any NET plugin",
        r"Watchdog caught collective operation timeout",
        r"NCCL error",
    )
]
_RE_WARN = re.compile(r"NCCL WARN\s*(.*)$", _I)


class NetworkProbeError(RuntimeError):
    """The network is not what the spec requires (requireEFA and no EFA, or NCCL failed)."""

    def __init__(self, message: str, health: NetworkHealth | None = None) -> None:
        super().__init__(message)
        self.health = health


@dataclass
class NcclLogFacts:
    nccl_version: str | None = None
    plugin_version: str | None = None
    plugin_name: str | None = None
    provider: str | None = None
    fabric: str | None = None
    nics: int | None = None
    network: str | None = None  # "Libfabric", "Socket", "IB", ...
    via: set[str] = field(default_factory=set)  # "NET/Libfabric", "NET/Socket", "P2P", "SHM"
    plugin_missing: bool = False
    ib_missing: bool = False
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def transport(self) -> str:
        net = (self.network or "").lower()
        if "libfabric" in net or "NET/Libfabric" in self.via:
            return "efa" if (self.provider or "").lower().startswith("efa") else "socket"
        if net == "socket" or "NET/Socket" in self.via:
            return "socket"
        if net == "ib" or "NET/IB" in self.via:
            return "ib"
        return "unknown"

    @property
    def inter_node(self) -> bool | None:
        """Whether any channel goes over the network (None when no channel lines were logged)."""
        if not self.via:
            return None
        return any(v.startswith("NET/") or v.lower().startswith("collnet") for v in self.via)


def parse_nccl_log(text: str) -> NcclLogFacts:
    f = NcclLogFacts()
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line:
            continue
        if f.nccl_version is None and (m := _RE_NCCL_VERSION.search(line)):
            f.nccl_version = m.group(1)
        if m := _RE_PLUGIN.search(line):
            f.plugin_version = m.group(1)
        if m := _RE_PLUGIN_LOADED.search(line):
            f.plugin_name = m.group(1).rstrip(".")
        if m := _RE_PROVIDER.search(line):
            f.provider = m.group(1).lower()
            f.fabric = m.group(2)
            f.nics = int(m.group(3)) if m.group(3) else f.nics
        if m := _RE_NETWORK.search(line):
            net = m.group(1)
            f.network = "Libfabric" if "libfabric" in net.lower() else net
        for m in _RE_VIA.finditer(line):
            via = m.group(1)
            f.via.add("SHM" if via.lower() == "direct shared memory" else via)
        if _RE_NO_PLUGIN.search(line):
            f.plugin_missing = True
        if _RE_NO_IB.search(line):
            f.ib_missing = True
        if m := _RE_WARN.search(line):
            f.warnings.append(m.group(1).strip()[:300])
        if any(p.search(line) for p in _FAILURES):
            f.errors.append(line.strip()[-300:])
    return f


def assess(facts: NcclLogFacts | None, *, efa_expected: bool, efa_devices: int | None,
           bus_bandwidth_gbps: float | None, backend: str, counters_delta: dict[str, int] | None = None,
           nodes: int = 1) -> NetworkHealth:
    """Turn what the probe saw into the status' NetworkHealth."""
    if backend == "gloo":
        return NetworkHealth(
            transport="gloo", provider=None, efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
            healthy=not efa_expected,
            message=("CPU run: collectives use gloo over TCP; NCCL/EFA not in use"
                     + ("; EFA was requested but there are no GPUs" if efa_expected else "")),
        )
    if facts is None:
        return NetworkHealth(
            transport="unknown", efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
            healthy=None if not efa_expected else False,
            message="NCCL init log not captured (set network.ncclDebug: INFO); transport unknown",
        )
    transport = facts.transport
    notes: list[str] = []
    healthy = True
    if facts.errors:
        healthy = False
        notes.append(f"NCCL errors: {facts.errors[0]}")
    if efa_expected:
        if transport != "efa":
            healthy = False
            why = []
            if facts.plugin_missing:
                why.append("aws-ofi-nccl plugin not found")
            if facts.provider and facts.provider != "efa":
                why.append(f"libfabric provider {facts.provider}")
            if not efa_devices:
                why.append("no EFA devices in the pod")
            notes.append(f"EFA expected but NCCL uses {transport}" + (f" ({', '.join(why)})" if why else ""))
        elif not efa_devices:
            notes.append("NCCL selected efa but no devices under /sys/class/infiniband were seen")
    else:
        notes.append(f"NCCL network: {transport}" + (f" (provider {facts.provider})" if facts.provider else ""))
    if transport == "efa":
        notes.insert(0, f"NCCL uses EFA via aws-ofi-nccl {facts.plugin_version or '?'}"
                        + (f", {facts.nics} NIC(s)" if facts.nics else ""))
    if facts.inter_node is False and nodes <= 1:
        notes.append("all channels intra-node (P2P/SHM)")
    if counters_delta:
        tx, rx = counters_delta.get("tx_bytes", 0), counters_delta.get("rx_bytes", 0)
        notes.append(f"EFA counters during probe: tx +{tx / 1e6:.1f} MB, rx +{rx / 1e6:.1f} MB")
        if efa_expected and transport == "efa" and nodes > 1 and tx + rx == 0:
            notes.append("no EFA traffic counted during the all-reduce")
    if facts.warnings and healthy:
        notes.append(f"{len(facts.warnings)} NCCL warning(s): {facts.warnings[0]}")
    return NetworkHealth(
        transport=transport, provider=facts.provider, plugin_version=facts.plugin_version,
        nccl_version=facts.nccl_version, efa_devices=efa_devices, bus_bandwidth_g_bps=bus_bandwidth_gbps,
        healthy=healthy, message="; ".join(notes)[:1000] or None,
    )


# ------------------------------------------------------------------------------------------- I/O


def count_efa_devices(root: str = INFINIBAND_ROOT) -> int:
    try:
        return sum(1 for p in Path(root).iterdir())
    except OSError:
        return 0


def read_efa_counters(root: str = INFINIBAND_ROOT) -> dict[str, int]:
    """Sum of each hw counter over all devices and ports."""
    total: dict[str, int] = {}
    for path in glob.glob(os.path.join(root, "*", "ports", "*", "hw_counters", "*")):
        name = os.path.basename(path)
        if name not in COUNTERS:
            continue
        try:
            total[name] = total.get(name, 0) + int(Path(path).read_text().strip() or 0)
        except (OSError, ValueError):
            continue
    return total


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}


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


def _nccl_log_path(pattern: str) -> str:
    host = socket.gethostname()
    return pattern.replace("%h", host).replace("%p", str(os.getpid()))


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


def run_probe(device: Any, *, efa_expected: bool, require_efa: bool, nodes: int) -> NetworkHealth:
    """Collective over all ranks. Raises NetworkProbeError on every rank if requireEFA is violated."""
    import torch.distributed as dist

    backend = dist.get_backend()
    world = dist.get_world_size()
    log_pattern = os.environ.get("NCCL_DEBUG_FILE") if backend == "nccl" else None
    efa_devices = count_efa_devices()
    before = read_efa_counters()
    nbytes = 64 << 20 if device.type == "cuda" else 8 << 20
    error: str | None = None
    seconds = 0.0
    try:
        seconds = time_allreduce(nbytes, device)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    delta = counters_delta(before, read_efa_counters()) if before else None
    facts: NcclLogFacts | None = None
    if log_pattern:
        path = _nccl_log_path(log_pattern)
        try:
            facts = parse_nccl_log(Path(path).read_text(errors="replace"))
        except OSError:
            facts = None
    if error:
        raise NetworkProbeError(f"network probe all-reduce failed: {error}")
    busbw = round(bus_bandwidth(nbytes, seconds, world), 3) if world > 1 else None
    mine = assess(facts, efa_expected=efa_expected, efa_devices=efa_devices, bus_bandwidth_gbps=busbw,
                  backend=backend, counters_delta=delta, nodes=nodes)
    views: list[Any] = [None] * world
    dist.all_gather_object(views, mine.model_dump(mode="json"))
    health = _combine([NetworkHealth.model_validate(v) for v in views], mine)
    if require_efa and health.transport != "efa":
        raise NetworkProbeError(
            "network.requireEFA: NCCL is not using EFA "
            f"(transport {health.transport}, provider {health.provider or 'none'}): {health.message}. "
            "Check the vpc.amazonaws.com/efa resource, FI_PROVIDER=efa, NCCL_NET_PLUGIN and the aws-ofi-nccl "
            "plugin in the image.",
            health,
        )
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
