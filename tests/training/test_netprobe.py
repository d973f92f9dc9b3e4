"""Network probe: NCCL/aws-ofi-nccl logs (fixtures rebuilt from the upstream format strings, each naming the
source lines it follows), the verdict, requireEFA (who caught it), the debug file name, EFA devices and
counters on a sysfs tree shaped like a real one, busbw."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from finetune_operator.api.status import NetworkHealth
from finetune_training import netprobe as N

FIX = Path(__file__).parent / "fixtures" / "nccl"
E227, E229 = "nccl-2.27.7_ofi-1.16.3_efa.log", "nccl-2.29.7_ofi-1.17.3_efa.log"
OFI = "nccl-2.29.7_ofi-1.17.3_efa_net-ofi.log"
ONE_NODE = "nccl-2.29.7_ofi-1.17.3_single-node.log"
FB227, FB229 = "nccl-2.27.7_ofi-1.16.3_fallback-socket.log", "nccl-2.29.7_ofi-1.17.3_fallback-socket.log"
ABSENT, UNLOADABLE = "nccl-2.27.7_plugin-absent.log", "nccl-2.29.7_plugin-unloadable.log"
REQ227, REQ229 = "nccl-2.27.7_ofi-1.16.3_require-efa.log", "nccl-2.29.7_ofi-1.17.3_require-efa.log"
ALL = [E227, E229, OFI, ONE_NODE, FB227, FB229, ABSENT, UNLOADABLE, REQ227, REQ229]

# PyTorch's exception when NCCL init fails (pytorch/pytorch torch/csrc/distributed/c10d/NCCLUtils.hpp
# C10D_NCCL_CHECK "NCCL error in: <file>:<line>, " + ncclGetErrorWithVersion + "\n" + getNcclErrorDetailStr,
# NCCLUtils.cpp: "<ncclGetErrorString>, NCCL version <v>", "ncclInvalidUsage: This usually reflects invalid
# usage of NCCL library." + "\nLast error:\n" + ncclGetLastError); NCCL's ncclGetErrorString for
# ncclInvalidUsage is "invalid usage (run with NCCL_DEBUG=WARN for details)" (nccl v2.29.7 src/init.cc:3067)
# and its last error is the last WARN's text (src/debug.cc, ncclLastError).
TORCH_REFUSED = (
    "DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3701, invalid usage "
    "(run with NCCL_DEBUG=WARN for details), NCCL version 2.29.7\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
    "Failed to initialize any NET plugin"
)


def text(name: str) -> str:
    """A fixture's log lines (its `#` header, the provenance, removed)."""
    return "\n".join(ln for ln in (FIX / name).read_text().splitlines() if not ln.startswith("#"))


def facts(name: str) -> N.NcclLogFacts:
    return N.parse_nccl_log(text(name))


def health(name: str, *, efa_expected: bool = True, efa_devices: int = 1, nodes: int = 2,
           failure: str | None = None) -> NetworkHealth:
    return N.assess(facts(name), efa_expected=efa_expected, efa_devices=efa_devices, bus_bandwidth_gbps=3.2,
                    backend="nccl", nodes=nodes, efa_on_node=1, failure=failure)


@pytest.mark.parametrize("name", ALL)
def test_every_fixture_names_its_sources(name: str) -> None:
    header = [ln for ln in (FIX / name).read_text().splitlines() if ln.startswith("#")]
    head = "\n".join(header)
    version = name.split("_")[0].removeprefix("nccl-")
    assert f"NVIDIA/nccl v{version}-1 src/debug.cc:" in head and "Lines:" in head and "Scenario:" in head
    if "_ofi-" in name:
        assert f"aws/aws-ofi-nccl v{name.split('_ofi-')[1].split('_')[0]}" in head
    assert text(name).strip(), "no log lines"


