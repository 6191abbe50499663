"""LoRA fine-tuning on a frozen base (issue 53): memory as the process holds it, and step time.

A Hugging Face ``LlamaForCausalLM`` (118M parameters by default: hidden 768, 12 layers, vocab
32000) under PEFT's LoRA (r=8 on q_proj and v_proj), 2 CPU ranks.

    python scripts/bench_lora.py memory [--nproc 2] [--layers 12] [--only "bf16"]

Each case in a fresh ``torchrun`` (so one case's allocator state cannot hide another's): each
rank's resident set after ``initialize`` and after two steps, above the level before the model
was built, as a multiple of the model's bytes (its parameters as loaded: fp32, or bf16 for a bf16
base), with the engine's ``memory_report()`` beside it. Cases: stages 0 and 3, ``frozen_weights``
shard and replicate, an fp32 base and a bf16 base under ``bf16.enabled``, and a reference engine
(every weight frozen, no optimizer section's effect) at stages 0 and 3; with a bf16 base, int8
frozen weights too (``zero_quantized_nontrainable_weights``, sharded and replicated).

    torchrun --standalone --nproc_per_node=2 scripts/bench_lora.py speed [--steps 12] [--layers 12]
    torchrun --standalone --nproc_per_node=2 scripts/bench_lora.py speed --dtype bf16 --int8

Beside DeepSpeed 0.19.8 ZeRO-3 on the same jobs (its own venv, never a dependency here; see
scripts/record_deepspeed_traces.py for the install): ``--deepspeed`` adds its cases and system,

    DS_ACCELERATOR=cpu ds/bin/python scripts/bench_lora.py memory --deepspeed
    DS_ACCELERATOR=cpu ds/bin/torchrun --standalone --nproc_per_node=2 scripts/bench_lora.py speed --deepspeed

Step time in one job, steps alternating in a rotating order on the same batches (a barrier
before and after each): the engine at stage 3 (base
sharded), at stage 3 with ``frozen_weights: replicate``, and DDP with the base replicated;
medians and their ratios. Runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (set here for the memory
workers) so freed tensors leave the resident set at once.

On one GPU (GPU review K8), ``--device cuda``:

    python scripts/bench_lora.py memory --device cuda [--nproc 2] [--layers 12] [--only "bf16"]
    torchrun --standalone --nproc_per_node=1 scripts/bench_lora.py speed --device cuda --dtype bf16 --int8

memory: the ranks share the GPU over gloo (NCCL takes one GPU per rank), each measuring its own
``torch.cuda.max_memory_allocated`` (every process has its own allocator) and its allocated bytes
after ``initialize`` and after two steps, as multiples of the model's bytes. speed: one rank, the
engines with ``comm.force_collectives`` (their collectives issued at one rank, as DDP's and
FSDP2's are), beside DDP and FSDP2 (``fully_shard`` on each decoder layer and the root): what
the engine's machinery costs on a GPU, not sharding, which one rank cannot show.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MiB = 2**20
VOCAB, SEQ, MICRO = 32000, 64, 2

MEMORY_CASES = {  # name: (stage, base dtype, frozen_weights, trainable adapters)
    "stage 0, fp32 base": (0, "fp32", "shard", True),
    "stage 3, fp32 base": (3, "fp32", "shard", True),
    "stage 3 replicate, fp32 base": (3, "fp32", "replicate", True),
    "stage 0, bf16 base": (0, "bf16", "shard", True),
    "stage 3, bf16 base": (3, "bf16", "shard", True),
    "stage 3 replicate, bf16 base": (3, "bf16", "replicate", True),
    "stage 3 int8 frozen, bf16 base": (3, "bf16", "int8", True),
    "stage 3 replicate int8 frozen, bf16 base": (3, "bf16", "replicate int8", True),
    "reference, stage 0, fp32": (0, "fp32", "shard", False),
    "reference, stage 3, fp32": (3, "fp32", "shard", False),
    "reference, stage 3, bf16": (3, "bf16", "shard", False),
    "reference, stage 3, bf16 int8": (3, "bf16", "int8", False),
}
DEEPSPEED_CASES = {  # DeepSpeed ZeRO-3 on the same jobs (stage "ds")
    "DeepSpeed ZeRO-3, fp32 base": ("ds", "fp32", "shard", True),
    "DeepSpeed ZeRO-3, bf16 base": ("ds", "bf16", "shard", True),
    "DeepSpeed ZeRO-3 reference, bf16": ("ds", "bf16", "shard", False),
}


def lora_model(layers: int, dtype: str, trainable: bool) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny = os.environ.get("BENCH_LORA_TINY") == "1"  # the GPU kit's dry run: the plumbing, in seconds
    config = LlamaConfig(
        vocab_size=512 if tiny else VOCAB, hidden_size=64 if tiny else 768, intermediate_size=128 if tiny else 2048,
        num_hidden_layers=layers, num_attention_heads=4 if tiny else 12, num_key_value_heads=4 if tiny else 12,
        max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    if not trainable:
        model.requires_grad_(False)
    return model


def engine_config(stage: int, dtype: str, frozen_weights: str, force_collectives: bool = False) -> dict:
    """``frozen_weights``: "shard", "replicate", or either in int8 ("int8": sharded, kept and
    gathered in int8; "replicate int8": whole in int8: ``zero_quantized_nontrainable_weights``)."""
    int8 = frozen_weights in ("int8", "replicate int8")
    return {
        "comm": {"force_collectives": force_collectives},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {
            "stage": stage, "frozen_weights": "replicate" if "replicate" in frozen_weights else "shard",
            "zero_quantized_nontrainable_weights": int8,
        },
    }


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    vocab = 512 if os.environ.get("BENCH_LORA_TINY") == "1" else VOCAB
    return torch.randint(0, vocab, (MICRO, SEQ), generator=generator)


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_of(kind: str) -> torch.device:
    """The rank's device: the CPU, or (``cuda``) its GPU, made current (ranks beyond the GPUs
    share them)."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def held(device: torch.device) -> int:
    """What the process holds: its resident set on the CPU, the allocator's bytes on a GPU."""
    return resident() if device.type == "cpu" else torch.cuda.memory_allocated(device)


