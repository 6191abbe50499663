"""Engine stages against torch's own data parallelism, side by side in ONE job.

    torchrun --nproc_per_node=2 scripts/bench.py --model small

Every system trains its own copy of the same GPT on the same batches; their steps alternate
(in a rotating order) so that the machine's noise hits all of them alike, and only ratios of
medians inside one job are reported. Baselines: DistributedDataParallel with AdamW, DDP
with torch's ZeroRedundancyOptimizer, and FSDP2 (``fully_shard`` on every Block, then the
root: the same units as the engine's stage 3). Writes JSON and a markdown table.

``--device cuda`` runs the same systems on this rank's GPU (``cuda:LOCAL_RANK``) over NCCL: the
same command gives GPU figures. ``--dtype bf16`` trains each system in its usual bf16 recipe: DDP
under ``torch.autocast``, FSDP2 with bf16 parameters and fp32 reductions
(``MixedPrecisionPolicy``), the engine with ``bf16.enabled`` (bf16 parameters, fp32 masters).

The JSON is rewritten after every timed step, so a run stopped early (a time limit) still
leaves each system's median over the steps done so far.

``--baseline REV`` loads the package as it was at git revision REV next to the current one, so
``base:engine3`` (that revision's stage 3) and ``engine3`` alternate in ONE job: a change's
speed-up is the ratio of their medians, without the noise between jobs. ``--profile N`` prints
the N functions with the most time of their own, per system, from rank 0's cProfile of the
timed steps (and writes them next to the table).

Peak RSS cannot be told apart between systems sharing a process, so ``--rss`` runs ONE system
per job and reports each rank's peak resident set above what it was before the model existed
(with ``--device cuda``: the peak of ``torch.cuda.max_memory_allocated`` above that level):

    for s in ddp fsdp2 engine3; do torchrun --nproc_per_node=2 scripts/bench.py --rss --systems $s; done
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS, decay_groups  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.1


class TorchSystem:
    """DDP with a torch optimizer (plain AdamW, or ZeroRedundancyOptimizer over AdamW); in bf16,
    fp32 parameters under ``torch.autocast``."""

    free_grads = False  # DDP keeps its gradient storage between steps
    autocast = False

    def __init__(self, model: nn.Module, sharded_optimizer: bool, bf16: bool = False) -> None:
        device = next(model.parameters()).device
        self.autocast = bf16
        self.model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        groups = decay_groups(model, WEIGHT_DECAY)
        if sharded_optimizer:
            self.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=LR)
        self.sharded = sharded_optimizer

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.model(tokens, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.free_grads)
        return loss.item()

    def memory(self) -> dict[str, int]:
        params = list(self.model.module.parameters())
        inner = self.optimizer.optim if self.sharded else self.optimizer
        return {
            "parameters": sum(_nbytes(p) for p in params),
            "gradients": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_states": sum(_nbytes(t) for s in inner.state.values() for t in s.values() if torch.is_tensor(t)),
        }

    def comm_bytes(self) -> int | None:
        return None  # not instrumented; theory: all-reduce 2(N-1)/N x gradient bytes (+ broadcasts for ZeRO)

    def inter_group_bytes(self) -> int | None:
        return None


class FSDP2System(TorchSystem):
    """PyTorch's FSDP2: ``fully_shard`` on each Block and on the root, AdamW on the DTensors.
    With ``shard_group_size`` G: HSDP, on a 2-D (replicate, shard) mesh of groups of G ranks."""

    free_grads = True  # as FSDP2's examples do

    def __init__(self, model: nn.Module, shard_group_size: int | None = None, bf16: bool = False) -> None:  # replaces DDP's set-up
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = None
        if shard_group_size:
            shape = (dist.get_world_size() // shard_group_size, shard_group_size)
            mesh = init_device_mesh(next(model.parameters()).device.type, shape, mesh_dim_names=("replicate", "shard"))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        options = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        for block in model.blocks:
            fully_shard(block, **options)
        self.model = fully_shard(model, **options)
        self.optimizer = torch.optim.AdamW(decay_groups(model, WEIGHT_DECAY), lr=LR)

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "parameters": sum(_nbytes(_local(p)) for p in params),
            "gradients": 0,  # freed by zero_grad(set_to_none=True); sharded (4Ψ/N) while they exist
            "optimizer_states": sum(
                _nbytes(_local(t)) for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
            ),
        }

    def comm_bytes(self) -> int | None:
        return None  # not instrumented; theory: 3 x parameter bytes x (N-1)/N


class EngineSystem:
    def __init__(
        self, model: nn.Module, stage: int, bucket: int, shard_group_size: int | None = None, offload: str = "",
        package: Any = zero_engine, force_collectives: bool = False, bf16: bool = False,
    ) -> None:
        offload, _, variant = offload.partition("-")
        compile_units, recompute, self.sequence = offload == "compile", offload == "recompute", offload == "sp"
        offload = "" if compile_units or recompute or self.sequence else offload
        fused = {"fused": False} if variant == "unfused" else {}
        config = {
            "train_micro_batch_size_per_gpu": 1,  # batches are handed in directly
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, **fused}},
            "gradient_clipping": 0.0,  # as the torch baselines (DeepSpeed's default would clip at 1.0)
            # The stage 3 keys are ignored below stage 3. Blocks are units, as FSDP2's above;
            # every parameter is sharded, as FSDP2 does.
            "zero_optimization": {
                "stage": stage, "reduce_bucket_size": bucket, "stage3_wrap_modules": ["Block"],
                "stage3_param_persistence_threshold": 0, "shard_group_size": shard_group_size,
                **({"recompute_units": True} if recompute else {}),  # a baseline may predate the key
                **OFFLOAD[offload],
            },
        }
        if force_collectives:  # only when asked: a baseline may predate the key
            config["comm"] = {"force_collectives": True}
        if bf16:
            config["bf16"] = {"enabled": True}
        if self.sequence:  # every rank one sequence group: the plain model's loop (`train_step`)
            config["sequence_parallel_size"] = dist.get_world_size()
            for block in model.blocks:
                block.core = package.SequenceParallelAttention(F.scaled_dot_product_attention)
        self.engine = package.initialize(model, config, param_groups=decay_groups(model))
        if compile_units:
            self.engine.compile()  # inductor, each Block's forward

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        if self.sequence:  # this rank's slice, global positions; the mean over equal slices made the whole's
            positions = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
            mine = [self.engine.sequence_slice(t) for t in (tokens, targets, positions)]
            loss = self.engine.sequence_loss(self.engine(*mine) / dist.get_world_size())
        else:
            loss = self.engine(tokens, targets)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def memory(self) -> dict[str, int]:
        report = self.engine.memory_report()
        keys = ("parameters", "gradients", "optimizer_states", "buffers", "peak_gradients", "peak_gathered_forward", "host")
        return {key: report[key] for key in keys}

    def comm_bytes(self) -> int | None:
        return self.engine.comm_report()["total"]["sent"]

    def inter_group_bytes(self) -> int | None:
        return self.engine.comm_report()["inter_group"]["sent"]


# ``engineS+compile``: engine.compile() (each Block's forward compiled by inductor);
# ``engineS+sp``: sequence_parallel_size = the world, each Block's attention core wrapped (every
# system then reads the same batches on every rank: one sequence group reads one);
# ``engineS+recompute``: zero_optimization.recompute_units (each Block recomputed in backward).
# ``engineS+X``: CPU offload of the optimizer (opt), the parameters (param, stage 3) or both;
# ``engineS+nvme``: the optimizer side on NVMe, in $BENCH_NVME_PATH (default /var/tmp);
# ``engineS+X-unfused``: the same with the optimizer's plain per-tensor loop instead of the fused
# CPU kernel offload picks (so the comparison with ``engineS`` isolates offload's bookkeeping).
_CPU = {"device": "cpu", "pin_memory": True}
_NVME = {"device": "nvme", "nvme_path": os.environ.get("BENCH_NVME_PATH", "/var/tmp")}  # a directory on a disk
OFFLOAD = {
    "": {}, "opt": {"offload_optimizer": _CPU}, "param": {"offload_param": _CPU},
    "both": {"offload_optimizer": _CPU, "offload_param": _CPU}, "nvme": {"offload_optimizer": _NVME},
}


def build_systems(
    names: list[str], model_config, bucket: int, device: torch.device, baseline: Any = None,
    force_collectives: bool = False, bf16: bool = False,
) -> dict[str, Callable]:
    """``ddp``, ``zero_redundancy``, ``fsdp2``, ``engineS`` (stage S), or ``engineS@B`` (bucket of B
    elements); ``/G`` after fsdp2 or an engine: hybrid sharding over groups of G ranks (HSDP);
    ``+opt``, ``+param``, ``+both``, ``+nvme`` after an engine: offload (`OFFLOAD`); ``+sp``: sequence
    parallel over every rank; ``base:`` before an engine: the ``--baseline`` revision's package.
    ``force_collectives``: the engines issue their collectives at world size 1 too
    (``comm.force_collectives``), as DDP and FSDP2 do, so a one-GPU comparison is not flattered.
    ``bf16``: each system's bf16 recipe (module docstring)."""
    systems = {}
    for name in names:
        torch.manual_seed(0)
        model = GPT(model_config).to(device)
        package = zero_engine
        if name.startswith("base:"):
            if baseline is None:
                raise SystemExit(f"{name!r} needs --baseline REV")
            package = baseline
        base, _, group = name.removeprefix("base:").partition("/")
        shard_group_size = int(group) if group else None
        if base in ("ddp", "zero_redundancy"):
            systems[name] = TorchSystem(model, sharded_optimizer=base == "zero_redundancy", bf16=bf16)
        elif base == "fsdp2":
            systems[name] = FSDP2System(model, shard_group_size, bf16)
        elif base.startswith("engine"):
            base, _, offload = base.partition("+")
            stage, _, size = base.removeprefix("engine").partition("@")
            bucket_size = int(float(size)) if size else bucket
            systems[name] = EngineSystem(
                model, int(stage), bucket_size, shard_group_size, offload, package, force_collectives, bf16
            )
        else:
            raise SystemExit(f"unknown system {name!r}: ddp, zero_redundancy, fsdp2[/G], engineS[@BUCKET][+OFFLOAD][/G]")
    return systems


