"""Record DeepSpeed's own training of a grid of configs, for tests/test_deepspeed_traces.py.

DeepSpeed is never a dependency of zero_engine or of its CI: this script runs in a virtual
environment of its own, and what it writes (a few kB of JSON) is committed under
``tests/data/deepspeed_traces/``. The test replays every recorded config through zero_engine on
the same model, the same initial values and the same batches, and compares step by step: the
learning rate each optimizer step used (exactly) and the global loss (within a tolerance).

Set-up and the command that made the committed traces (CPU, gloo)::

    python -m venv ds && ds/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu ds/bin/pip install --no-build-isolation deepspeed==0.19.8 torch==2.13.0
    DS_ACCELERATOR=cpu ds/bin/torchrun --standalone --nproc_per_node=2 scripts/record_deepspeed_traces.py

The model is ordinary code with what a DeepSpeed user brings to stage 3: blocks in an
``nn.ModuleList`` that ``forward`` iterates, a parameter of the model itself, and an output head
that reuses the embedding's weight functionally (``F.linear(h, self.embed.weight)``). Nothing
here imports zero_engine or deepspeed at module level, so the test imports the model, the
batches and the grid from this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, DEPTH = 64, 32, 8, 2
MICRO, STEPS, WORLD_SIZE = 2, 6, 2
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = DATA / "deepspeed_traces"
DEFAULTS = DATA / "deepspeed_defaults.json"


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class TinyGPT(nn.Module):
    """Blocks in a ModuleList (iterated, never called), a root parameter, a tied functional head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(DIM)
        for module in self.modules():  # GPT-2's initialization
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.embed.weight)