def deepspeed_config(dtype: str, trainable: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "dist_backend": "gloo",
        "steps_per_print": 10**9, "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": {"stage": 3},
    }
    if trainable:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return config


class DeepSpeedRun:
    """DeepSpeed ZeRO-3 over the LoRA model (frozen parameters partitioned too)."""

    def __init__(self, model: Any, dtype: str = "fp32", trainable: bool = True) -> None:
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad] or None
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=deepspeed_config(dtype, trainable))

    def __call__(self, **inputs: Any) -> Any:
        return self.engine(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self, ids: torch.Tensor | None = None) -> Any:
        if ids is None:
            return self.engine.step()
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def memory_report(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def memory_worker(case: str, layers: int, kind: str) -> None:
    import zero_engine

    stage, dtype, frozen_weights, trainable = {**MEMORY_CASES, **DEEPSPEED_CASES}[case]
    rank = int(os.environ["RANK"])
    device = device_of(kind)
    dist.init_process_group("gloo")  # ranks sharing one GPU too: NCCL takes a GPU per rank
    torch.set_num_threads(1)
    lora_model(1, dtype, trainable).to(device)  # imports and kernels paged in before the baseline
    gc.collect()
    before = held(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = lora_model(layers, dtype, trainable).to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if stage == "ds":
        engine = DeepSpeedRun(model, dtype, trainable)
    else:
        engine = zero_engine.initialize(model, engine_config(stage, dtype, frozen_weights))
    gc.collect()
    after_init = held(device) - before
    for step in range(2):
        ids = batch(step, rank).to(device)
        if trainable:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        else:
            with torch.no_grad():
                engine(input_ids=ids)
    gc.collect()
    after_steps = held(device) - before
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    report = engine.memory_report()
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {
        "rank": rank, "after_init": after_init / model_bytes, "after_steps": after_steps / model_bytes,
        "peak": None if peak is None else peak / model_bytes,
        "model_mib": model_bytes / MiB, "report": {k: v / MiB for k, v in report.items()},
    })
    if rank == 0:
        print("RESULT " + json.dumps({"case": case, "ranks": rows}))
    engine.close()
    dist.destroy_process_group()


def memory(args: argparse.Namespace) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    where = "resident set" if args.device == "cpu" else "torch.cuda allocated"
    print(f"Each rank's {where} above its level before the model, as a multiple of the model's bytes"
          + ("; peak: torch.cuda.max_memory_allocated" if args.device == "cuda" else ""))
    print("| case | model | rank: after initialize | rank: after 2 steps | "
          + ("rank: peak | " if args.device == "cuda" else "")
          + "report: parameters (frozen) | optimizer + masters + gradients |")
    print("|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else ""))
    cases = [*MEMORY_CASES, *(DEEPSPEED_CASES if args.deepspeed else ())]
    for case in [case for case in cases if not args.only or any(part in case for part in args.only)]:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
            "memory-worker", "--case", case, "--layers", str(args.layers), "--device", args.device,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{case}: the worker failed:\n{done.stderr[-3000:]}")
        out = done.stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
        ranks = result["ranks"]
        report = ranks[0]["report"]
        ours = "—" if not report else f"{report['parameters']:.1f} ({report['frozen_parameters']:.1f}) MiB"
        training = "—" if not report else (
            f"{report['optimizer_states'] + report['master_parameters'] + report['gradients']:.1f} MiB"
        )
        peaks = (" / ".join(f"{r['peak']:.2f}x" for r in ranks) + " | ") if args.device == "cuda" else ""
        print(
            f"| {case} | {ranks[0]['model_mib']:.0f} MiB | "
            + " / ".join(f"{r['after_init']:.2f}x" for r in ranks) + " | "
            + " / ".join(f"{r['after_steps']:.2f}x" for r in ranks) + f" | {peaks}{ours} | {training} |",
            flush=True,
        )


class DDPRun:
    """DDP over the LoRA model: the frozen base replicated, the adapters' gradients all-reduced."""

    def __init__(self, model: Any) -> None:
        self.model = torch.nn.parallel.DistributedDataParallel(model)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(self, ids: torch.Tensor) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class FSDP2Run(DDPRun):
    """PyTorch's FSDP2 over the LoRA model: ``fully_shard`` on each decoder layer and the root."""

    def __init__(self, model: Any, dtype: str) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = bf16 if dtype == "bf16" else None
        options = {"mp_policy": policy} if policy else {}
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, **options)
        self.model = fully_shard(model, **options)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


class EngineRun:
    def __init__(self, model: Any, config: dict) -> None:
        import zero_engine

        self.engine = zero_engine.initialize(model, config)

    def step(self, ids: torch.Tensor) -> float:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.frozen_received = self.engine.comm_report().get("all_gather_frozen", {}).get("received", 0)
        self.engine.step()
        return loss.item()


def speed(args: argparse.Namespace) -> None:
    device = device_of(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    dtype, force = args.dtype, device.type == "cuda"  # on a GPU: one rank, every collective issued

    def model() -> Any:
        return lora_model(args.layers, dtype, True).to(device)

    systems = {
        "stage 3": EngineRun(model(), engine_config(3, dtype, "shard", force)),
        "stage 3 replicate": EngineRun(model(), engine_config(3, dtype, "replicate", force)),
        "DDP": DDPRun(model()),
    }
    if device.type == "cuda" or args.fsdp2:
        systems["FSDP2"] = FSDP2Run(model(), dtype)
    if args.int8:
        systems["stage 3 int8 frozen"] = EngineRun(model(), engine_config(3, dtype, "int8", force))
        systems["stage 3 replicate, int8 frozen"] = EngineRun(model(), engine_config(3, dtype, "replicate int8", force))
    if args.deepspeed:
        systems["DeepSpeed ZeRO-3"] = DeepSpeedRun(model(), dtype)
    times: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(args.steps):
        ids = batch(step, rank).to(device)
        names = list(systems)
        for name in names[step % len(names):] + names[: step % len(names)]:  # a rotating order, the same batch
            system = systems[name]
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(system.step(ids))  # .item(): the step's end on a GPU too
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        warm = {name: values[2:] for name, values in times.items()}  # the first two steps page in
        medians = {name: statistics.median(values) for name, values in warm.items()}
        if device.type == "cuda":
            print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                  f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; {dist.get_world_size()} rank(s), {dtype}")
        print(f"{args.steps} steps, the first 2 left out; losses at the last step: "
              + ", ".join(f"{name} {values[-1]:.5f}" for name, values in losses.items()))
        print("| system | median step (ms) | against DDP | frozen weights gathered per step and rank (MiB) |")
        print("|---|---|---|---|")
        for name, median in medians.items():
            received = getattr(systems[name], "frozen_received", None)
            gathered = "—" if received is None else f"{received / MiB:.1f}"
            print(f"| {name} | {1000 * median:.0f} | {median / medians['DDP']:.3f}x | {gathered} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["memory", "speed", "memory-worker"])
    parser.add_argument("--case", choices=[*MEMORY_CASES, *DEEPSPEED_CASES])
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeed ZeRO-3 (run from its venv)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", nargs="*", help="memory: the cases whose names contain one of these")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="speed: the base's dtype")
    parser.add_argument("--int8", action="store_true", help="speed: add stage 3 with int8 frozen weights")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: see the module's docstring")
    parser.add_argument("--fsdp2", action="store_true", help="speed: add FSDP2 on the CPU too (always on a GPU)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.what == "memory":
        memory(args)
    elif args.what == "memory-worker":
        memory_worker(args.case, args.layers, args.device)
    else:
        speed(args)


if __name__ == "__main__":
    main()