@pytest.mark.parametrize(
    ("name", "transport", "provider", "nccl", "plugin", "selected", "nics"),
    [
        (E227, "efa", "efa", "2.27.7", "1.16.3", "Libfabric", 1),
        (E229, "efa", "efa", "2.29.7", "1.17.3", "Libfabric", 1),
        (OFI, "efa", "efa", "2.29.7", "1.17.3", "OFI", 4),
        (ONE_NODE, "efa", "efa", "2.29.7", "1.17.3", "Libfabric", 1),
        (FB227, "socket", None, "2.27.7", "1.16.3", "Socket", None),
        (FB229, "socket", None, "2.29.7", "1.17.3", "Socket", None),
        (ABSENT, "socket", None, "2.27.7", None, "Socket", None),
        (UNLOADABLE, "socket", None, "2.29.7", None, "Socket", None),
        (REQ227, "none", None, "2.27.7", "1.16.3", None, None),
        (REQ229, "none", None, "2.29.7", "1.17.3", None, None),
    ],
    ids=["efa-2.27", "efa-2.29", "efa-net-ofi", "single-node", "fallback-2.27", "fallback-2.29", "absent-2.27",
         "unloadable-2.29", "require-efa-2.27", "require-efa-2.29"],
)
def test_fixture_facts(name: str, transport: str, provider: str | None, nccl: str, plugin: str | None,
                       selected: str | None, nics: int | None) -> None:
    f = facts(name)
    assert (f.transport, f.provider, f.nccl_version, f.plugin_version, f.selected, f.nics) == (
        transport, provider, nccl, plugin, selected, nics)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (E227, None),  # its five "Failed to find ncclCollNetPlugin_vN symbol." lines are not a missing plugin
        (E229, None),
        (FB227, "aws-ofi-nccl 1.16.3 failed to initialise: no eligible libfabric provider"),
        (FB229, "aws-ofi-nccl 1.17.3 failed to initialise: no eligible libfabric provider"),
        (ABSENT, "aws-ofi-nccl plugin not found (NCCL looked for ofi libnccl-net-ofi.so)"),
        (UNLOADABLE, "not loadable: libnccl-net-ofi.so: libfabric.so.1: cannot open shared object file"),
        (REQ229, "aws-ofi-nccl 1.17.3 failed to initialise"),
    ],
    ids=["efa-2.27", "efa-2.29", "fallback-2.27", "fallback-2.29", "absent", "unloadable", "require-efa"],
)
def test_why_the_plugin_is_not_used(name: str, problem: str | None) -> None:
    got = facts(name).plugin_problem
    assert got is None if problem is None else problem in (got or "")


@pytest.mark.parametrize(
    ("name", "efa_expected", "devices", "nodes", "transport", "healthy", "says"),
    [
        (E227, True, 1, 2, "efa", True, "NCCL uses EFA via aws-ofi-nccl 1.16.3 (network Libfabric, fabric efa, 1 NIC(s)"),
        (E229, True, 1, 2, "efa", True, "NCCL uses EFA via aws-ofi-nccl 1.17.3"),
        (OFI, True, 4, 2, "efa", True, "network OFI, fabric efa, 4 NIC(s)"),
        (ONE_NODE, True, 1, 1, "intra-node", True, "single node: all channels intra-node"),
        (FB229, True, 0, 2, "socket", False, "EFA expected but NCCL uses socket; aws-ofi-nccl 1.17.3 failed"),
        (FB229, False, 0, 2, "socket", True, "NCCL uses network Socket; aws-ofi-nccl 1.17.3 failed to initialise"),
        (FB227, True, 0, 2, "socket", False, "no EFA device given to the pod (1 on the node)"),
        (ABSENT, True, 1, 2, "socket", False, "aws-ofi-nccl plugin not found"),
        (UNLOADABLE, True, 1, 2, "socket", False, "network plugin present but not loadable"),
        (REQ227, True, 0, 2, "none", False, "EFA expected but NCCL has no network"),
    ],
    ids=["efa-2.27", "efa-2.29", "efa-net-ofi", "single-node", "fallback-efa-expected", "fallback-efa-off",
         "fallback-2.27", "absent", "unloadable", "require-efa"],
)
def test_assess(name: str, efa_expected: bool, devices: int, nodes: int, transport: str, healthy: bool,
                says: str) -> None:
    h = health(name, efa_expected=efa_expected, efa_devices=devices, nodes=nodes)
    assert (h.transport, h.healthy) == (transport, healthy), h.message
    assert says in (h.message or "")
    assert h.nccl_version == facts(name).nccl_version and h.bus_bandwidth_g_bps == 3.2
    assert h.provider == ("efa" if transport in ("efa", "intra-node") else None)