def run(args: argparse.Namespace, out: Path | None = None) -> dict:
    """The alternating steps; with ``out`` (rank 0), the JSON so far after every timed step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model_config = PRESETS[args.model]
    device = _device(args.device)
    systems = build_systems(
        args.systems, model_config, args.bucket, device, load_baseline(args.baseline), args.force_collectives,
        args.dtype == "bf16",
    )
    data = TextBatches(load_corpus(), model_config.context)
    times: dict[str, list[float]] = {name: [] for name in systems}
    profiles = {name: cProfile.Profile() for name in systems} if args.profile and rank == 0 else {}
    losses: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    with torch.device("meta"):  # counted once, without building another model's values
        num_params = sum(p.numel() for p in GPT(model_config).parameters())
    one_group = any(name.endswith("+sp") for name in names)  # a sequence group reads one batch
    for step in range(args.warmup + args.steps):
        batch_rank, batch_ranks = (0, 1) if one_group else (rank, world)
        batch = [t.to(device) for t in data.rank_batch(step, 0, batch_rank, batch_ranks, args.micro_batch, 1)]
        rotation = names[step % len(names):] + names[: step % len(names)]
        for name in rotation:
            _synchronize(device)
            dist.barrier()
            profile = profiles.get(name) if step >= args.warmup else None
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            losses[name].append(systems[name].train_step(*batch))
            if profile is not None:
                profile.disable()
            _synchronize(device)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
        if step >= args.warmup and out is not None:
            write_result(out, summarize(args, systems, times, losses, model_config, num_params, final=False))
    result = summarize(args, systems, times, losses, model_config, num_params, final=True)
    result["profiles"] = {name: _top_functions(profile, args.profile, args.steps) for name, profile in profiles.items()}
    return result


def summarize(
    args: argparse.Namespace, systems: dict, times: dict[str, list[float]], losses: dict[str, list[float]],
    model_config: Any, num_params: int, final: bool,
) -> dict:
    """Each system's median step over the timed steps so far, against the reference's."""
    world = dist.get_world_size()
    reference = "ddp" if "ddp" in systems else next(iter(systems))
    ref_median = statistics.median(times[reference])
    tokens = args.micro_batch * model_config.context * world
    rows = {}
    for name, system in systems.items():
        median = statistics.median(times[name])
        rows[name] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "ratio_to_" + reference: median / ref_median,
            "max_loss_diff_vs_" + reference: max(abs(a - b) for a, b in zip(losses[name], losses[reference])),
            **system.memory(),
            "comm_bytes_per_step": system.comm_bytes(),
            "inter_group_bytes_per_step": system.inter_group_bytes(),
        }
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": _device_name(args.device),
        "num_params": num_params,
        "world_size": world,
        "backend": dist.get_backend(),
        "steps_timed": len(times[reference]),
        "complete": final,
        "micro_batch": args.micro_batch,
        "bucket": args.bucket,
        "theory_comm_bytes_per_step": round(2 * (world - 1) / world * 4 * num_params),
        "systems": rows,
    }


def write_result(out: Path, result: dict) -> None:
    """OUT-MODEL.json and .md, replaced whole (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(result, indent=2)), (".md", markdown(result))):
        partial = out.with_suffix(suffix + ".partial")
        partial.write_text(text)
        partial.replace(out.with_suffix(suffix))


