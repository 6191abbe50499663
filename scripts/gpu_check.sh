#!/usr/bin/env bash
# The first run on a machine with one GPU, in under 9 minutes: what one GPU can check, most
# telling first, each step under its own timeout, every log under $OUT.
#
#   1. the wheels the GPU image lacks (pydantic, hjson, ...) installed from $WHEELS (.whl, made on
#      your own machine by ../shared/gpu/prepare_wheels.sh), and the versions;
#   2. the one-GPU NCCL tests with every collective forced: parity at stages 0-3 in fp32 and bf16,
#      save/resume excepted; one host sync per step; offload pinned; "GPU lag" (a sleep queued on
#      the GPU before each forward and backward: the host far ahead changes nothing); the
#      hidden-sync detector (the host reaches the end of backward before a queued GPU sleep ends,
#      at stages 2-3 and with offload pinned and pageable);
#   3. the CUDA allocator against memory_report();
#   4. Lightning on the GPU (a module built in __init__, moved by the strategy);
#   5. scripts/bench.py --device cuda --force-collectives: DDP, FSDP2 and the engine at stages 0, 2,
#      3, 3 + offload and 3 + compile (timings last: a timeout loses only them).
#
# One GPU cannot show NCCL between ranks (a 1-rank collective is a local copy); the CPU suite's
# NCCL model (tests/test_nccl_model.py) checks that ordering instead.
#
#   bash scripts/gpu_check.sh             # on the GPU machine: one `run` call, carrying .whl
#   bash scripts/gpu_check.sh --dry-run   # here, on a CPU: each step's plumbing, in about a minute
#
# --dry-run installs the wheels of $WHEELS (for this interpreter: the GPU's are for its Python),
# imports from them, collects each step's tests instead of running them (they need CUDA) and
# runs the benchmark on the CPU with a tiny model. The last line says how many steps were reached.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
if [[ "${1:-}" == "--dry-run" ]]; then mode=dry; fi
wheels=${WHEELS:-.whl}
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
steps=0
failed=()

step() {  # NAME SECONDS COMMAND...: run under a timeout, logged to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status"
    steps=$((steps + 1))
    if [[ $status -ne 0 ]]; then failed+=("$name"); fi
}

pytest_step() {  # NAME SECONDS -k SELECTION: the CUDA tests, or (dry run) their collection only
    local name=$1 limit=$2 selection=$3
    local collect=()
    if [[ $mode == dry ]]; then collect=(--collect-only); fi
    step "$name" "$limit" python3 -m pytest -q -rA -p no:cacheprovider "${collect[@]}" tests/test_cuda.py -k "$selection"
}

# 1. wheels and versions
shopt -s nullglob
found=("$wheels"/*.whl)
if [[ ${#found[@]} -eq 0 ]]; then
    echo "no wheels in $wheels: run ../shared/gpu/prepare_wheels.sh first (it downloads them into .whl)"
    exit 2
fi
site=$(mktemp -d)
step wheels 60 python3 -m pip install -q --no-index --no-deps --target "$site" "${found[@]}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step versions 60 python3 - "$site" <<'EOF'
import importlib, sys
site = sys.argv[1]
for name in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson"):
    module = importlib.import_module(name)
    where = "the wheels" if module.__file__.startswith(site) else module.__file__
    print(f"{name} {getattr(module, '__version__', getattr(module, 'VERSION', '?'))} from {where}")
    assert module.__file__.startswith(site), f"{name} was not imported from the wheels"
import torch, zero_engine
print("zero_engine from", zero_engine.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), "on", torch.cuda.get_device_name())
EOF
if [[ $mode == gpu ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi

# 2-4. the CUDA tests
pytest_step cuda_nccl 200 "one_gpu_on_nccl or one_host_sync or offload or far_ahead or never_wait"
pytest_step allocator 80 "allocator"
pytest_step lightning 60 "lightning"

# 5. timings, collectives forced at world size 1 as DDP and FSDP2 run theirs
if [[ $mode == gpu ]]; then
    TORCH_LOGS=recompiles step bench 150 torchrun --standalone --nproc_per_node=1 scripts/bench.py --device cuda \
        --force-collectives --model small --systems ddp fsdp2 engine0 engine2 engine3 engine3+opt engine3+compile \
        --steps 10 --warmup 3 --out "$out/bench"
else
    OMP_NUM_THREADS=1 step bench 150 torchrun --standalone --nproc_per_node=1 scripts/bench.py --device cpu \
        --force-collectives --model tiny --systems ddp fsdp2 engine3+opt --steps 2 --warmup 1 --out "$out/bench"
fi

echo "== steps reached: $steps of 6 ($mode); failed: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
