"""Peak host memory per rank while loading + sharding a model: every rank loads (before) vs rank 0 loads
and broadcasts the shards (`modelio.load_for_sharding` + `fill_sharded`, the runtime's path).

    .venv/bin/python benchmarks/bench_load_memory.py [--layers 8] [--hidden 1024] [--ranks 2]

A random Qwen2-architecture model (fp32, ~`12·L·H² + 2·V·H` parameters) is saved to a temp directory,
then each mode runs in fresh processes (gloo, CPU) that report their peak RSS (VmHWM) after sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def vm_hwm_mib() -> int:
    """Peak RSS of this process image (VmHWM; unlike ru_maxrss it does not inherit the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def worker(mode: str, rank: int, world: int, port: int, model_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from finetune_operator.api.spec import FSDPSpec, ModelSpec, ShardingStrategy
    from finetune_training import modelio
    from finetune_training.parallel import apply_fsdp, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    base = vm_hwm_mib()
    spec = ModelSpec(source=model_dir)
    fsdp = FSDPSpec(sharding_strategy=ShardingStrategy.full, activation_checkpointing=False)
    if mode == "every":
        model = modelio.load_model(spec, torch.float32)
        sd = None
        w = 1  # fill_sharded is a no-op: every rank already has the weights
    else:
        model, sd = modelio.load_for_sharding(spec, torch.float32, None, rank, world)
        w = world
    model = apply_fsdp(model, build_mesh(fsdp.sharding_strategy, world, world, "cpu"), fsdp, torch.float32, False)
    modelio.fill_sharded(model, sd, torch.device("cpu"), rank, w)
    del sd
    dist.barrier()
    peak = vm_hwm_mib()
    print(json.dumps({"mode": mode, "rank": rank, "peak_mib": peak, "import_mib": base}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]), int(a.worker[3]), a.worker[4])
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Qwen2Config(hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
                          num_attention_heads=a.hidden // 64, num_key_value_heads=2, vocab_size=32000,
                          tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
        n = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        print(f"model: {n / 1e6:.0f}M parameters, fp32 {n * 4 / 2**20:.0f} MiB; {a.ranks} ranks (gloo)")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}/operator:{ROOT}/training"}
        for mode in ("every", "once"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", mode, str(r), str(a.ranks), str(port), tmp],
                                      env=env, stdout=subprocess.PIPE, text=True) for r in range(a.ranks)]
            rows = [json.loads(pr.communicate()[0].strip().splitlines()[-1]) for pr in procs]
            label = "every rank loads" if mode == "every" else "rank 0 loads, broadcast"
            print(f"{label:>26}: peak RSS per rank " + ", ".join(
                f"rank{r['rank']} {r['peak_mib']} MiB (after imports {r['import_mib']})" for r in rows))
    del torch


if __name__ == "__main__":
    main()