def load_baseline(revision: str | None) -> Any:
    """The package as it was at git ``revision``, imported as ``zero_engine_baseline`` (its
    modules import each other relatively, so the copy runs beside the current package)."""
    if revision is None:
        return None
    root = Path(__file__).resolve().parent.parent
    target = Path(tempfile.mkdtemp(prefix="zero_engine_baseline_"))
    command = ["git", "-C", str(root), "archive", revision, "zero_engine"]
    archive = subprocess.run(command, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    (target / "zero_engine").rename(target / "zero_engine_baseline")
    sys.path.insert(0, str(target))
    return importlib.import_module("zero_engine_baseline")


def _top_functions(profile: cProfile.Profile, count: int, steps: int) -> str:
    """The ``count`` functions with the most time of their own, per step."""
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(count)
    return f"(cProfile of rank 0, {steps} timed steps: divide the times by {steps} for one step)\n" + out.getvalue()


def peak_rss(args: argparse.Namespace) -> dict:
    """One system alone: each rank's peak resident set (on CUDA: allocated device memory) above
    its level before the model."""
    (name,) = args.systems
    model_config = PRESETS[args.model]
    device = _device(args.device)
    data = TextBatches(load_corpus(), model_config.context)
    before = _peak_bytes(device)
    system = build_systems(
        [name], model_config, args.bucket, device, force_collectives=args.force_collectives, bf16=args.dtype == "bf16"
    )[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(args.warmup + args.steps):
        system.train_step(*[t.to(device) for t in data.rank_batch(step, 0, rank, world, args.micro_batch, 1)])
    grown = torch.tensor([_peak_bytes(device) - before], dtype=torch.int64, device=device)
    per_rank = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(per_rank, grown)
    result = {"model": args.model, "system": name, "dtype": args.dtype, "steps": args.warmup + args.steps,
              "device": device.type, "micro_batch": args.micro_batch,
              "peak_growth_bytes_per_rank": [int(t.item()) for t in per_rank]}
    if isinstance(system, EngineSystem):  # what the engine believes it holds, beside the allocator's peak
        result["memory_report"] = system.engine.memory_report()
    return result


def _device_name(kind: str) -> str:
    return _cuda_device_name() if kind == "cuda" else "cpu"


def _cuda_device_name() -> str:
    """CUDA only: the GPU's name, with torch's CUDA and NCCL versions."""
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl})"


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return _local_cuda_device()
    return torch.device("cpu")