def test_healthy_2_27_log_is_not_plugin_missing() -> None:
    f = facts(E227)
    assert (f.unsupported, f.not_found, f.unloadable, f.plugin_name, f.plugin_api) == (False, [], None, "Libfabric", 10)
    h = health(E227)
    assert h.healthy is True and "not found" not in (h.message or "") and "warning" not in (h.message or "")


def line(msg: str, level: str = "INFO") -> str:
    """One NCCL debug line (src/debug.cc prefix) around a message."""
    if level == "WARN":
        return f"\n[2026-12-02 17:40:03] h:1:1 [0] plugin/net.cc:326 NCCL WARN {msg}"
    return f"h:1:1 [0] NCCL INFO {msg}"


@pytest.mark.parametrize(
    ("lines", "transport", "provider", "selected"),
    [
        # a libfabric network without its provider line is not proven to be EFA, nor socket
        (["Using network Libfabric"], "unknown", None, "Libfabric"),
        # NCCL_NET="AWS Libfabric" renames the plugin (nccl_ofi_interface_nvidia.cpp); names may have spaces
        (["NET/Plugin: Loaded net plugin AWS Libfabric (v10)", "NET/OFI Initializing aws-ofi-nccl 1.16.3",
          "NET/OFI Selected provider is efa, fabric is efa (found 2 nics)",
          "Channel 00/0 : 7[3] -> 0[0] [receive] via NET/AWS Libfabric/1/GDRDMA"], "efa", "efa", "AWS Libfabric"),
        # aws-ofi-nccl up to v1.11 (v1.7.4-aws src/nccl_ofi_net.c:1069) and its old network name
        (["NET/OFI Selected Provider is efa (found 4 nics)", "Using network AWS Libfabric"], "efa", "efa",
         "AWS Libfabric"),
        (["NET/OFI Selected provider is tcp, fabric is 10.1.0.0/16 (found 1 nics)", "Assigned NET plugin Libfabric to comm"],
         "socket", "tcp", "Libfabric"),
        (["Channel 00/0 : 0[0] -> 4[0] [send] via NET/Socket/0(4)"], "socket", None, "Socket"),
        (["Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM"], "unknown", None, None),
        (["NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.1.0.5<0>", "Assigned NET plugin IB to comm"], "ib", None, "IB"),
        # 2.27 initialises Socket even when NCCL_NET refuses it: "Initialized" is not a choice
        (["Initialized NET plugin Socket", line("Failed to initialize any NET plugin", "WARN")], "none", None, None),
    ],
    ids=["libfabric-no-provider", "aws-libfabric-name", "older-provider-wording", "libfabric-tcp", "socket-channels",
         "intra-node-only", "ib", "initialized-is-not-assigned"],
)
def test_log_variants(lines: list[str], transport: str, provider: str | None, selected: str | None) -> None:
    f = N.parse_nccl_log("\n".join(ln if ln.startswith(("\n", "h:")) else line(ln) for ln in lines))
    assert (f.transport, f.provider, f.selected) == (transport, provider, selected)


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        # aws-ofi-nccl v1.14.0 src/nccl_ofi_rdma.c warned this before v1.15 lowered it to "No eligible providers"
        (["NET/Plugin: Loaded net plugin Libfabric (v9)", "NET/OFI Initializing aws-ofi-nccl 1.14.0",
          line("NET/OFI OFI fi_getinfo() call failed: No data available", "WARN"), "Using network Socket"],
         "aws-ofi-nccl 1.14.0 failed to initialise: no eligible libfabric provider"),
        # nccl v2.29.7 src/plugin/net.cc:99
        (["External network plugin /opt/x/libnccl-net.so is unsupported", "Using network Socket"],
         "exports no ncclNetPlugin version"),
        # nccl v2.27.7 src/plugin/net/net_v6.cc:144 etc., every net version missing
        ([f"NET/Plugin: Failed to find ncclNetPlugin_v{v} symbol." for v in (10, 9, 8, 7, 6)] + ["Using network Socket"],
         "exports no ncclNetPlugin version"),
        # nccl v2.27.7 src/plugin/plugin_open.cc:70 (2.27 prints the bare dlerror)
        (["NET/Plugin: /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so: undefined symbol: fi_getinfo",
          "Using network Socket"], "not loadable: /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so: undefined symbol"),
        # default NCCL_NET_PLUGIN (nccl v2.29.7 src/plugin/plugin_open.cc:73, :108)
        (["NET/Plugin: Could not find: libnccl-net.so", "Using network Socket"],
         "plugin not found (NCCL looked for libnccl-net.so)"),
    ],
    ids=["ofi-1.14-wording", "unsupported-2.28+", "unsupported-2.27", "undefined-symbol", "default-name-absent"],
)
def test_plugin_problems(lines: list[str], problem: str) -> None:
    f = N.parse_nccl_log("\n".join(ln if ln.startswith("\n") else line(ln) for ln in lines))
    assert f.transport == "socket" and problem in (f.plugin_problem or "")


