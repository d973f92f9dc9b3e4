#!/usr/bin/env bash
# The GPU check of the training runtime, for a machine with one or more NVIDIA GPUs (H200, L4, ...):
# nothing is downloaded (random-weight Qwen2.5-1.5B architecture), target < 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh            # GPU: all GPUs of this node (torchrun), bf16
#   bash benchmarks/gpu_check.sh --tiny     # CPU: tiny config over gloo, proves the plumbing (tests run it)
#
# Prints: the devices; the runtime's network probe on this node (NCCL transport: nvlink/p2p/shm within
# a node, never EFA; reported as NCCL's init log says); then per variant FSDP2 tokens/s, MFU and peak
# memory: without/with activation checkpointing and torch.compile, the old full-logits loss next to the
# chunked one (loss memory), packed records (varlen flash-attention when flash_attn is importable), and a
# cpuOffload step (cpu:gloo,cuda:nccl process group). JSON lands in ${OUT:-/tmp}/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/operator:$PWD/training${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
if [ "${1:-}" = "--tiny" ]; then
  echo "== gpu_check --tiny: CPU plumbing run (tiny model, gloo); no GPU figures =="
  OMP_NUM_THREADS=1 timeout 300 "$PY" benchmarks/bench_gpu_qwen.py --tiny --probe --steps 2 --warmup 1 \
    --variants "ac=0,compile=0;ac=1,compile=0;ac=0,loss=full;ac=1,pack=1;ac=1,offload=1,steps=1" \
    --json "$OUT/gpu_check.json"
  rc=$?
else
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi -L failed); use --tiny for the CPU plumbing run" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -12 || true
  ngpu=$(nvidia-smi -L | wc -l)
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  "$PY" -c 'import flash_attn; print("flash_attn", flash_attn.__version__)' 2>/dev/null || echo "flash_attn: not installed (packed runs use SDPA with the block-diagonal mask)"
  export NCCL_DEBUG=INFO NCCL_DEBUG_FILE=$OUT/gpu_check-nccl.%h.%p.log
  # Every variant is bounded; the whole script stays under 8 minutes on one H200 (about 5 expected).
  timeout 450 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" benchmarks/bench_gpu_qwen.py \
    --probe --seq 2048 --micro-batch 4 --steps 8 --warmup 2 --json "$OUT/gpu_check.json"
  rc=$?
  echo "-- NCCL transport lines (first rank's init log):"
  grep -hE "via (P2P|SHM|NET|NVLS)|Using network|NCCL version|nvlink|NVLink" $OUT/gpu_check-nccl.*.log 2>/dev/null | head -8 \
    || echo "(no NCCL init log: with one GPU NCCL opens no channel, so there is no transport to report)"
fi
echo "== gpu_check done in $(( $(date +%s) - start ))s, exit $rc =="
exit $rc
