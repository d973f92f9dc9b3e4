"""What a real node may leave behind on this machine (processes, mounts, cgroups, links, sysctls, iptables
chains, files outside its root), as comparable values: taken before ``up`` and after ``down``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from finetune_devcluster import realnode


def host_snapshot(workdir: Path) -> dict[str, Any]:
    """What a real node may leave behind on this machine, as comparable values."""
    base = realnode.own_cgroup().lstrip("/")
    cgroups = set()
    for h in realnode.cgroup_hierarchies():
        top = h / base
        for dirpath, _, _ in os.walk(top):
            cgroups.add(str(Path(dirpath).relative_to(h.parent)))
    iptables = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    return {
        "links": sorted(realnode.links()),
        "mounts": realnode.mounts_under([workdir, Path("/run/containerd"), Path("/var/lib/kubelet")]),
        "cgroups": sorted(cgroups),
        "sysctls": realnode.sysctl_snapshot(),
        "outside": {p: os.path.lexists(p) for p in realnode.OUTSIDE_PATHS},
        "iptables_chains": sorted(
            line.split()[0]
            for line in iptables.splitlines()
            if line.startswith(":") and ("KUBE-" in line or "FINETUNE" in line)
        ),
        "processes": sorted(_node_processes(workdir)),
        "run_dirs": sorted(p.name for p in Path("/run").glob("ftnode-*")),
        "marker": realnode.MARKER.exists(),
    }


def _node_processes(workdir: Path) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(workdir) in cmd or "/run/ftnode-" in cmd or "containerd-shim" in cmd:
            out.append(cmd[:200])
    return out