def make_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def batch(step: int, micro_step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's token batch for one micro-step: the same on any engine."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro_step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator)


def inputs_and_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _case(name: str, stage: int, *, accum: int = 1, schedule: dict | None = None, **keys: Any) -> dict[str, Any]:
    """A DeepSpeed config as a user writes it: the keys not given take DeepSpeed's defaults
    (``gradient_clipping`` 1.0 among them)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **keys.pop("zero", {})},
        "dist_backend": "gloo",
        "steps_per_print": 1000,
    }
    if schedule is not None:
        config["scheduler"] = schedule
    config.update(keys)
    return {"name": name, "config": config, "resume_at": None}


WARMUP_LOG = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
WARMUP_LINEAR = {
    "type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                                   "warmup_type": "linear"},
}
WARMUP_DECAY = {
    "type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                                        "total_num_steps": 8},
}
WARMUP_COSINE = {
    "type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "warmup_num_steps": 2, "total_num_steps": 5,
                                         "cos_min_ratio": 0.05},
}
# Stage 3 with small units, none chosen by a wrap list: the size rule would pick the ModuleList
# (10,000 elements; each block has about 8,500), which is never called.
STAGE3_SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 10_000}
# Smaller still: the embedding is a unit of its own, so the head's F.linear reads a sharded weight
# after the embedding's forward ended (zero_engine gathers it there; DeepSpeed does too).
STAGE3_TINY_UNITS = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2_000}

GRID = [
    _case("stage0_warmup_log_default_clipping", 0, schedule=WARMUP_LOG),
    _case("stage1_warmup_linear_no_clipping", 1, schedule=WARMUP_LINEAR, gradient_clipping=0.0),
    _case("stage2_warmup_decay_clip_accumulation", 2, accum=2, schedule=WARMUP_DECAY, gradient_clipping=0.5),
    _case("stage3_cosine_default_clipping", 3, schedule=WARMUP_COSINE, zero=STAGE3_SMALL_UNITS),
    _case("stage3_warmup_decay_accumulation_no_clipping", 3, accum=2, schedule=WARMUP_DECAY, gradient_clipping=0.0,
          zero=STAGE3_SMALL_UNITS),
    _case("stage3_defaults_only", 3),
    _case("stage3_functional_head_tiny_units", 3, accum=2, schedule=WARMUP_LINEAR, zero=STAGE3_TINY_UNITS),
    _case("stage2_bf16_warmup_log", 2, schedule=WARMUP_LOG, bf16={"enabled": True}),
    # A loss scale of 2**20 overflows fp16 at the first steps: skipped steps, which do not
    # advance the schedule.
    _case("stage1_fp16_overflow_warmup_decay", 1, schedule=WARMUP_DECAY,
          fp16={"enabled": True, "initial_scale_power": 20, "hysteresis": 1}),
    {**_case("stage2_resume_warmup_decay", 2, schedule=WARMUP_DECAY), "resume_at": 3},
    {**_case("stage3_resume_cosine", 3, schedule=WARMUP_COSINE, zero=STAGE3_SMALL_UNITS), "resume_at": 3},
]


def _mean_over_ranks(value: float) -> float:
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _engine(deepspeed: Any, config: dict[str, Any]) -> Any:
    model = make_model()
    if config.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    elif config.get("fp16", {}).get("enabled"):
        model = model.half()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _steps(engine: Any, steps: range, rank: int, world_size: int, accum: int) -> tuple[list[float], list[float]]:
    lrs, losses = [], []
    for step in steps:
        lrs.append(float(engine.get_lr()[0]))
        window = 0.0
        for micro_step in range(accum):
            inputs, targets = inputs_and_targets(batch(step, micro_step, rank, world_size))
            loss = loss_of(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            window += loss.item() / accum
        losses.append(_mean_over_ranks(window))
    return lrs, losses


def record(case: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    config = case["config"]
    accum = config["gradient_accumulation_steps"]
    engine = _engine(deepspeed, config)
    resume = case["resume_at"]
    lrs, losses = _steps(engine, range(resume or STEPS), rank, world_size, accum)
    if resume is not None:
        directory = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(directory)
        engine.save_checkpoint(directory[0])
        engine = _engine(deepspeed, config)
        engine.load_checkpoint(directory[0])
        more_lrs, more_losses = _steps(engine, range(resume, STEPS), rank, world_size, accum)
        lrs, losses = lrs + more_lrs, losses + more_losses
    return {
        "name": case["name"], "config": config, "resume_at": resume, "lrs": lrs, "losses": losses,
        "skipped_steps": engine.skipped_steps,
    }


class _KeyRecorder(dict):
    """A config mapping that records every top-level key DeepSpeed's config reader asks for."""

    asked: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.asked.add(key)
        return super().__contains__(key)

    def keys(self) -> Any:
        recorder = self

        class Keys(list):
            def __contains__(self, key: Any) -> bool:
                recorder.asked.add(key)
                return list.__contains__(self, key)

        return Keys(super().keys())

    def __copy__(self) -> _KeyRecorder:
        return self


def _plain(value: Any) -> Any:
    """A default as JSON holds it (DeepSpeed's enums by value, dtypes and the like as text)."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value)


def record_defaults() -> dict[str, Any]:
    """DeepSpeed's top-level keys (those its config reader asks for) and the default of each key
    of its sections, by the key path a config file uses, for tests/test_deepspeed_defaults.py."""
    import inspect

    import deepspeed
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    _KeyRecorder.asked = set()
    config = DeepSpeedConfig(_KeyRecorder(train_micro_batch_size_per_gpu=1))
    defaults: dict[str, Any] = {
        key: _plain(getattr(config, attribute))
        for key, attribute in {
            "gradient_clipping": "gradient_clipping", "steps_per_print": "steps_per_print",
            "communication_data_type": "communication_data_type", "prescale_gradients": "prescale_gradients",
            "gradient_predivide_factor": "gradient_predivide_factor", "wall_clock_breakdown": "wall_clock_breakdown",
            "memory_breakdown": "memory_breakdown", "dump_state": "dump_state",
            "disable_allgather": "disable_allgather",
            "dataloader_drop_last": "dataloader_drop_last",
            "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
            "managed_gradient_accumulation": "managed_gradient_accumulation",
            "gradient_allreduce_op": "gradient_allreduce_op", "disable_python_gc": "disable_python_gc",
        }.items()
    }
    sections = {
        "zero_optimization": DeepSpeedZeroConfig, "zero_optimization.offload_optimizer":
        DeepSpeedZeroOffloadOptimizerConfig, "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
        "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
    }
    for prefix, model in sections.items():
        for name, field in model.model_fields.items():
            if field.is_required():
                continue
            default = field.get_default(call_default_factory=True)
            defaults[f"{prefix}.{field.alias or name}"] = _plain(default)
    adam = inspect.signature(FusedAdam.__init__).parameters
    for key in ("lr", "betas", "eps", "weight_decay"):
        defaults[f"optimizer.params.{key} (Adam, AdamW)"] = _plain(adam[key].default)
    return {
        "deepspeed": deepspeed.__version__,
        "top_level_keys": sorted(_KeyRecorder.asked),
        "defaults": dict(sorted(defaults.items())),
    }


def start_recording(description: str) -> argparse.Namespace:
    """What every recording script starts with: ``--only`` (the cases to record, by name),
    one torch thread, and DeepSpeed's gloo group of the world size the tests replay on."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", nargs="*", help="record these cases only (by name)")
    args = parser.parse_args()
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    if dist.get_world_size() != WORLD_SIZE:
        raise SystemExit(f"run with --nproc_per_node={WORLD_SIZE} (the test replays on {WORLD_SIZE} ranks)")
    return args


def main() -> None:
    args = start_recording(__doc__.split("\n")[0])
    import deepspeed
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    OUT.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not args.only:
        DEFAULTS.write_text(json.dumps(record_defaults(), indent=1) + "\n")
    for case in GRID:
        if args.only and case["name"] not in args.only:
            continue
        trace = record(case, rank, world_size)
        if rank == 0:
            trace["made_by"] = {
                "command": "DS_ACCELERATOR=cpu ds/bin/torchrun --standalone --nproc_per_node=2 "
                "scripts/record_deepspeed_traces.py",
                "deepspeed": deepspeed.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "accelerator": os.environ.get("DS_ACCELERATOR", ""),
            }
            path = OUT / f"{case['name']}.json"
            path.write_text(json.dumps(trace, indent=1) + "\n")
            print(f"{path.name}: lrs {trace['lrs']} losses {[round(x, 5) for x in trace['losses']]}", flush=True)
        dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
