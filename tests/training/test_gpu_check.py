"""benchmarks/gpu_check.sh --tiny: the GPU check's plumbing on CPU (tiny model over gloo), every variant.

The GPU figures themselves need a GPU machine; this proves the script, its variants (activation
checkpointing, old vs chunked loss, packing, cpuOffload) and the network probe run end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_check_tiny_runs_every_variant(tmp_path: Path) -> None:
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "MASTER_PORT": str(port)}
    env.pop("RANK", None)
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--tiny"], env=env, capture_output=True,
                       text=True, timeout=380)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "network probe: transport gloo" in out and "failed:" not in out, out[-4000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    kinds = {(r["activation_checkpointing"], r["loss"], r["pack"], r["offload"]) for r in results}
    assert kinds == {(False, "chunked", False, False), (True, "chunked", False, False), (False, "full", False, False),
                     (True, "chunked", True, False), (True, "chunked", False, True)}
    assert all(r["tokens_per_s"] > 0 and r["last_loss"] > 0 for r in results)
