"""Record real DeepSpeed checkpoints, and DeepSpeed's own continuation from each, for
tests/test_deepspeed_checkpoints.py.

DeepSpeed is never a dependency of zero_engine or of its CI: this runs in a virtual environment
of its own (the recipe of ``scripts/record_deepspeed_traces.py``), and what it writes is
committed under ``tests/data/deepspeed_checkpoints/``: for each case, the directory DeepSpeed's
``save_checkpoint`` wrote after 3 steps (``latest``, ``global_step3/...``), and ``trace.json``
with the 3 steps that followed in the same run (the learning rate each used and the global
loss) and, in ``final.pt`` (tensors alone), the fp32 master weights after them (DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` of a second checkpoint). The test loads each
checkpoint into zero_engine at another stage and world size and must reproduce the rest.

    DS_ACCELERATOR=cpu ds/bin/torchrun --standalone --nproc_per_node=2 scripts/make_deepspeed_checkpoints.py

The model, the batches and the loss are the traces' (``record_deepspeed_traces.py``), with a
global batch of 6 rows per step (3 per rank here), so that 1, 2, 3 and 6 ranks can replay it.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_deepspeed_traces import SEQ, VOCAB, inputs_and_targets, loss_of, make_model, start_recording  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepspeed_checkpoints"
WORLD_SIZE, GLOBAL_ROWS, SAVE_AT, STEPS = 2, 6, 3, 6
SCHEDULE = {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2, "total_num_steps": 10},
}
SMALL_UNITS = {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 10_000}


def global_batch(step: int) -> torch.Tensor:
    """Every row of one optimizer step; rank r of W takes rows [r * 6/W, (r + 1) * 6/W)."""
    generator = torch.Generator().manual_seed(7_000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=generator)


def rows_of(step: int, rank: int, world_size: int) -> torch.Tensor:
    per_rank = GLOBAL_ROWS // world_size
    return global_batch(step)[rank * per_rank : (rank + 1) * per_rank]


def _case(name: str, stage: int, **keys: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // WORLD_SIZE,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": SCHEDULE,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **keys.pop("zero", {})},
        "dist_backend": "gloo",
        "steps_per_print": 1000,
    }
    config.update(keys)
    return {"name": name, "config": config}


# A LoRA-shaped run: the first block and the final norm frozen (DeepSpeed's ZeRO-3 partitions
# them and saves them as frozen_param_fragments), checkpointed twice at step 3: whole, and with
# exclude_frozen_parameters=True under excluded/ (the trainable state alone).
FROZEN = ["blocks.0", "norm"]

GRID = [
    _case("stage0_fp32", 0),
    _case("stage0_bf16", 0, bf16={"enabled": True}),
    _case("stage0_fp16", 0, fp16={"enabled": True, "initial_scale_power": 8}),
    _case("stage1_fp16", 1, fp16={"enabled": True, "initial_scale_power": 8}),
    _case("stage2_fp32", 2),
    _case("stage2_bf16", 2, bf16={"enabled": True}),
    _case("stage3_fp32", 3, zero=SMALL_UNITS),
    _case("stage3_bf16", 3, bf16={"enabled": True}, zero=SMALL_UNITS),
    {**_case("stage3_fp32_frozen", 3, zero=SMALL_UNITS), "frozen": FROZEN},
]


def freeze(model: torch.nn.Module, frozen: list[str]) -> torch.nn.Module:
    """Freeze the named submodules (as a fine-tuning run leaves its base)."""
    modules = dict(model.named_modules())
    for name in frozen:
        modules[name].requires_grad_(False)
    return model


def _engine(deepspeed: Any, config: dict[str, Any], frozen: list[str] = ()) -> Any:
    model = freeze(make_model(), list(frozen))
    if config.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    elif config.get("fp16", {}).get("enabled"):
        model = model.half()
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def _steps(engine: Any, steps: range, rank: int, world_size: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    lrs, losses = [], []
    for step in steps:
        lrs.append(float(engine.get_lr()[0]))
        inputs, targets = inputs_and_targets(rows_of(step, rank, world_size))
        loss = loss_of(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return lrs, losses


def _stage0_masters(engine: Any) -> dict[str, torch.Tensor]:
    """Without ZeRO: the module's values in fp32, or the fp32 masters of DeepSpeed's fp16/bf16
    wrapper (one flat buffer per group)."""
    optimizer = engine.optimizer
    if not hasattr(optimizer, "fp32_groups_flat"):
        return engine.module.state_dict()
    from torch._utils import _unflatten_dense_tensors

    names = {id(param): name for name, param in engine.module.named_parameters()}
    masters = {}
    for flat, params in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
        for param, value in zip(params, _unflatten_dense_tensors(flat, params)):
            masters[names[id(param)]] = value
    return masters


def record(case: dict[str, Any], rank: int, world_size: int) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    directory = OUT / case["name"]
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    dist.barrier()
    engine = _engine(deepspeed, case["config"], case.get("frozen", ()))
    first_lrs, first_losses = _steps(engine, range(SAVE_AT), rank, world_size)
    engine.save_checkpoint(str(directory), client_state={"epoch": 1, "note": "client state"})
    if case.get("frozen"):
        engine.save_checkpoint(
            str(directory / "excluded"), client_state={"epoch": 1, "note": "client state"}, exclude_frozen_parameters=True
        )
    if rank == 0:  # DeepSpeed copies its conversion scripts beside the checkpoint: not test data
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            for where in (directory, directory / "excluded"):
                (where / script).unlink(missing_ok=True)
    lrs, losses = _steps(engine, range(SAVE_AT, STEPS), rank, world_size)
    final = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(final)
    engine.save_checkpoint(final[0])
    dist.barrier()
    if rank == 0:
        if case["config"]["zero_optimization"]["stage"] == 0:
            state = _stage0_masters(engine)
        else:
            state = get_fp32_state_dict_from_zero_checkpoint(final[0])
        torch.save({k: v.detach().clone() for k, v in state.items()}, directory / "final.pt")  # plain tensors only
        shutil.rmtree(final[0])
        trace = {
            "config": case["config"], "frozen": case.get("frozen", []), "saved_at": SAVE_AT, "first_lrs": first_lrs, "first_losses": first_losses,
            "lrs": lrs, "losses": losses, "skipped_steps": engine.skipped_steps,
            "made_by": {
                "command": "DS_ACCELERATOR=cpu ds/bin/torchrun --standalone --nproc_per_node=2 "
                "scripts/make_deepspeed_checkpoints.py",
                "deepspeed": deepspeed.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "accelerator": os.environ.get("DS_ACCELERATOR", ""),
            },
        }
        (directory / "trace.json").write_text(json.dumps(trace, indent=1) + "\n")
        print(f"{case['name']}: lrs {lrs} losses {[round(x, 5) for x in losses]}", flush=True)
    dist.barrier()


# Overflow patterns (True: the step overflowed) and scaler settings for DeepSpeed's own
# DynamicLossScaler, recorded step by step into tests/data/deepspeed_loss_scale.json.
LOSS_SCALE_CASES = [
    {"init_scale": 2.0**4, "scale_window": 3, "min_scale": 2.0, "delayed_shift": 2, "consecutive_hysteresis": False,
     "overflows": [True, True] + [False] * 9 + [True] + [False] * 4 + [True] * 6},
    {"init_scale": 2.0**8, "scale_window": 2, "min_scale": 1.0, "delayed_shift": 1, "consecutive_hysteresis": False,
     "overflows": [False] * 7 + [True] + [False] * 5},
    {"init_scale": 2.0**6, "scale_window": 2, "min_scale": 1.0, "delayed_shift": 3, "consecutive_hysteresis": True,
     "overflows": [True, False, True, True, False, False, False, True, True, True, False, False, False]},
]


def record_loss_scale() -> dict[str, Any]:
    """DeepSpeed's DynamicLossScaler driven through each pattern: the scale and the hysteresis
    left after every update."""
    import deepspeed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    cases = []
    for case in LOSS_SCALE_CASES:
        scaler = DynamicLossScaler(
            init_scale=case["init_scale"], scale_window=case["scale_window"], min_scale=case["min_scale"],
            delayed_shift=case["delayed_shift"], consecutive_hysteresis=case["consecutive_hysteresis"],
            raise_error_at_min_scale=False,
        )
        after = []
        for overflow in case["overflows"]:
            scaler.update_scale(overflow)
            after.append({"scale": scaler.cur_scale, "hysteresis": scaler.cur_hysteresis})
        cases.append({**case, "after": after})
    return {"deepspeed": deepspeed.__version__, "cases": cases}


def main() -> None:
    args = start_recording(__doc__.split("\n")[0])
    import torch.distributed as dist

    if dist.get_rank() == 0 and not args.only:
        scales = OUT.parent / "deepspeed_loss_scale.json"
        scales.write_text(json.dumps(record_loss_scale(), indent=1) + "\n")
    for case in GRID:
        if not args.only or case["name"] in args.only:
            record(case, dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    main()