def test_text_outside_the_nccl_line_format_is_ignored() -> None:
    # PyTorch's exception text and libfabric's own logger never reach the NCCL debug file; if such text is
    # around, it must not be read as NCCL's choice or failure.
    f = N.parse_nccl_log("libfabric:42:1701:efa:core:fi_getinfo_():1449<warn> fi_getinfo: provider efa returned -61\n"
                         + TORCH_REFUSED + "\nUsing network Socket")
    assert (f.transport, f.no_network, f.warnings) == ("unknown", False, [])
    assert f.nccl_version == "2.29.7"  # NCCL_DEBUG=VERSION prints the bare "NCCL version" line (init.cc:653)


# ------------------------------------------------------------------------------------------ requireEFA


def test_renderer_pins_the_plugins_network_name() -> None:
    from finetune_operator.api.validation import parse_job
    from finetune_operator.render.config import RenderConfig
    from finetune_operator.render.rayjob import render_rayjob

    from tests.builders import JobDoc

    job = parse_job(JobDoc().set("spec.network.requireEFA", True).obj())
    rj = render_rayjob(job, {"finetune_training/__init__.py": "# runtime\n"}, RenderConfig())
    worker = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    pinned = {e["name"]: e.get("value") for e in worker["env"]}["NCCL_NET"]
    assert pinned == N.PLUGIN_NETWORK and N.is_libfabric(pinned)
    # aws-ofi-nccl names its network exactly that unless NCCL_NET is "OFI" / "AWS Libfabric" (then those)
    assert facts(E229).plugin_name == pinned


@pytest.mark.parametrize("name", [REQ227, REQ229])
def test_require_efa_caught_by_nccl(name: str) -> None:
    h = health(name, efa_devices=0, failure=TORCH_REFUSED)
    assert h.transport == "none" and h.healthy is False
    e = N.require_efa_failure(h, pinned_net="Libfabric")
    assert str(e).startswith("network.requireEFA (caught by NCCL): NCCL_NET=Libfabric is pinned and NCCL refused")
    assert e.health is not None and e.health.healthy is False
    assert e.health.message is not None and e.health.message.startswith(N.CAUGHT_BY_NCCL)
    assert "aws-ofi-nccl" in e.health.message and "Failed to initialize any NET plugin" in e.health.message


def test_require_efa_caught_by_nccl_without_the_log() -> None:
    h = N.assess(None, efa_expected=True, efa_devices=0, bus_bandwidth_gbps=None, backend="nccl", failure=TORCH_REFUSED)
    assert h.transport == "none" and h.healthy is False
    assert "NCCL's last error: Failed to initialize any NET plugin" in (h.message or "")
    caught = N.require_efa_failure(h, pinned_net="Libfabric").health
    assert caught is not None and (caught.message or "").startswith(N.CAUGHT_BY_NCCL)


