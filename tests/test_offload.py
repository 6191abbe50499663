"""CPU offload (``offload_optimizer`` / ``offload_param``): the same training as one process,
what stays on the device, how often the host waits, checkpoints across offload settings.

CPU runs stand in for GPU runs through `DeviceGuard`: the model is adopted as device tensors,
so offloaded state must be host tensors, mixing the two raises, every host sync is recorded,
the host may not touch a gradient copy before waiting for it, and the device's live bytes are
read from the storages that exist.
"""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import TrapModel, decay_groups, make_model, micro_batch, train_engine, train_reference
from resume_cases import FIRST, GLOBAL_BATCH, SECOND, global_means, resume_jobs
from resume_cases import LR as CKPT_LR
from precision_cases import (
    EPS, LR, MICRO, STEPS, check_precision, check_skipped_everywhere, overflow_on_one_rank, precision_config,
)
from zero_engine import offload
from zero_engine.cli import main as cli_main
from zero_engine.engine import Engine
from zero_engine.errors import ConfigError
from zero_engine.memory import estimate_from_config
from zero_engine.devices import HOST
from zero_engine.testing.device_guard import DeviceGuard, DeviceMistake
from zero_engine.testing.process_memory import live_tensor_bytes
from zero_engine.sharding.gathering.agreement import PassKind, make_row

OPTIMIZER = {"offload_optimizer": {"device": "cpu"}}
PARAMS = {"offload_param": {"device": "cpu"}}
BOTH = {**OPTIMIZER, **PARAMS}
SETTINGS = {"optimizer": OPTIMIZER, "param": PARAMS, "both": BOTH}


# -- the same training as one process -----------------------------------------------------------


def _model(case: dict) -> tuple[TrapModel, dict | None]:
    """The model, eager or (``meta``) built on the meta device with the eager one's values as
    ``weights=``."""
    if not case.get("meta"):
        return make_model(), None
    weights = make_model().state_dict()
    with torch.device("meta"):
        return TrapModel(), weights


def offload_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        if case.get("overflow"):
            results.append(overflow_on_one_rank(rank, world_size, case["stage"], zero=case["zero"]))
            continue
        model, weights = _model(case)
        engine = zero_engine.initialize(model, precision_config(case), param_groups=decay_groups(model), weights=weights)
        windows, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"])
        results.append({
            "losses": [sum(window) / len(window) for window in windows], "norms": norms,
            "state": engine.full_state_dict(), "skipped": engine.skipped_steps, "memory": engine.memory_report(),
        })
        engine.close()
    return results


def _check_grid(cases: list[dict], world_size: int, per_rank: list[list[dict]]) -> None:
    for index, case in enumerate(cases):
        results = [r[index] for r in per_rank]
        if case.get("overflow"):
            for rank, result in enumerate(results):
                check_skipped_everywhere(rank, result)
            continue
        check_precision(case, world_size, results)  # fp32 within 2e-5 of one process; bf16 within its precision
        for result in results:
            assert result["memory"]["host"] > 0, case


def _case(stage: int, setting: str, dtype: str, accum: int, **more) -> dict:
    return {"stage": stage, "dtype": dtype, "accum": accum, "clip": 1.0, "zero": SETTINGS[setting], **more}


CI_CASES = [
    _case(1, "optimizer", "bf16", 3),
    _case(2, "optimizer", "fp32", 1, clip=0.0),
    _case(3, "both", "bf16", 3),
    _case(3, "param", "fp32", 1),
    _case(3, "both", "fp32", 2, meta=True),
    {"stage": 2, "overflow": True, "zero": OPTIMIZER},
]
FULL_CASES = [
    _case(stage, setting, dtype, accum)
    for stage, setting, dtype, accum in itertools.product((1, 2, 3), SETTINGS, ("fp32", "bf16"), (1, 3))
    if stage == 3 or setting == "optimizer"
] + [_case(stage, "both", "fp32", 2, meta=True) for stage in (1, 2, 3)] + [
    {"stage": stage, "overflow": True, "zero": BOTH} for stage in (1, 2, 3)
]


