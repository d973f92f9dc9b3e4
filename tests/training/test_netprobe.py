"""Network probe: NCCL log parsing (EFA, socket fallback, failure), the verdict, counters and busbw."""

from __future__ import annotations

from pathlib import Path

import pytest
from finetune_training import netprobe as N

FIX = Path(__file__).parent / "fixtures"


def facts(name: str) -> N.NcclLogFacts:
    return N.parse_nccl_log((FIX / name).read_text())


def test_efa_success_log() -> None:
    f = facts("nccl_efa_success.log")
    assert (f.transport, f.provider, f.fabric, f.nics) == ("efa", "efa", "efa", 1)
    assert (f.plugin_version, f.nccl_version, f.network) == ("1.13.2-aws", "2.21.5", "Libfabric")
    assert {"NET/Libfabric", "SHM"} <= f.via and f.inter_node is True
    assert not f.errors and not f.warnings


def test_socket_fallback_log() -> None:
    f = facts("nccl_socket_fallback.log")
    assert f.transport == "socket" and f.provider is None and f.plugin_version is None
    assert f.plugin_missing and f.ib_missing and "NET/Socket" in f.via


def test_failure_log() -> None:
    f = facts("nccl_efa_failure.log")
    assert f.plugin_version == "1.13.2-aws"
    assert len(f.warnings) == 3 and any("provider efa output empty list" in e for e in f.errors)
    assert any("Failed to initialize any NET plugin" in e for e in f.errors)
    assert any("unhandled system error" in e for e in f.errors)


@pytest.mark.parametrize(
    ("line", "transport", "provider"),
    [
        ("x [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)\nx NCCL INFO Using network AWS Libfabric",
         "efa", "efa"),
        ("x NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)\n"
         "x NCCL INFO Using network Libfabric", "socket", "tcp"),
        ("x NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0", "socket", None),
        ("x NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM", "unknown", None),
    ],
    ids=["older-efa-wording", "ofi-tcp-provider", "socket-channels-only", "intra-node-only"],
)
def test_log_variants(line: str, transport: str, provider: str | None) -> None:
    f = N.parse_nccl_log(line)
    assert (f.transport, f.provider) == (transport, provider)


@pytest.mark.parametrize(
    ("log", "efa_expected", "efa_devices", "transport", "healthy", "says"),
    [
        ("nccl_efa_success.log", True, 1, "efa", True, "NCCL uses EFA via aws-ofi-nccl 1.13.2-aws, 1 NIC(s)"),
        ("nccl_socket_fallback.log", True, 0, "socket", False, "EFA expected but NCCL uses socket"),
        ("nccl_socket_fallback.log", False, 0, "socket", True, "NCCL network: socket"),
        ("nccl_efa_failure.log", True, 1, "unknown", False, "NCCL errors"),
    ],
    ids=["efa-ok", "fallback-when-efa-expected", "socket-when-efa-off", "init-failure"],
)
def test_assess(log: str, efa_expected: bool, efa_devices: int, transport: str, healthy: bool, says: str) -> None:
    h = N.assess(facts(log), efa_expected=efa_expected, efa_devices=efa_devices, bus_bandwidth_gbps=3.2,
                 backend="nccl", nodes=2)
    assert (h.transport, h.healthy) == (transport, healthy)
    assert says in (h.message or "")
    assert h.bus_bandwidth_g_bps == 3.2


def test_assess_gloo_is_honest() -> None:
    h = N.assess(None, efa_expected=False, efa_devices=0, bus_bandwidth_gbps=0.4, backend="gloo")
    assert (h.transport, h.healthy, h.provider) == ("gloo", True, None)
    assert "gloo over TCP" in (h.message or "")
    assert N.assess(None, efa_expected=True, efa_devices=0, bus_bandwidth_gbps=None, backend="gloo").healthy is False


def test_efa_devices_and_counters(tmp_path: Path) -> None:
    for dev in ("rdmap16s27", "rdmap32s27"):
        c = tmp_path / dev / "ports" / "1" / "hw_counters"
        c.mkdir(parents=True)
        (c / "tx_bytes").write_text("1000\n")
        (c / "rx_bytes").write_text("250\n")
        (c / "lifespan").write_text("12\n")
    assert N.count_efa_devices(str(tmp_path)) == 2
    before = N.read_efa_counters(str(tmp_path))
    assert before == {"tx_bytes": 2000, "rx_bytes": 500}
    (tmp_path / "rdmap16s27" / "ports" / "1" / "hw_counters" / "tx_bytes").write_text("5000\n")
    assert N.counters_delta(before, N.read_efa_counters(str(tmp_path)))["tx_bytes"] == 4000
    assert N.count_efa_devices(str(tmp_path / "missing")) == 0


def test_bus_bandwidth_formula() -> None:
    # 1 GB in 0.5 s on 8 ranks: algbw 2 GB/s, busbw = 2 * 2*7/8 = 3.5 GB/s
    assert N.bus_bandwidth(10**9, 0.5, 8) == pytest.approx(3.5)
    assert N.bus_bandwidth(10**9, 0.5, 1) == 0.0


def test_combine_flags_any_unhealthy_rank() -> None:
    from finetune_operator.api.status import NetworkHealth

    ok = NetworkHealth(transport="efa", healthy=True, message="fine")
    bad = NetworkHealth(transport="socket", healthy=False, message="EFA expected but NCCL uses socket")
    h = N._combine([ok, bad], ok)
    assert h.healthy is False and h.transport == "mixed:efa,socket" and h.message.startswith("rank 1:")


def test_run_probe_on_cpu_reports_gloo_and_fails_fast_when_efa_is_required(process_group: None) -> None:
    import torch

    h = N.run_probe(torch.device("cpu"), efa_expected=False, require_efa=False, nodes=1)
    assert h.transport == "gloo" and h.healthy is True and h.bus_bandwidth_g_bps is None  # 1 rank: no busbw
    with pytest.raises(N.NetworkProbeError, match=r"network.requireEFA: NCCL is not using EFA \(transport gloo") as e:
        N.run_probe(torch.device("cpu"), efa_expected=True, require_efa=True, nodes=1)
    assert e.value.health is not None and e.value.health.healthy is False