@pytest.mark.parametrize("name", [FB227, FB229, ABSENT, UNLOADABLE])
def test_require_efa_caught_by_the_probe(name: str) -> None:
    h = health(name, efa_devices=0)
    assert not N.meets_require_efa(h)
    e = N.require_efa_failure(h, pinned_net=None)
    assert str(e).startswith("network.requireEFA (caught by the probe): NCCL is not using EFA (transport socket")
    assert e.health is not None and (e.health.message or "").startswith(N.CAUGHT_BY_PROBE)


@pytest.mark.parametrize(
    ("transport", "provider", "met"),
    [("efa", "efa", True), ("intra-node", "efa", True), ("intra-node", None, False), ("socket", None, False),
     ("unknown", None, False), ("mixed:efa,socket", "efa", False)],
)
def test_meets_require_efa(transport: str, provider: str | None, met: bool) -> None:
    assert N.meets_require_efa(NetworkHealth(transport=transport, provider=provider)) is met


def test_single_node_meets_require_efa_only_on_efa() -> None:
    assert N.meets_require_efa(health(ONE_NODE, nodes=1))
    assert not N.meets_require_efa(health(FB229, nodes=1))


def test_status_reason_says_who_caught_it() -> None:
    from finetune_operator.controller.status import Observed
    from finetune_operator.controller.transitions import derive_status

    def reason(h: NetworkHealth) -> str:
        st = derive_status(generation=1, suspend=False, names={"rayJob": "j", "configMap": "c", "runtimeConfigMap": "r"},
                           prev={"network": h.model_dump(mode="json", by_alias=True, exclude_none=True)},
                           observed=Observed(), now="2026-12-02T10:00:00Z")
        return str(next(c for c in st["conditions"] if c["type"] == "NetworkHealthy")["reason"])

    by_nccl = N.require_efa_failure(health(REQ229, failure=TORCH_REFUSED), pinned_net="Libfabric").health
    by_probe = N.require_efa_failure(health(FB229), pinned_net=None).health
    assert by_nccl is not None and by_probe is not None
    assert (reason(by_nccl), reason(by_probe)) == ("EfaRequiredNcclRefused", "EfaRequiredProbeFailed")
    assert reason(health(E229)) == "Efa" and reason(health(ONE_NODE, nodes=1)) == "TransportIntraNode"


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (TORCH_REFUSED, "(NCCL found no usable network); NCCL's last error: Failed to initialize any NET plugin"),
        ("DistBackendError: NCCL error in: /pytorch/x.cpp:1, remote process exited or there was a network error, "
         "NCCL version 2.29.7", "(a peer exited or the network failed)"),
        ("DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
         "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", "(collective timed out)"),
    ],
    ids=["refused", "remote-error", "watchdog"],
)
def test_torch_error_summary(exc: str, says: str) -> None:
    assert says in N.torch_error_summary(exc)


# ---------------------------------------------------------------------------------- NCCL_DEBUG_FILE


@pytest.mark.parametrize(
    ("pattern", "host", "dashes", "path"),
    [
        ("/tmp/finetune-nccl.%h.%p.log", "ip-10-1-2-3.us-west-2.compute.internal", False, "/tmp/finetune-nccl.ip-10-1-2-3.42.log"),
        ("/tmp/finetune-nccl.%h.%p.log", "worker-0", True, "/tmp/finetune-nccl.worker-0.42.log"),
        ("/tmp/n%%.%h.%x.%p", "w", False, "/tmp/n%.w.%x.42"),
        ("/tmp/n.%p%", "w", True, "/tmp/n.42%"),
        ("/tmp/n.%h.log", "we%ird/host.domain", True, "/tmp/n.we-ird-host.log"),  # 2.29 getHostNameForLog
        ("/tmp/n.%h.log", "we%ird/host.domain", False, "/tmp/n.we%ird/host.log"),  # up to 2.28
    ],
    ids=["cut-at-dot", "plain", "percent-escapes", "trailing-percent", "2.29-dashes", "2.27-verbatim"],
)
def test_expand_nccl_debug_file(pattern: str, host: str, dashes: bool, path: str) -> None:
    assert N.expand_nccl_debug_file(pattern, host, 42, dashes=dashes) == path


