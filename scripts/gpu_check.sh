#!/usr/bin/env bash
# A run on a machine with one GPU, inside one 600 s command: what one GPU can check, most telling
# first, each step under its own timeout (they add up to 580 s), one log per step under $OUT (at
# most 6 files: the device tool returns 8). Every step in one call took 385 s on an H100 (2026-11-28),
# which leaves a task's 15 minutes room for a second, shorter call after a fix; or two calls:
#
#   call 1, about 2.5 minutes:  bash scripts/gpu_check.sh versions sidestream cuda
#   call 2, about 5 minutes:    bash scripts/gpu_check.sh versions gpt300m compile lora
#
# and, named only (not among "every step"), issue 67's figure in a call of its own:
#
#   call 3, at most 7 minutes:  bash scripts/gpu_check.sh versions longseq
#
#   versions   (30 s) the wheels the GPU image lacks (pydantic, hjson, typing-extensions, peft,
#              accelerate, ...) installed from $WHEELS (.whl, made on your own machine by
#              scripts/prepare_wheels.sh), their versions, torch's, CUDA's, NCCL's and the driver's;
#   sidestream (60 s) the hybrid second phase on the side stream, alone on the GPU: as NCCL orders
#              it, and with a synchronize after every wait (GPU review section 3), per-rank losses
#              and launch counters printed; the cuda step runs both again under load (-n 6);
#   cuda      (150 s) tests/test_cuda.py but for its timing tests, several at once (pytest-xdist):
#              parity at stages 0-3 in fp32 and bf16 on NCCL with every collective forced, ranks
#              sharing the GPU over gloo (plain, hybrid, the side stream), save/resume, one host
#              sync per step, offload, the allocator against memory_report(), the quantizers
#              against the CPU's bytes (int8 frozen decode too), LoRA with int8 frozen weights,
#              gathered() write-back, named_full_parameters with its host syncs, generate, Lightning,
#              Muon against torch's on the GPU, NVMe offload against CPU offload, Ulysses + tiled loss;
#   gpt300m   (120 s) a 303M-parameter GPT in bf16: DDP, FSDP2 and stage 3 alternating in one job
#              (step time, tokens/s), then each alone for torch.cuda.max_memory_allocated and,
#              for the engine, memory_report() (the dry run: the engine alone);
#   compile    (50 s) scripts/bench.py, engine3 against engine3+compile in one job (inductor's
#              first compile), with the recompiles logged;
#   lora      (170 s) scripts/bench_lora.py --device cuda: LoRA memory per process with 2 ranks
#              sharing the GPU (stage 0 against stage 3: exact, int8, replicate), then step time at
#              one rank beside DDP and FSDP2;
#   longseq   (400 s, only when named) scripts/longest_sequence.py: the longest sequence a Llama
#              built from config trains on the GPU (one rank, stage 3, bf16, within 16 GiB), plain
#              against tiled MLP and loss, with the step times (issue 67's GPU figure).
#
# The timing tests ("GPU lag", the hidden-sync detector) and the small-GPT benchmark passed on the
# H200 and owe no figure: they are not steps any more (run them with pytest -k "never_wait or
# far_ahead" and scripts/bench.py when a change asks for them).
#
# One GPU cannot show NCCL between ranks (a 1-rank collective is a local copy, and NCCL refuses
# two ranks on one GPU); the CPU suite's NCCL model (tests/test_nccl_model.py) checks that ordering.
#
#   bash scripts/gpu_check.sh [STEP ...]            # on the GPU machine: one `run` call, carrying .whl
#   bash scripts/gpu_check.sh --dry-run [STEP ...]  # here, on a CPU: each step's plumbing
#
# Steps named run alone (versions always runs first). --dry-run installs the wheels of $WHEELS (for
# this interpreter: the GPU's are for its Python), imports from them, collects each step's tests
# instead of running them (they need CUDA) and runs the benchmarks on the CPU with a tiny model.
# The last line says how many steps were reached and which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=gpu
if [[ "${1:-}" == "--dry-run" ]]; then mode=dry; shift; fi
wanted=("$@")
wheels=${WHEELS:-.whl}
out=${OUT:-runs/gpu_check}
work=runs/gpu_check_work  # benchmark JSON and tables (their content is printed into the step's log)
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
steps=0
failed=()