def _local_cuda_device() -> torch.device:
    """CUDA only: this rank's GPU, set as the current device."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        _cuda_synchronize(device)


def _cuda_synchronize(device: torch.device) -> None:
    """CUDA only: the step's kernels are done before the clock is read."""
    torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int:
    return _cuda_max_allocated(device) if device.type == "cuda" else _max_rss_bytes()


def _cuda_max_allocated(device: torch.device) -> int:
    """CUDA only: the caching allocator's high-water mark of allocated bytes."""
    return torch.cuda.max_memory_allocated(device)


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def markdown(result: dict) -> str:
    ref = next(k for k in next(iter(result["systems"].values())) if k.startswith("ratio_to_"))
    lines = [
        f"{result['model']} GPT, {result['num_params'] / 1e6:.2f}M parameters, {result.get('dtype', 'fp32')}, "
        f"{result['world_size']} ranks ({result['backend']}, {result.get('device', 'cpu')}), micro-batch "
        f"{result['micro_batch']}, median of {result['steps_timed']} steps"
        f"{'' if result.get('complete', True) else ' (stopped early)'}; "
        f"theory for 2x parameter bytes x (N-1)/N: {result['theory_comm_bytes_per_step'] / 2**20:.2f} MiB/step "
        "(stages 0-2; stage 3 and FSDP2 move 3x)",
        "",
        f"| system | median step (ms) | tokens/s | {ref.replace('_', ' ')} | params MiB | grads MiB | optimizer MiB "
        "| comm buffers MiB | peak grads MiB | peak gathered params MiB | of these on the host MiB | comm MiB/step "
        "| across groups MiB/step | max loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["systems"].items():
        comm = _mib(row["comm_bytes_per_step"])
        loss_key = next(k for k in row if k.startswith("max_loss_diff"))
        extra = [_mib(row.get(key)) for key in ("buffers", "peak_gradients", "peak_gathered_forward", "host")]
        lines.append(
            f"| {name} | {row['median_step_s'] * 1e3:.1f} | {row.get('tokens_per_s', 0):.0f} | {row[ref]:.3f} "
            f"| {_mib(row['parameters'])} "
            f"| {_mib(row['gradients'])} | {_mib(row['optimizer_states'])} | {' | '.join(extra)} | {comm} "
            f"| {_mib(row['inter_group_bytes_per_step'])} | {row[loss_key]:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument(
        "--systems", nargs="+", default=["ddp", "engine0", "zero_redundancy", "engine1", "engine2", "fsdp2", "engine3"]
    )
    parser.add_argument("--steps", type=int, default=40, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--bucket", type=int, default=2_000_000, help="engine reduce_bucket_size (elements)")
    parser.add_argument("--out", default="runs/bench", help="writes OUT-MODEL.json and OUT-MODEL.md")
    parser.add_argument("--rss", action="store_true", help="peak RSS of the one system in --systems")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: this rank's GPU, NCCL")
    parser.add_argument("--baseline", help="git revision whose package the base:engineS systems run")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print each system's top N functions")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="bf16: each system's bf16 recipe")
    parser.add_argument(
        "--force-collectives", action="store_true",
        help="engines issue their collectives at world size 1 too (comm.force_collectives), as DDP and FSDP2 do",
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.rss:
        result = peak_rss(args)
        if dist.get_rank() == 0:
            print(json.dumps(result))
        dist.destroy_process_group()
        return
    out = Path(f"{args.out}-{args.model}") if dist.get_rank() == 0 else None
    result = run(args, out)
    if out is not None:
        write_result(out, result)
        print(markdown(result))
        if result["profiles"]:
            text = "\n".join(f"## {name}\n{profile}" for name, profile in result["profiles"].items())
            out.with_name(out.name + "-profile.txt").write_text(text)
            print(text)
    dist.destroy_process_group()


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f}"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


if __name__ == "__main__":
    main()