def test_offload_matches_single_process() -> None:
    _check_grid(CI_CASES, 2, run_on_ranks(2, offload_grid, CI_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_offload_full_grid(world_size: int) -> None:
    _check_grid(FULL_CASES, world_size, run_on_ranks(world_size, offload_grid, FULL_CASES, timeout=900))


@pytest.mark.slow
def test_offload_with_hybrid_sharding_2x2() -> None:
    cases = [_case(stage, "both", "fp32", 2, shard_group_size=2) for stage in (1, 2, 3)]
    cases += [_case(3, "both", "bf16", 1, shard_group_size=2)]
    _check_grid(cases, 4, run_on_ranks(4, offload_grid, cases))


# -- what the device holds, and how often the host waits ------------------------------------------

GUARD_ACCUM = 2


def _guarded_config(case: dict) -> dict:
    return engine_config(
        case["stage"], micro=MICRO, lr=LR, accum=GUARD_ACCUM, optimizer_params={"eps": EPS}, clip=1.0,
        dtype=case["dtype"], reduce_bucket_size=60, stage3_param_persistence_threshold=0, **case["zero"],
    )


def _device_bound(engine: Engine, guard: DeviceGuard) -> int:
    """What the device may hold between steps: the compute parameters (whole below stage 3,
    the shard at stage 3 unless offload_param), the full gradients stage 1 keeps for backward,
    stage 2's pooled gradient buckets, the frozen parameters (compute copy and fp32 values) and
    the model's buffers. Nothing of the optimizer, unless only the parameters are offloaded.
    Plus the step's agreement vector (the used-mask and the squared norm, float64): gloo's work
    object may still hold it for a moment after its wait returned (seen in about one run in
    ten, by its size: 8 bytes per trainable parameter and one more)."""
    frozen = [*engine.model_state.loose_params, *engine.model_state.loose_masters.values()]
    agreement = 8 * (engine.reducer.num_params + 1)
    held = agreement + engine.reducer.buffer_bytes() + sum(t.untyped_storage().nbytes() for t in frozen)
    for unit in engine.units:
        if unit.sharded_params:
            held += 0 if engine.offload.params else unit.param_shard.untyped_storage().nbytes()
        else:
            held += unit.flat_param.untyped_storage().nbytes()
        if unit.flat_grad is not None:
            held += unit.flat_grad.untyped_storage().nbytes()
        if not engine.offload.optimizer and unit.optimizer_shard.master is not unit.param_shard:
            held += unit.optimizer_shard.master.untyped_storage().nbytes()
    if not engine.offload.optimizer:  # offload_param alone: the optimizer stays on the device
        held += sum(v.untyped_storage().nbytes() for state in engine.optimizer.state.values() for v in state.values())
    return held + sum(b.untyped_storage().nbytes() for b in engine.module.buffers() if guard.on_device(b))


def _offloaded_tensors(engine: Engine) -> list[torch.Tensor]:
    tensors = []
    for unit in engine.units:
        if engine.offload.optimizer:
            tensors += [unit.optimizer_shard.master, unit.optimizer_shard.ensure_grad()]
        if engine.offload.params and unit.sharded_params:
            tensors.append(unit.param_shard)
    if engine.offload.optimizer:
        tensors += [v for state in engine.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensors


def guarded_offload(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        with DeviceGuard() as guard:
            model = make_model()
            guard.adopt(model)
            engine = zero_engine.initialize(model, _guarded_config(case), param_groups=decay_groups(model))
            syncs, between_steps, bounds, peaks = [], [], [], []
            for step in range(2):
                for micro in range(GUARD_ACCUM):
                    tokens, targets = (t.to(engine.device) for t in micro_batch(step, micro, rank, world_size, MICRO, GUARD_ACCUM))
                    guard.take_syncs()
                    guard.reset_peak()
                    loss = engine(tokens, targets)
                    engine.backward(loss)
                    peaks.append(guard.peak_device_bytes)
                    engine.step()
                    syncs.append([sync.what for sync in guard.take_syncs()])
                    del tokens, targets, loss
                gc.collect()  # unreachable cycles are not held memory (Python frees them when it runs)
                between_steps.append(guard.device_bytes())
                bounds.append(_device_bound(engine, guard))
                if between_steps[-1] > bounds[-1]:  # for the failure message: every live device storage
                    bounds[-1] = (bounds[-1], sorted(guard.device_storage_sizes()))
            on_device = [tuple(t.shape) for t in _offloaded_tensors(engine) if guard.on_device(t)]
            shard_bytes = sum(
                unit.param_shard.untyped_storage().nbytes() for unit in engine.units if unit.sharded_params
            )
            frozen = [*engine.model_state.loose_params, *engine.model_state.loose_masters.values(), *model.buffers()]
            frozen_and_buffers = sum(t.untyped_storage().nbytes() for t in frozen if guard.on_device(t))
            agreement = 8 * (engine.reducer.num_params + 1)
            engine.close()
        results.append({
            "syncs": syncs, "between_steps": between_steps, "bounds": bounds, "peak": max(peaks),
            "offloaded_on_device": on_device, "shard_bytes": shard_bytes, "frozen_and_buffers": frozen_and_buffers,
            "agreement": agreement,
        })
    return results


GUARDED_CASES = [
    {"stage": stage, "dtype": dtype, "zero": SETTINGS[setting]}
    for stage, dtype, setting in [
        (1, "bf16", "optimizer"), (2, "fp32", "optimizer"), (2, "bf16", "optimizer"),
        (3, "bf16", "optimizer"), (3, "bf16", "both"), (3, "fp32", "param"),
    ]
]


def test_offloaded_state_stays_on_the_host_and_the_host_waits_once_per_backward() -> None:
    per_rank = run_on_ranks(2, guarded_offload, GUARDED_CASES)
    for index, case in enumerate(GUARDED_CASES):
        for rank, result in enumerate(r[index] for r in per_rank):
            where = f"{case}, rank {rank}"
            assert result["offloaded_on_device"] == [], where
            for held, bound in zip(result["between_steps"], result["bounds"]):
                assert isinstance(bound, int) and held <= bound, f"{where}: the device holds {held} bytes, bound {bound}"
            if case["zero"] is BOTH:
                # Between steps nothing of the model but its buffer and its frozen parameters
                # (and perhaps the agreement vector still held by gloo, see `_device_bound`).
                for held in result["between_steps"]:
                    assert held - result["frozen_and_buffers"] in (0, result["agreement"]), where
            # One wait per backward whose gradients crossed to the host (stage 1: the boundary's
            # only), and the step's one read-back of the used-mask and the norm.
            crossing = "wait_for_host_copies"
            readback = "Tensor.tolist"
            if case["stage"] == 1:
                expected = [[], [crossing, readback]] * 2
            elif "offload_optimizer" in case["zero"]:
                expected = [[crossing], [crossing, readback]] * 2
            else:
                expected = [[], [readback]] * 2
            assert result["syncs"] == expected, where
    # offload_param: the device's peak during forward and backward is the same run's without
    # it less the parameter shards (they were on the device all along): only units in flight.
    both, optimizer_only = per_rank[0][4], per_rank[0][3]
    assert both["peak"] <= optimizer_only["peak"] - both["shard_bytes"], (both, optimizer_only)


def early_copy_read(rank: int, world_size: int) -> str:
    """A planted mistake: the host reads an offloaded gradient before waiting for its copy."""
    with DeviceGuard() as guard:
        model = make_model()
        guard.adopt(model)
        case = {"stage": 2, "dtype": "fp32", "zero": OPTIMIZER}
        engine = zero_engine.initialize(model, _guarded_config(case), param_groups=decay_groups(model))
        original = offload.wait_for_host_copies
        offload.wait_for_host_copies = lambda device: None  # the wait forgotten
        try:
            for micro in range(GUARD_ACCUM):
                batch = micro_batch(0, micro, rank, world_size, MICRO, GUARD_ACCUM)
                engine.backward(engine(*(t.to(engine.device) for t in batch)))
                engine.step()
        except DeviceMistake as err:
            return str(err)
        finally:
            offload.wait_for_host_copies = original
    return "no mistake seen"


def test_reading_a_gradient_before_its_copy_completes_is_caught() -> None:
    for message in run_on_ranks(2, early_copy_read):
        assert "asynchronous copy from the device may still be writing" in message


# -- checkpoints across offload settings ----------------------------------------------------------


def test_checkpoints_move_between_offloaded_and_plain_runs(tmp_path: Path) -> None:
    """Saved with offload, resumed without it at another stage and world size, and the
    reverse: both continue on the one-process trajectory."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = run_on_ranks(2, resume_jobs, [("save", 2, a, OPTIMIZER), ("save", 3, b, {})])
    resumed = run_on_ranks(3, resume_jobs, [("load", 1, a, {}), ("load", 3, b, BOTH)])
    ref_losses, ref_state, _ = train_reference(FIRST + SECOND, GLOBAL_BATCH, lr=CKPT_LR)
    for index, what in enumerate(["stage 2 offloaded -> stage 1 plain", "stage 3 plain -> stage 3 offloaded"]):
        before = global_means([r[index] for r in saved])
        after = global_means([r[index] for r in resumed])
        assert before + after == pytest.approx(ref_losses, abs=2e-5), what
        for rank, result in enumerate(r[index] for r in resumed):
            for name, ref in ref_state.items():
                diff = (result["state"][name] - ref).abs().max().item()
                assert diff <= 2e-5, f"{what}, rank {rank}: {name} differs by {diff}"


# -- refusals and the host memory check ---------------------------------------------------------


def _plain(stage: int, **zero) -> dict:
    return engine_config(stage, micro=2, lr=0.01, **zero)


@pytest.mark.parametrize(
    "zero, error, fragment",
    [
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.3}}, NotImplementedError,
         "offload_optimizer.ratio = 0.3"),
    ],
)
def test_offload_that_is_not_built_is_refused_naming_the_key(zero: dict, error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        zero_engine.initialize(make_model(), _plain(2, **zero))
    assert fragment in str(info.value)


def test_offload_at_stage_0_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_param.device = 'cpu' needs zero_optimization.stage 1-3"):
        zero_engine.load_config(_plain(0, **PARAMS))


def test_offload_param_below_stage_3_is_named_as_without_effect(caplog: pytest.LogCaptureFixture) -> None:
    engine = zero_engine.initialize(make_model(), _plain(2, **BOTH))
    assert "offload_param.device = 'cpu' has no effect at stage 2" in caplog.text
    assert not engine.offload.params and engine.offload.optimizer
    engine.close()


def test_host_memory_is_checked_before_anything_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 10_000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = make_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(MemoryError, match=r"x 4 rank\(s\) on this node .* but the node has 0.00 GiB available"):
        zero_engine.initialize(model, _plain(3, **BOTH))
    for name, param in model.named_parameters():  # untouched: not flattened, not sharded
        assert torch.equal(param, before[name]), name
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 10**12)
    zero_engine.initialize(model, _plain(3, **BOTH)).close()


PINNED_CASES = [
    (3, {**BOTH, "stage3_param_persistence_threshold": 0}, 2, "bf16"),
    (3, {**BOTH}, 1, None),
    (2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "reduce_bucket_size": 50}, 1, None),
    (1, {**OPTIMIZER}, 3, "bf16"),
]


def planned_and_pinned(rank: int, world_size: int, cases: list) -> list[tuple[list[int], list[int], list[int]]]:
    """Per case: the pinned buffers `initialize` planned for its host check, those offload
    then asked to pin, and those of them asked for during two steps of training (none: a
    page-locked allocation inside a backward is a device-wide sync, GPU review P2)."""
    results = []
    real_empty, real_overshoot = offload.host_empty, offload.pinning_overshoot
    for stage, zero, accum, dtype in cases:
        asked: list[int] = []
        planned: list[int] = []
        training: list[int] = []

        def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
            if pin:
                asked.append(numel * torch.tensor([], dtype=dtype).element_size())
            return real_empty(numel, dtype, pin)

        offload.pinning_overshoot = lambda buffers: planned.extend(buffers) or 0
        offload.host_empty = host_empty
        try:
            engine = zero_engine.initialize(make_model(), engine_config(stage, micro=2, lr=0.01, accum=accum, dtype=dtype, **zero))
            built = len(asked)
            train_engine(engine, rank, world_size, range(2), 2, accum)
            training = asked[built:]
            engine.close()
        finally:
            offload.host_empty, offload.pinning_overshoot = real_empty, real_overshoot
        results.append((planned, asked, training))
    return results


def test_the_pinned_buffers_planned_before_allocation_are_those_allocated() -> None:
    """What `initialize` checks the host for (each pinned buffer, rounded up by the allocator)
    is planned before anything is allocated: it must be every buffer offload then asks to pin,
    the host gradients and staging buffers, offloaded parameter shards and (``pin_memory``)
    masters, at 3 ranks' padded shard sizes; all of them pinned at initialize, none while
    training (staging buffers included: GPU review P2)."""
    for rank_results in run_on_ranks(3, planned_and_pinned, PINNED_CASES):
        for (planned, asked, training), case in zip(rank_results, PINNED_CASES):
            assert asked and sorted(planned) == sorted(asked), case
            assert training == [], case


def test_pinned_buffers_are_counted_as_the_allocator_holds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's caching host allocator gives a pinned buffer a power-of-two block: the host check
    counts that (GPU review N4), so a node with room for the exact bytes but not the blocks is
    refused at initialize."""
    assert [offload.pinned_block_bytes(n) for n in (1, 4, 5, 3 * 2**20, 2**30 + 1)] == [1, 4, 8, 4 * 2**20, 2**31]
    assert offload.pinning_overshoot([5, 8]) == 0  # a CPU-only torch pins nothing
    monkeypatch.setattr(offload, "_can_pin", lambda: True)
    assert offload.pinning_overshoot([5, 8, 3 * 2**20]) == 3 + 2**20
    config = engine_config(3, micro=2, lr=0.01, stage3_param_persistence_threshold=0, **BOTH)
    model = make_model()
    num_params = sum(p.numel() for p in model.parameters())
    exact = estimate_from_config(zero_engine.load_config(config), num_params, 1).host
    monkeypatch.setattr(offload, "available_host_bytes", lambda: exact)  # room for the exact bytes only
    with pytest.raises(MemoryError, match="offload_optimizer / offload_param"):
        zero_engine.initialize(model, config)


def test_host_bytes_as_the_process_holds_them_the_report_and_the_estimate_agree() -> None:
    """One rank, stage 3, bf16, both offloaded, the model adopted as device tensors: the host
    storages the engine added (live tensors, counted from the storages) are what
    `memory_report()` says, and that is the formula (the optimizer state, masters and gradients,
    16 bytes per parameter, plus the bf16 parameter shard; no padding at one rank)."""
    with DeviceGuard() as guard:
        model = make_model()
        guard.adopt(model)
        before = live_tensor_bytes(HOST)
        config = engine_config(3, micro=2, lr=0.01, dtype="bf16", stage3_param_persistence_threshold=0, **BOTH)
        engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
        train_engine(engine, 0, 1, range(1), 2, 1, device=engine.device)
        added = live_tensor_bytes(HOST) - before
        measured = engine.memory_report()
        # Beside the model state, stage 3 keeps one host row of int64 per rank for agreements.
        assert added == measured["host"] + 8 * len(make_row(0, PassKind.FORWARD, [], 0))
        engine.close()
    whole = make_model()  # stage 3 left the model's parameters empty
    num_params = sum(p.numel() for p in whole.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in whole.parameters() if not p.requires_grad)
    estimate = estimate_from_config(zero_engine.load_config(config), num_params, 1, frozen_params=frozen)
    assert estimate.host == num_params * (4 + 4 + 8 + 2) + frozen * 2  # the frozen layer's bf16 shard too
    # Measured: Adam has no state for the parameter no rank used, and one step count per tensor.
    steps = sum(s["step"].numel() * 4 for s in engine.optimizer.state.values())
    assert measured["host"] == estimate.host - 8 * whole.unused.numel() + steps


def test_cli_estimate_shows_the_host_share(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Stage 2, bf16, Adam, offload_optimizer, 1e9 parameters over 4 ranks: the device keeps the
    bf16 parameters (2 GB), the host the fp32 master, fp32 gradient shard and Adam state
    (16 bytes per parameter / 4 = 4 GB)."""
    config = tmp_path / "c.yaml"
    config.write_text("bf16: {enabled: true}\nzero_optimization: {stage: 2, offload_optimizer: {device: cpu}}\n")
    assert cli_main(["estimate", str(config), "--params", "1e9", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    host_gib = float(out.split("on the host")[1].split()[0])
    assert host_gib == pytest.approx(4e9 / 2**30, abs=1e-3)
    assert f"on the device: {2e9 / 2**30:.3f} GiB" in out


def test_a_resumed_run_keeps_its_own_optimizer_implementation(tmp_path: Path) -> None:
    """Offload steps with the fused CPU kernel; a checkpoint carries the math (lr, betas, ...),
    not that choice, so a run without offload resumes on torch's default, and the reverse."""
    def engine(zero: dict) -> Engine:
        model = make_model()
        return zero_engine.initialize(model, _plain(2, **zero), param_groups=decay_groups(model))

    offloaded = engine(OPTIMIZER)
    train_engine(offloaded, 0, 1, range(1), 2, 1)
    offloaded.save_checkpoint(tmp_path / "a")
    plain = engine({})
    plain.save_checkpoint(tmp_path / "b")
    assert all(group["fused"] for group in offloaded.optimizer.param_groups)
    resumed_plain, resumed_offloaded = engine({}), engine(OPTIMIZER)
    resumed_plain.load_checkpoint(tmp_path / "a")
    resumed_offloaded.load_checkpoint(tmp_path / "b")
    assert not any(group["fused"] for group in resumed_plain.optimizer.param_groups)
    assert all(group["fused"] for group in resumed_offloaded.optimizer.param_groups)
    for each in (offloaded, plain, resumed_plain, resumed_offloaded):
        each.close()


# -- the host gradient of one shard, directly -------------------------------------------------------


def test_a_host_gradient_accumulates_a_window_and_starts_the_next_anew() -> None:
    """The window's first copy overwrites what the host buffer held, later micro-steps add (after
    the backward's wait), ``value()`` of a window nothing wrote is zeros, a whole-window
    ``replace`` overwrites, and ``move_into`` hands the window so far to the device and starts the
    next copy anew; ``clear()`` after a step likewise."""
    from zero_engine.sharding.tiers.host_gradient import HostGradient

    device = torch.device("cpu")
    first, second, third = (torch.full((5,), value) for value in (1.0, 2.0, 4.0))
    grad = HostGradient(5, device)
    grad.values.fill_(7.0)  # what an earlier window left
    assert torch.equal(grad.value(), torch.zeros(5)), "a window nothing wrote must read as zeros"

    grad.clear()
    grad.values.fill_(7.0)
    grad.receive(first)
    grad.finish()
    grad.receive(second)  # the next micro-step: staged, added by finish()
    assert torch.equal(grad.values, first), "the staged copy was added before the backward's wait"
    grad.finish()
    assert torch.equal(grad.value(), first + second)

    grad.replace(third)  # stages 0-1: the window's whole gradient at once
    grad.finish()
    assert torch.equal(grad.value(), third)

    on_device = torch.ones(5)
    grad.move_into(on_device)
    assert torch.equal(on_device, 1 + third)
    grad.receive(first)  # the next copy overwrites: nothing was zeroed under the copy out
    grad.finish()
    assert torch.equal(grad.value(), first)
    grad.move_into(on_device)
    grad.move_into(on_device)  # nothing more to hand over
    assert torch.equal(on_device, 1 + third + first)