chosen() {  # STEP: whether to run it (all steps when none was named, but those run only when named)
    [[ ${#wanted[@]} -eq 0 && $1 != longseq ]] && return 0
    local name
    for name in "${wanted[@]}"; do [[ $name == "$1" ]] && return 0; done
    return 1
}

step() {  # NAME SECONDS COMMAND...: run under a timeout, logged to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    : > "$out/$name.log"  # a log of this run only (the exit line is appended after the command's)
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status" | tee -a "$out/$name.log"
    steps=$((steps + 1))
    if [[ $status -ne 0 ]]; then failed+=("$name"); fi
}

pytest_step() {  # NAME SECONDS SELECTION WORKERS: the CUDA tests, or (dry run) their collection only
    local name=$1 limit=$2 selection=$3 workers=$4
    local extra=()
    if [[ $mode == dry ]]; then
        extra=(--collect-only)
    else
        extra=(--durations=20)
        # A test that hangs fails with its stacks, and the step still reports every other one.
        if python3 -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout=$((limit - 20))); fi
        if [[ $workers -gt 1 ]] && python3 -c "import xdist" 2>/dev/null; then extra+=(-n "$workers"); fi
    fi
    step "$name" "$limit" python3 -m pytest -q -rA -p no:cacheprovider "${extra[@]}" tests/test_cuda.py -k "$selection"
}

bench() {  # NAME SECONDS BENCH-ARGS...: scripts/bench.py on one rank, its table and JSON into the log
    local name=$1 limit=$2
    shift 2
    local device=(--device cuda) model=()
    if [[ $mode == dry ]]; then device=(--device cpu); model=(--model tiny --steps 2 --warmup 1); fi
    rm -f "$work/$name"-*.json
    step "$name" "$limit" bash -c 'torchrun --standalone --nproc_per_node=1 scripts/bench.py "${@:2}"; status=$?
        cat "$1"-*.json 2>/dev/null; echo; exit $status' \
        bench "$work/$name" "${device[@]}" --force-collectives "$@" "${model[@]}" --out "$work/$name"
}

# versions: wheels, versions, the driver
shopt -s nullglob
found=("$wheels"/*.whl)
if [[ ${#found[@]} -eq 0 ]]; then
    echo "no wheels in $wheels: run scripts/prepare_wheels.sh first (it downloads them into .whl)"
    exit 2
fi
site=$(mktemp -d)
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step versions 30 bash -c 'python3 -m pip install -q --no-index --no-deps --target "$1" "${@:2}" && python3 - "$1" <<"PY"
import importlib, sys
site = sys.argv[1]
for name in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "hjson",
             "accelerate", "peft"):
    try:
        module = importlib.import_module(name)
    except ImportError as error:  # peft and accelerate serve the LoRA paths only: said, not fatal
        print(f"{name}: not importable ({error}); the LoRA tests and bench_lora.py will fail")
        continue
    version = getattr(module, "__version__", getattr(module, "VERSION", None))
    if version is None:
        import importlib.metadata
        version = importlib.metadata.version(name.replace("_", "-"))
    where = "the wheels" if module.__file__.startswith(site) else module.__file__
    print(f"{name} {version} from {where}")
    if name not in ("accelerate", "peft"):  # those two may come with the image
        assert module.__file__.startswith(site), f"{name} was not imported from the wheels"
import torch, zero_engine
print("zero_engine from", zero_engine.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())), "on", torch.cuda.get_device_name())
PY
[[ $0 == dry ]] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv' \
    "$mode" "$site" "${found[@]}"

if chosen sidestream; then
    pytest_step sidestream 60 "side_stream" 1
fi
if chosen cuda; then
    pytest_step cuda 150 "not never_wait and not far_ahead" 6
fi
if chosen gpt300m; then
    # Step times in one job, then torch.cuda.max_memory_allocated one system per job (--rss).
    step gpt300m 120 bash -c '
        if [[ $0 == dry ]]; then run="--device cpu --model tiny"; timed="--steps 1 --warmup 1"; alone="engine3"
        else run="--device cuda --model gpt300m"; timed="--steps 6 --warmup 2"; alone="ddp fsdp2 engine3"; fi
        run="torchrun --standalone --nproc_per_node=1 scripts/bench.py $run --force-collectives --dtype bf16 --micro-batch 8"
        rm -f $1-*.json
        $run $timed --systems ddp fsdp2 engine3 --out $1 || exit
        cat $1-*.json; echo
        for system in $alone; do $run --steps 2 --warmup 1 --rss --systems $system || exit; done' \
        "$mode" "$work/gpt300m"
fi
if chosen compile; then
    if [[ $mode == gpu ]]; then
        TORCH_LOGS=recompiles bench compile 50 --model small --steps 10 --warmup 3 --systems engine3 engine3+compile
    else  # inductor's first compile on a CPU takes minutes: the plumbing only
        bench compile 50 --systems engine3
    fi
fi
if chosen lora; then
    # Memory per process (2 ranks sharing the GPU over gloo), then step time at one rank.
    step lora 170 bash -c '
        if [[ $0 == dry ]]; then device=cpu; size="--layers 1"; only="stage 3 int8"; speed="--steps 3 --fsdp2"
            export BENCH_LORA_TINY=1  # a tiny Llama: the plumbing only
        else device=cuda; size="--layers 12"; only="bf16 base"; speed="--steps 10"; fi
        python3 scripts/bench_lora.py memory --device $device $size --only "$only" || exit
        torchrun --standalone --nproc_per_node=1 scripts/bench_lora.py speed --device $device $size $speed --dtype bf16 --int8' \
        "$mode"
fi

if chosen longseq; then
    # The longest sequence within 16 GiB, plain against tiled (the search stops trying after 300 s).
    step longseq 400 bash -c '
        if [[ $0 == dry ]]; then size="--device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 0"
            size="$size --vocab 512 --start 128 --max-tokens 512 --grain 64 --tiles 64"
        else size="--device cuda"; fi
        python3 scripts/longest_sequence.py $size' \
        "$mode"
fi

echo "== steps reached: $steps ($mode); failed: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
