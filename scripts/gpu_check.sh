#!/usr/bin/env bash
# What the first machine with a GPU should run, in one go: the CUDA tests (NCCL at world size 1,
# ranks sharing the GPU over gloo, also as two groups of two with hybrid sharding, save/resume,
# the CUDA allocator against memory_report(), host syncs under torch's sync debug mode), then the
# main job on the GPU at stages 0 and 3.
# One GPU is enough. Put what it prints in docs/benchmarks.md ("On a GPU").
# At world size 1 the NCCL tests set comm.force_collectives, so a one-rank NCCL group runs every
# collective asynchronously. Still unchecked on one GPU (NCCL refuses two ranks on one GPU):
# NCCL between ranks (2 GPUs: stages 0-3, the float64 norm agreement, the streams' ordering of
# reduce-scatter and the step), and hybrid sharding on NCCL with its second phase started at
# once (4 GPUs as 2x2: groups made with new_group, cross-group all-reduces overlapping backward).
#
#   bash scripts/gpu_check.sh 2>&1 | tee gpu_check.log
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
python -m pytest -q -rA -p no:cacheprovider tests/test_cuda.py tests/test_device_guard.py
for config in configs/zero0.yaml configs/zero3.yaml configs/bf16_cosine.yaml; do
    echo "== main job on the GPU: $config"
    torchrun --standalone --nproc_per_node=1 scripts/train.py --config "$config" --model small --time-budget 60
done