@pytest.mark.parametrize("dashes", [True, False], ids=["2.29", "2.27"])
def test_find_nccl_debug_file(tmp_path: Path, dashes: bool) -> None:
    pattern = str(tmp_path / "nccl.%h.%p.log")
    host = "pod%1.cluster.local"
    assert N.find_nccl_debug_file(pattern, hostname=host, pid=7) is None
    written = tmp_path / ("nccl.pod-1.7.log" if dashes else "nccl.pod%1.7.log")
    written.write_text(line("Using network Socket"))
    assert N.find_nccl_debug_file(pattern, hostname=host, pid=7) == str(written)
    assert N.find_nccl_debug_file(pattern, hostname=host, pid=8) is None


# ------------------------------------------------------------------------------------ EFA devices


def sysfs(root: Path) -> tuple[Path, Path]:
    """/sys and /dev/infiniband as on an EFA node: class/infiniband/<dev> links into the PCI device tree,
    <dev>/device links to the PCI function, whose driver links to bus/pci/drivers/<driver> and which holds the
    infiniband_verbs/uverbsN the device plugin exposes. Two EFA devices (one given to the pod, one not) and an
    mlx5 NIC (given to the pod; not EFA)."""
    sys_, dev = root / "sys", root / "dev" / "infiniband"
    for drv in ("efa", "mlx5_core"):
        (sys_ / "bus" / "pci" / "drivers" / drv).mkdir(parents=True)
    (sys_ / "class" / "infiniband").mkdir(parents=True)
    dev.mkdir(parents=True)
    devices = [("rdmap16s27", "0000:10:1b.0", "efa", "uverbs0"), ("rdmap32s27", "0000:20:1b.0", "efa", "uverbs1"),
               ("mlx5_0", "0000:30:00.0", "mlx5_core", "uverbs2")]
    for name, pci, drv, verbs in devices:
        fn = sys_ / "devices" / "pci0000:00" / pci
        (fn / "infiniband_verbs" / verbs).mkdir(parents=True)
        (fn / "infiniband_verbs" / verbs / "ibdev").write_text(name + "\n")
        os.symlink(f"../../../bus/pci/drivers/{drv}", fn / "driver")
        ib = fn / "infiniband" / name
        (ib / "ports" / "1" / "hw_counters").mkdir(parents=True)
        os.symlink(f"../../../{pci}", ib / "device")
        os.symlink(f"../../devices/pci0000:00/{pci}/infiniband/{name}", sys_ / "class" / "infiniband" / name)
    for verbs in ("uverbs0", "uverbs2", "rdma_cm"):
        (dev / verbs).write_text("")  # character devices in a pod; plain files stand in for them
    counters = {
        # current driver (r2.17+): tx/rx, rdma read/write, retransmits; plus rdma-core's lifespan knob
        "rdmap16s27": {"tx_bytes": "1000", "rx_bytes": "250", "rdma_read_bytes": "4096", "rdma_write_bytes": "8192",
                       "retrans_timeout_events": "0", "lifespan": "12", "rx_drops": "n/a"},
        # not given to the pod: never read
        "rdmap32s27": {"tx_bytes": "777777", "rx_bytes": "777777"},
        "mlx5_0": {"out_of_buffer": "3", "rx_write_requests": "5"},
    }
    for name, values in counters.items():
        for k, v in values.items():
            (sys_ / "class" / "infiniband" / name / "ports" / "1" / "hw_counters" / k).write_text(v + "\n")
    return sys_ / "class" / "infiniband", dev


def test_efa_devices_follow_the_driver_link_and_the_pods_uverbs(tmp_path: Path) -> None:
    root, dev = sysfs(tmp_path)
    found = N.find_efa_devices(str(root), str(dev))
    assert found == N.EfaDevices(node=("rdmap16s27", "rdmap32s27"), pod=("rdmap16s27",))
    assert N.count_efa_devices(str(root), str(dev)) == 1
    assert N.count_efa_devices(str(root), str(tmp_path / "no-dev")) == 0  # no uverbs given: EFA unusable
    assert N.find_efa_devices(str(tmp_path / "missing"), str(dev)) == N.EfaDevices((), ())


