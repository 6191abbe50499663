"""CPU runs that behave like GPU runs: `DeviceGuard` over training, save and load at every stage.

Under the guard the model's tensors stand for tensors on a GPU, so mixing them with host
tensors raises and every host sync is recorded. The engine must run a step, a save and a
load without mixing, with exactly one host sync per optimizer step (the packed used-mask and
norm read back) and none between boundaries. The two mistakes the first GPU review found are
put back to show the guard sees them: the used-mask concatenated on the host with the
norm on the device (raised), and Adam's ``step`` moved to the device at load (a host sync per
optimizer tensor per step).
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import decay_groups, make_model, micro_batch
from zero_engine.sharding.optimizer_side import optimizer_shard
from zero_engine.testing.device_guard import GUARDED_DEVICE, DeviceGuard, DeviceMistake, HostSync
from zero_engine.engine import Engine
from zero_engine.step import OptimizerStep, _sum_of_squares

MICRO, ACCUM = 2, 2
CASES = [
    {"stage": stage, "bf16": bf16} for stage, bf16 in itertools.product((0, 1, 2, 3), (False, True))
]


def _config(case: dict) -> dict:
    return engine_config(
        case["stage"], micro=MICRO, lr=0.05, accum=ACCUM, clip=0.5, dtype="bf16" if case["bf16"] else "fp32",
        reduce_bucket_size=40, stage3_param_persistence_threshold=0, shard_group_size=case.get("shard_group_size"),
    )


def _guarded_engine(guard: DeviceGuard, case: dict) -> Engine:
    model = make_model()
    guard.adopt(model)  # the model as if built on the GPU
    return zero_engine.initialize(model, _config(case), param_groups=decay_groups(model))


def _train(engine: Engine, guard: DeviceGuard, rank: int, world_size: int, steps: range) -> list[list[list[str]]]:
    """Per optimizer step, per micro-step: the host syncs it made."""
    per_step = []
    for step in steps:
        window = []
        for micro in range(ACCUM):
            tokens, targets = (t.to(engine.device) for t in micro_batch(step, micro, rank, world_size, MICRO, ACCUM))
            guard.take_syncs()
            engine.backward(engine(tokens, targets))
            engine.step()
            window.append([sync.what for sync in guard.take_syncs()])
        per_step.append(window)
    return per_step


def guarded_grid(rank: int, world_size: int, cases: list[dict], directory: str) -> list[dict]:
    results = []
    for index, case in enumerate(cases):
        default = torch.device(GUARDED_DEVICE) if case.get("default_device") else contextlib.nullcontext()
        with DeviceGuard() as guard, default:
            engine = _guarded_engine(guard, case)
            device = str(engine.device)
            before_save = _train(engine, guard, rank, world_size, range(2))
            engine.save_checkpoint(Path(directory) / str(index))
            engine.close()
            resumed = _guarded_engine(guard, case)
            resumed.load_checkpoint(Path(directory) / str(index))
            after_load = _train(resumed, guard, rank, world_size, range(2, 4))
            resumed.close()
        results.append({"device": device, "before_save": before_save, "after_load": after_load})
    return results


ONE_SYNC_PER_STEP = [[], ["Tensor.tolist"]]  # micro-step 1 off the boundary, micro-step 2 steps


def test_every_stage_trains_saves_and_loads_without_mixing_or_extra_syncs(tmp_path: Path) -> None:
    per_rank = run_on_ranks(2, guarded_grid, CASES, str(tmp_path), timeout=300)
    for rank, results in enumerate(per_rank):
        for case, result in zip(CASES, results):
            assert result["device"] == str(GUARDED_DEVICE), (rank, case)
            assert result["before_save"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)
            assert result["after_load"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)


DEFAULT_DEVICE_CASES = [
    {"stage": 1, "bf16": False, "default_device": True},
    {"stage": 3, "bf16": True, "default_device": True},
]


def test_control_tensors_stay_on_the_host_under_a_default_device(tmp_path: Path) -> None:
    """Under ``torch.set_default_device(<the GPU>)`` a factory without ``device=`` lands on the
    device: the agreements and the used-mask must name the host, or every stage 3 gather would
    sync the GPU (each agreement read back from the device)."""
    per_rank = run_on_ranks(2, guarded_grid, DEFAULT_DEVICE_CASES, str(tmp_path), timeout=300)
    for rank, results in enumerate(per_rank):
        for case, result in zip(DEFAULT_DEVICE_CASES, results):
            assert result["before_save"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)
            assert result["after_load"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)


HYBRID_CASES = [
    {"stage": 1, "bf16": False, "shard_group_size": 2},
    {"stage": 2, "bf16": True, "shard_group_size": 2},
    {"stage": 3, "bf16": True, "shard_group_size": 2},
]


def test_hybrid_sharding_neither_mixes_nor_syncs_more(tmp_path: Path) -> None:
    """4 ranks as 2 groups of 2: the two-phase reductions and the first-group-only norm run on
    device tensors and add no host sync."""
    per_rank = run_on_ranks(4, guarded_grid, HYBRID_CASES, str(tmp_path), timeout=300)
    for rank, results in enumerate(per_rank):
        for case, result in zip(HYBRID_CASES, results):
            assert result["before_save"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)
            assert result["after_load"] == [ONE_SYNC_PER_STEP] * 2, (rank, case, result)


# -- the guard sees the mistakes it was built for ------------------------------------------------


def _mask_concatenated_on_the_host(self: OptimizerStep, step_number: int) -> tuple[list[bool], float]:
    """The used-mask agreement as it was: the mask stays a host tensor."""
    squares = _sum_of_squares([self._shard_norm(unit) for unit in self.units], self.device)
    packed = torch.cat([self.reducer.used_mask(), squares.view(1)])
    self.comm.all_reduce_sum(packed).wait()
    *used, total = packed.tolist()
    return [count > 0 for count in used], total


def reintroduced_mistakes(rank: int, world_size: int, directory: str) -> dict:
    case = {"stage": 2, "bf16": False}
    out = {}
    original = OptimizerStep._agree_on_used_params_and_norm
    OptimizerStep._agree_on_used_params_and_norm = _mask_concatenated_on_the_host
    try:
        with DeviceGuard() as guard:
            engine = _guarded_engine(guard, case)
            try:
                _train(engine, guard, rank, world_size, range(1))
                out["mask"] = "not caught"
            except DeviceMistake as error:
                out["mask"] = str(error)
            engine.close()
    finally:
        OptimizerStep._agree_on_used_params_and_norm = original

    original_device = optimizer_shard.state_device
    optimizer_shard.state_device = lambda key, group, param: param.device  # `step` beside the parameter
    try:
        with DeviceGuard() as guard:
            engine = _guarded_engine(guard, case)
            _train(engine, guard, rank, world_size, range(1))
            engine.save_checkpoint(directory)
            engine.load_checkpoint(directory)
            out["step_syncs"] = _train(engine, guard, rank, world_size, range(1, 2))
            out["optimizer_tensors"] = sum(1 for state in engine.optimizer.state.values() if "step" in state)
            engine.close()
    finally:
        optimizer_shard.state_device = original_device
    return out


def test_the_guard_catches_a_host_mask_and_a_step_counter_on_the_device(tmp_path: Path) -> None:
    for out in run_on_ranks(2, reintroduced_mistakes, str(tmp_path), timeout=120):
        assert out["mask"].startswith("aten.cat.default mixes device tensors with host tensors"), out
        assert "_mask_concatenated_on_the_host" in out["mask"]  # names the line that mixed
        (off_boundary, boundary) = out["step_syncs"][0]
        assert off_boundary == []
        item_syncs = [what for what in boundary if what == "aten._local_scalar_dense.default"]
        assert len(item_syncs) >= out["optimizer_tensors"] > 0, out  # one per Adam step counter, at least


def test_the_guard_tags_moves_and_reads_back() -> None:
    """The rules on their own, in one process: device-ness follows values, moves and views."""
    linear = torch.nn.Linear(3, 3)
    with DeviceGuard() as guard:
        guard.adopt(linear)
        assert linear.weight.device == GUARDED_DEVICE and torch.zeros(2).device == torch.device("cpu")
        out = linear(torch.ones(2, 3).to(linear.weight.device))
        assert guard.on_device(out) and guard.on_device(out[0])  # computed from, and a view of, device tensors
        with pytest.raises(DeviceMistake, match="aten.addmm"):
            linear(torch.ones(2, 3))  # a batch left on the host
        assert guard.take_syncs() == []
        host = out.detach().cpu()
        assert not guard.on_device(host) and guard.on_device(out)  # a copy, though both are CPU memory
        out.sum().item()
        assert [sync.what for sync in guard.take_syncs()] == [
            "Tensor.cpu to the host",
            "aten._local_scalar_dense.default",
        ]
        assert guard.on_device(out.sum() * torch.tensor(2.0))  # a 0-dim host tensor is a scalar
        with pytest.raises(DeviceMistake, match="aten.mul"):
            torch.ones(2) * out.sum()  # a host vector is not
        assert all(isinstance(sync, HostSync) for sync in guard.syncs)


@pytest.mark.parametrize("name, attribute", [("device_guard", "DeviceGuard"), ("process_memory", "live_tensor_bytes")])
def test_the_old_module_names_still_import_with_a_deprecation_warning(name: str, attribute: str) -> None:
    """``zero_engine.device_guard`` and ``zero_engine.process_memory`` moved to
    ``zero_engine.testing``: the old names give the same objects and say where they went."""
    import importlib
    import sys

    sys.modules.pop(f"zero_engine.{name}", None)
    with pytest.warns(DeprecationWarning, match=rf"zero_engine.{name} moved to zero_engine.testing.{name}"):
        old = importlib.import_module(f"zero_engine.{name}")
    new = importlib.import_module(f"zero_engine.testing.{name}")
    assert getattr(old, attribute) is getattr(new, attribute)
