"""FSDP2 bf16 throughput of the Qwen2.5-1.5B architecture: tokens/s, MFU, peak memory.

    .venv/bin/python benchmarks/bench_gpu_qwen.py                      # one GPU
    torchrun --nproc-per-node 4 benchmarks/bench_gpu_qwen.py           # all GPUs of a node
    .venv/bin/python benchmarks/bench_gpu_qwen.py --tiny               # CPU smoke test, same code path

The model is built from the published Qwen2.5-1.5B configuration (written out below: 28 layers, hidden
1536, 12 query / 2 KV heads of dim 128, intermediate 8960, vocab 151936, tied embeddings) with random
weights, so nothing is downloaded. It is wrapped exactly like the runtime does (`finetune_training.
parallel.apply_fsdp`: fully_shard per decoder layer and on the root, bf16 params with fp32 reductions,
fp32 master weights and AdamW), trained on random tokens with the runtime's loss
(`finetune_training.loss`), and measured in variants (`--variants`, `;`-separated `key=value,...`):
`ac` activation checkpointing, `compile` torch.compile per decoder layer, `loss=full` the old
full-logits loss (sliced, upcast) instead of the chunked one (peak memory before/after), `offload=1`
fsdp.cpuOffload (CPUOffloadPolicy; needs the `cpu:gloo,cuda:nccl` process group this script opens),
`pack=1` packed records (per-record position ids, micro-batch flattened to one row; flash-attention's
varlen kernel when `flash_attn` is importable, else SDPA with the block-diagonal mask), and `steps=N`.
`--probe` runs the runtime's network probe (`finetune_training.netprobe.run_probe`) first.

MFU = (6N + 12*L*H*Q*T) * tokens/s / (peak bf16 x GPUs); the peak comes from --peak-tflops, else the
GPU's name (H100/H200 989, A100 312, L4 121, A10G 70 TFLOP/s dense bf16). Without a GPU (and without
--tiny) it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    head_dim=128, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0}


def peak_for(device_name: str) -> float:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return 0.0


def run_variant(cfg_kw: dict[str, Any], *, ac: bool, compile_: bool, seq: int, micro: int, steps: int,
                warmup: int, device: Any, mesh: Any, world: int, peak: float, loss_kind: str = "chunked",
                offload: bool = False, pack: bool = False) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from finetune_operator.api.spec import FSDPSpec, ShardingStrategy
    from finetune_training import loss as L
    from finetune_training.data import Example, to_sequences
    from finetune_training.metrics import mfu, model_shape
    from finetune_training.parallel import apply_fsdp, decoder_layers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_gpu = device.type == "cuda"
    compute = torch.bfloat16 if on_gpu else torch.float32
    config = Qwen2Config(**cfg_kw)
    config.use_cache = False
    attn = "sdpa"
    if pack and on_gpu:
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
        except ImportError:
            pass
    config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config)  # fp32 master weights, like the runtime's dtype: auto
    shape = model_shape(model)
    if compile_:
        for layer in decoder_layers(model):
            layer.compile()
    fsdp = FSDPSpec(sharding_strategy=ShardingStrategy.full, activation_checkpointing=ac, cpu_offload=offload)
    model = apply_fsdp(model, mesh, fsdp, compute, on_gpu)
    if loss_kind == "full" and hasattr(model, L.METHOD):
        delattr(model, L.METHOD)  # the pre-fix loss: full logits, sliced and upcast
    if not on_gpu:
        model.to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=on_gpu and not offload)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    times = []
    loss_v = float("nan")
    for i in range(warmup + steps):
        ids = torch.randint(0, config.vocab_size, (micro, seq), generator=g)
        batch: dict[str, Any] = {"input_ids": ids}
        if pack:  # records of random length 64..seq/2 packed like the runtime packs them
            flat = ids.reshape(-1).tolist()
            lens = torch.randint(64, max(65, seq // 2), (len(flat) // 64,), generator=g).tolist()
            exs, at = [], 0
            for n in lens:
                if at >= len(flat):
                    break
                exs.append(Example(flat[at : at + n], flat[at : at + n]))
                at += n
            seqs = to_sequences(exs, seq, True, 0)
            batch = {"input_ids": seqs.input_ids[:micro].reshape(1, -1),
                     "position_ids": seqs.position_ids[:micro].reshape(1, -1)}
            labels = seqs.labels[:micro].reshape(1, -1)
        else:
            labels = ids
        batch = {k: v.to(device) for k, v in batch.items()}
        targets = L.shift_targets(labels).to(device)
        if on_gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if loss_kind == "full":
            logits = model(**batch, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels.to(device)[:, 1:].reshape(-1), ignore_index=L.IGNORE, reduction="sum")
            del logits
        else:
            loss = L.loss_sum(model, batch["input_ids"], targets, position_ids=batch.get("position_ids"))
        ntok = max(1, int((targets != L.IGNORE).sum()))
        (loss / ntok).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = float(loss.detach()) / ntok  # a sync point, as the runtime's loss all-reduce is
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    tps = micro * seq * world / step
    m = mfu(shape.flops_per_token(seq), tps, peak, world) if peak else None
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None
    del model, opt, loss
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return {"activation_checkpointing": ac, "compile": compile_, "loss": loss_kind, "offload": offload,
            "pack": pack, "attention": attn, "median_step_s": round(step, 4),
            "tokens_per_s": round(tps, 1), "mfu": round(m, 4) if m is not None else None,
            "peak_memory_gib": round(peak_mem, 2) if peak_mem is not None else None, "last_loss": round(loss_v, 3),
            "matmul_params": shape.non_embedding_params}


def probe(device: Any) -> dict[str, Any]:
    """The runtime's network probe on this node (NCCL init log parsed for the transport)."""
    from finetune_training.netprobe import run_probe

    h = run_probe(device, efa_expected=False, require_efa=False, nodes=1)
    return dict(h.wire())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny config on CPU (gloo): a smoke test of this script")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU (default: from the GPU's name)")
    p.add_argument("--variants", default="ac=0,compile=0;ac=1,compile=0;ac=0,compile=1;ac=1,compile=1;"
                   "ac=0,loss=full;ac=1,pack=1;ac=1,offload=1,steps=3")
    p.add_argument("--probe", action="store_true", help="run the runtime's network probe first")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    if not args.tiny and not torch.cuda.is_available():
        print("bench_gpu_qwen.py: no CUDA GPU visible (torch.cuda.is_available() is False). Run it on a GPU "
              "machine, or pass --tiny for the CPU smoke test.", file=sys.stderr)
        return 2
    on_gpu = not args.tiny
    if "RANK" not in os.environ:  # single process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if on_gpu:
        from finetune_training.netprobe import ensure_nccl_debug_file

        ensure_nccl_debug_file()  # the probe parses NCCL's init log for the transport
    # cpu:gloo next to NCCL: what the runtime opens with fsdp.cpuOffload (CPU-resident shards).
    dist.init_process_group("cpu:gloo,cuda:nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        name = "cpu"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    peak = args.peak_tflops if args.peak_tflops is not None else (peak_for(name) if on_gpu else 0.0)
    if args.probe:
        h = probe(device)
        if rank == 0:
            print(f"network probe: transport {h.get('transport')}, busbw {h.get('busBandwidthGBps')} GB/s, "
                  f"healthy {h.get('healthy')}: {h.get('message')}", flush=True)
    cfg = TINY if args.tiny else QWEN25_15B
    seq, micro = (min(args.seq, 128), min(args.micro_batch, 2)) if args.tiny else (args.seq, args.micro_batch)
    if rank == 0:
        print(f"{'tiny' if args.tiny else 'Qwen2.5-1.5B'} architecture, random weights; {world} x {name}; "
              f"FSDP2 full shard, {'bf16 params / fp32 reduce' if on_gpu else 'fp32 (CPU)'}; seq {seq}, "
              f"micro-batch {micro}/rank; {args.steps} timed steps after {args.warmup} warm-up; "
              f"peak {peak or 'n/a'} TFLOP/s per device", flush=True)
        print(f"{'AC':>3} {'compile':>7} {'loss':>7} {'offload':>7} {'pack':>4} {'attention':>17} {'step s':>8} "
              f"{'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'loss':>7}", flush=True)
    results = []
    for v in args.variants.split(";"):
        kv = dict(x.split("=") for x in v.split(","))
        ac, comp = kv.get("ac") == "1", kv.get("compile") == "1"
        steps = int(kv.get("steps", args.steps))
        try:
            r = run_variant(cfg, ac=ac, compile_=comp, seq=seq, micro=micro, steps=steps,
                            warmup=min(args.warmup, 1) if "steps" in kv else args.warmup, device=device, mesh=mesh,
                            world=world, peak=peak, loss_kind=kv.get("loss", "chunked"), offload=kv.get("offload") == "1",
                            pack=kv.get("pack") == "1")
        except Exception as e:
            r = {"activation_checkpointing": ac, "compile": comp, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            if on_gpu:
                torch.cuda.empty_cache()
        results.append(r)
        if rank == 0:
            if "error" in r:
                print(f"{int(ac):>3} {int(comp):>7}  {v}: failed: {r['error']}", flush=True)
            else:
                mfu_s = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "n/a"
                mem = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "n/a"
                print(f"{int(ac):>3} {int(comp):>7} {r['loss']:>7} {int(r['offload']):>7} {int(r['pack']):>4} "
                      f"{r['attention']:>17} {r['median_step_s']:>8.3f} {r['tokens_per_s']:>10,.0f} "
                      f"{mfu_s:>7} {mem:>9} {r['last_loss']:>7.3f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "world": world, "seq": seq, "micro_batch": micro, "results": results}, f,
                      indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