def test_efa_counters_read_tolerantly(tmp_path: Path) -> None:
    root, dev = sysfs(tmp_path)
    before = N.read_efa_counters(N.find_efa_devices(str(root), str(dev)).pod, str(root))
    # rx_drops unreadable ("n/a") and lifespan not a traffic counter: left out; the other device not read
    assert before == {"tx_bytes": 1000, "rx_bytes": 250, "rdma_read_bytes": 4096, "rdma_write_bytes": 8192,
                      "retrans_timeout_events": 0}
    # an older driver (before r1.10.1) has only the basic counters
    (root / "rdmap16s27" / "ports" / "1" / "hw_counters" / "tx_bytes").write_text("5000\n")
    assert N.read_efa_counters(["rdmap32s27"], str(root)) == {"tx_bytes": 777777, "rx_bytes": 777777}
    delta = N.counters_delta(before, N.read_efa_counters(["rdmap16s27"], str(root)))
    assert delta["tx_bytes"] == 4000 and delta["rx_bytes"] == 0
    assert N.read_efa_counters(["gone"], str(root)) == {}


def test_counters_in_the_verdict() -> None:
    h = N.assess(facts(E229), efa_expected=True, efa_devices=1, bus_bandwidth_gbps=3.2, backend="nccl", nodes=2,
                 counters_delta={"tx_bytes": 64_000_000, "rx_bytes": 0, "retrans_timeout_events": 2})
    assert "tx +64.0 MB, rx +0.0 MB" in (h.message or "") and "2 EFA retransmit-timeout" in (h.message or "")
    idle = N.assess(facts(E229), efa_expected=True, efa_devices=1, bus_bandwidth_gbps=3.2, backend="nccl", nodes=2,
                    counters_delta={"tx_bytes": 0, "rx_bytes": 0})
    assert "no EFA traffic counted during the all-reduce" in (idle.message or "")


# ------------------------------------------------------------------------------------------ the rest


def test_assess_gloo_is_honest() -> None:
    h = N.assess(None, efa_expected=False, efa_devices=0, bus_bandwidth_gbps=0.4, backend="gloo")
    assert (h.transport, h.healthy, h.provider) == ("gloo", True, None)
    assert "gloo over TCP" in (h.message or "")
    assert N.assess(None, efa_expected=True, efa_devices=0, bus_bandwidth_gbps=None, backend="gloo").healthy is False


def test_bus_bandwidth_formula() -> None:
    # 1 GB in 0.5 s on 8 ranks: algbw 2 GB/s, busbw = 2 * 2*7/8 = 3.5 GB/s
    assert N.bus_bandwidth(10**9, 0.5, 8) == pytest.approx(3.5)
    assert N.bus_bandwidth(10**9, 0.5, 1) == 0.0


def test_combine_flags_any_unhealthy_rank() -> None:
    ok = NetworkHealth(transport="efa", healthy=True, message="fine")
    bad = NetworkHealth(transport="socket", healthy=False, message="EFA expected but NCCL uses socket")
    h = N._combine([ok, bad], ok)
    assert h.healthy is False and h.transport == "mixed:efa,socket" and (h.message or "").startswith("rank 1:")


def test_run_probe_on_cpu_reports_gloo_and_fails_fast_when_efa_is_required(process_group: None) -> None:
    import torch

    h = N.run_probe(torch.device("cpu"), efa_expected=False, require_efa=False, nodes=1)
    assert h.transport == "gloo" and h.healthy is True and h.bus_bandwidth_g_bps is None  # 1 rank: no busbw
    with pytest.raises(N.NetworkProbeError,
                       match=r"network.requireEFA \(caught by the probe\): NCCL is not using EFA \(transport gloo") as e:
        N.run_probe(torch.device("cpu"), efa_expected=True, require_efa=True, nodes=1)
    assert e.value.health is not None and e.value.health.healthy is False


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("nccl", "cuda", "nccl"),
        ("gloo", "cpu", "gloo"),
        # cpuOffload's process group: one backend per device type (FSDP2 reduces offloaded grads on CPU).
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
    ],
)
def test_backend_for_the_probe_device(backend: str, device: str, expected: str) -> None:
    assert N.backend_for(backend, device) == expected
