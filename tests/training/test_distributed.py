"""Two real ranks (gloo, FSDP2 on CPU) for what one rank cannot show: loading the weights once and
broadcasting them, gradient sync only on the last micro-batch, HSDP with uneven ranks per node, the
resume checkpoint chosen by rank 0 for every rank, and an S3 resume (from the session's S3 server) downloaded once per node. One pair of processes runs every check (tests/training/dist_worker.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..conftest import S3Bucket

WORKER = Path(__file__).with_name("dist_worker.py")


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, s3: S3Bucket) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FINETUNE_TEST_S3_URI": s3.uri("ckpt")}
    import os

    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), str(tiny_model_dir), str(out)],
                              env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        for name, v in r.items():
            assert "exception" not in v, f"{name}: {v.get('exception')}"
    return res


@pytest.mark.timeout(500)
def test_weights_loaded_once_and_broadcast_equal_a_plain_load(results: list[dict[str, Any]]) -> None:
    r0, r1 = results[0]["load_once"], results[1]["load_once"]
    assert (r0["on_meta"], r1["on_meta"]) == (False, True)  # rank 1 never held the weights
    for r in (r0, r1):
        assert r["same"] == r["keys"] and r["buffers_same"] and r["logits_equal"]
    print(f"peak host memory growth while loading+sharding: rank0 {r0['maxrss_load_kib']} KiB, "
          f"rank1 {r1['maxrss_load_kib']} KiB")


@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", ["hybrid", "none"])
def test_gradients_sync_only_on_the_last_micro_batch(results: list[dict[str, Any]], strategy: str) -> None:
    for r in results:
        g = r[f"sync_{strategy}"]
        assert g["max_abs_diff"] <= 1e-6 * max(1.0, g["max_abs_grad"]), g
        # Synced every micro-batch: one all-reduce per FSDP group and micro-batch; deferred: half as many.
        calls = g["all_reduce_calls"]
        assert calls["every"] > 0 and calls["deferred"] * 2 == calls["every"], calls


@pytest.mark.timeout(500)
def test_hybrid_with_uneven_ranks_per_node_fails_fast_on_every_rank(results: list[dict[str, Any]]) -> None:
    for r in results:
        err = r["uneven_hybrid"]["error"]
        assert err and err.startswith("training.fsdp.shardingStrategy: hybrid needs the same number of ranks")
        assert "[1, 2]" in err


@pytest.mark.timeout(500)
def test_every_rank_resumes_from_rank_0s_choice(results: list[dict[str, Any]]) -> None:
    """Issue 26.5(3): ranks that list shared storage independently can pick different checkpoints."""
    r0, r1 = results[0]["resume_agreement"], results[1]["resume_agreement"]
    assert r0["step"] == 4 and r0["uri"].endswith("view-rank0/checkpoint-step-00000004")
    assert r1 == r0, (r0, r1)  # rank 1 saw a step 6 and still takes rank 0's step 4
    assert r0["error"] and "refusing to restart at step 0" in r0["error"]
    assert r1["error"] == r0["error"]


@pytest.mark.timeout(500)
def test_s3_resume_downloads_once_per_node_and_cleans_up(results: list[dict[str, Any]]) -> None:
    r0, r1 = results[0]["s3_resume"], results[1]["s3_resume"]
    assert r0["copies"] == [True] and r1["copies"] == [False]  # local rank 0 copies, rank 1 reuses it
    assert r0["same"] and r1["same"] and r0["step"] == 1
    assert r0["staging_left"] == [] and r1["staging_left"] == []
