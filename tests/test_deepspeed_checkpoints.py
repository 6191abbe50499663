"""DeepSpeed's own checkpoints, resumed here: the run goes on as DeepSpeed's went on.

``tests/data/deepspeed_checkpoints/CASE/`` holds what DeepSpeed 0.19.8 wrote after 3 steps of a
small model at one stage and precision on 2 ranks (``scripts/make_deepspeed_checkpoints.py``,
DeepSpeed in a venv of its own), with the 3 steps that followed in DeepSpeed's run: the learning
rate of each, the global loss, and the fp32 masters at the end (``final.pt``). Each checkpoint is
loaded here at another stage and world size, the same 3 steps are trained on the same rows,
and the rates must be DeepSpeed's exactly, the losses and the masters within 1e-5 in fp32 (bf16
and fp16 computations: within their rounding, stated per case). A checkpoint that would run
code, or that lacks or truncates a rank's file, is refused naming the file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from zero_engine.errors import CheckpointError
from zero_engine.state.deepspeed_checkpoint import read_deepspeed

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(ROOT / "scripts"))
from make_deepspeed_checkpoints import GLOBAL_ROWS, freeze, rows_of  # noqa: E402
from record_deepspeed_traces import inputs_and_targets, loss_of, make_model  # noqa: E402

# DeepSpeed's case -> (this engine's stage, world size, tolerance on the losses, on the fp32
# masters). fp32: the 1e-5. bf16 and fp16 compute in low precision: the same masters give
# the same low-precision weights, but gradients summed over another number of ranks (DeepSpeed
# sums them in 16 bits) round differently, and Adam turns rounding of tiny gradients into whole
# steps of the learning rate (measured: bf16 1.7e-4 on losses and 7.6e-4 on masters, fp16 5e-6
# and 3e-5, fp32 0 and 4e-7).
RESUMED_AT = {
    "stage0_fp32": (3, 3, 1e-5, 1e-5),
    "stage2_fp32": (0, 3, 1e-5, 1e-5),
    "stage3_fp32": (1, 2, 1e-5, 1e-5),
    "stage0_bf16": (2, 2, 5e-4, 2e-3),
    "stage2_bf16": (3, 3, 5e-4, 2e-3),
    "stage3_bf16": (0, 2, 5e-4, 2e-3),
    "stage1_fp16": (3, 2, 5e-5, 2e-4),
    "stage0_fp16": (2, 3, 5e-5, None),
    # The first block and the final norm frozen: DeepSpeed saved them as frozen_param_fragments,
    # resumed into frozen units; and its exclude_frozen_parameters checkpoint, whose frozen
    # weights come from the model as built (they never changed, so the run goes on the same).
    "stage3_fp32_frozen": (3, 3, 1e-5, 1e-5),
    "stage3_fp32_frozen:excluded": (0, 2, 1e-5, 1e-5),
}
# DeepSpeed 0.19.8 without ZeRO in fp16 does not scale the loss in backward but divides the
# gradients by the loss scale before its step (measured: its gradient norm is the true one over
# 256), so its Adam steps on gradients 256 times too small: that run's later losses are not
# a reference. Its first resumed loss, which the restored weights alone decide, is.
FIRST_LOSS_ONLY = {"stage0_fp16"}


def _trace(case: str) -> dict:
    return json.loads((DATA / case.partition(":")[0] / "trace.json").read_text())


def _checkpoint(case: str) -> Path:
    """A case's checkpoint directory: ``CASE`` or, for ``CASE:VARIANT``, ``CASE/VARIANT``."""
    name, _, variant = case.partition(":")
    return DATA / name / variant if variant else DATA / name


def _config(case: str, stage: int, world_size: int) -> dict:
    """DeepSpeed's config as the run used it, at another stage and world size (the same
    global batch)."""
    config = json.loads(json.dumps(_trace(case)["config"]))
    config["train_micro_batch_size_per_gpu"] = GLOBAL_ROWS // world_size
    config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return config


def resume(rank: int, world_size: int, cases: list[str]) -> dict:
    out = {}
    for case in cases:
        stage = RESUMED_AT[case][0]
        trace = _trace(case)
        model = freeze(make_model(), trace.get("frozen", []))
        if trace.get("frozen") and ":excluded" not in case:  # the checkpoint's frozen values must replace these
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.0 if param.requires_grad else 1.0)
        engine = zero_engine.initialize(model, _config(case, stage, world_size))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client_state = engine.load_checkpoint(_checkpoint(case))
        lrs, losses = [], []
        for step in range(trace["saved_at"], trace["saved_at"] + len(trace["losses"])):
            lrs.append(engine.get_lr()[0])
            inputs, targets = inputs_and_targets(rows_of(step, rank, world_size))
            loss = loss_of(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            total = torch.tensor([loss.item()], dtype=torch.float64)
            engine.comm.all_reduce_sum(total).wait()
            losses.append(total.item() / world_size)
        out[case] = {
            "lrs": lrs, "losses": losses, "client_state": client_state, "global_step": engine.global_step,
            "state": engine.full_state_dict(rank0_only=True) or None,  # collective: every rank calls it
            "warnings": [str(w.message) for w in caught],
        }
        engine.close()
    return out


@pytest.fixture(scope="module")
def resumed() -> dict[str, dict]:
    by_world: dict[int, list[str]] = {}
    for case, (_, world_size, *_) in RESUMED_AT.items():
        by_world.setdefault(world_size, []).append(case)
    results = {}
    for world_size, cases in by_world.items():
        results.update(run_on_ranks(world_size, resume, cases, timeout=300)[0])
    return results


@pytest.mark.parametrize("case", list(RESUMED_AT))
def test_deepspeed_checkpoint_resumes_deepspeeds_run(case: str, resumed: dict[str, dict]) -> None:
    stage, world_size, loss_tolerance, weight_tolerance = RESUMED_AT[case]
    trace, result = _trace(case), resumed[case]
    assert result["global_step"] == trace["saved_at"] + len(trace["losses"])
    assert result["client_state"] == {"epoch": 1, "note": "client state"}
    assert result["lrs"] == trace["lrs"], "the schedule's position is not DeepSpeed's"  # exactly
    assert not result["warnings"], result["warnings"]  # nothing DeepSpeed saved was left behind
    compared = 1 if case in FIRST_LOSS_ONLY else len(trace["losses"])
    losses = result["losses"][:compared]
    assert losses == pytest.approx(trace["losses"][:compared], abs=loss_tolerance), (case, stage, world_size)
    if weight_tolerance is not None:
        final = torch.load(DATA / case.partition(":")[0] / "final.pt", weights_only=True)
        state = result["state"]
        assert state.keys() == final.keys()
        worst = max((state[name] - final[name]).abs().max().item() for name in final)
        assert worst <= weight_tolerance, (case, worst)


def test_reader_places_every_element_as_deepspeeds_layout_does() -> None:
    """The masters of a stage 1-3 checkpoint assembled from the pieces equal stage 0's module
    values at the same step (the runs share data and initial values; fp32 differs only in the
    order of summation, so by a few ulps)."""
    reference = read_deepspeed(DATA / "stage0_fp32")
    for case in ("stage2_fp32", "stage3_fp32"):
        translated = read_deepspeed(DATA / case)
        assert translated.checkpoint.manifest["params"] == reference.checkpoint.manifest["params"]
        ours, theirs = translated.piece_index(), reference.piece_index()
        for name, entry in reference.checkpoint.manifest["params"].items():
            numel = torch.Size(entry["shape"]).numel()
            for key in (None, "exp_avg", "exp_avg_sq"):
                a, b = ours.assemble(name, 0, numel, key), theirs.assemble(name, 0, numel, key)
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (case, name, key)


def _copy(case: str, tmp_path: Path) -> Path:
    target = tmp_path / case
    shutil.copytree(DATA / case, target)
    return target


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo ran > " + str(Path(os.environ["PWNED"])),))


def test_hostile_or_damaged_files_are_refused_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _copy("stage2_fp32", tmp_path)
    optim = directory / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    monkeypatch.setenv("PWNED", str(tmp_path / "pwned"))
    # A plausible layout whose optimizer state would run a command when unpickled.
    torch.save({"optimizer_state_dict": {"loss_scaler": _RunsCode()}, "ds_version": "0.19.8"}, optim)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: refused: it names the class (posix|os)\.system"):
        read_deepspeed(directory)
    assert not (tmp_path / "pwned").exists(), "the file's code ran"
    # The model-states file too, and by pickle's own protocol (not torch.save's zip).
    model = directory / "global_step3" / "mp_rank_00_model_states.pt"
    model.write_bytes(pickle.dumps({"module": _RunsCode()}))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt"):
        read_deepspeed(directory)
    assert not (tmp_path / "pwned").exists()

    directory = _copy("stage3_fp32", tmp_path)
    optim = directory / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: unreadable, truncated"):
        read_deepspeed(directory)
    optim.unlink()
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: missing"):
        read_deepspeed(directory)


def test_cli_converts_and_exports_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    """``zero-engine convert`` writes this engine's format (loaded back, the same pieces), and
    ``consolidate`` reads DeepSpeed's directory directly."""
    out = tmp_path / "converted"
    command = [sys.executable, "-m", "zero_engine.cli", "convert", str(DATA / "stage3_bf16"), str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    direct, converted = zero_engine.load_consolidated(DATA / "stage3_bf16"), zero_engine.load_consolidated(out)
    assert direct.keys() == converted.keys() and all(torch.equal(direct[k], converted[k]) for k in direct)
    final_of_save = read_deepspeed(DATA / "stage3_bf16")
    assert (out / "latest").read_text() == final_of_save.checkpoint.path.name
    hf = tmp_path / "hf"
    command = [sys.executable, "-m", "zero_engine.cli", "consolidate", str(DATA / "stage2_fp32"), str(hf), "--format", "hf"]
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    from safetensors.torch import load_file

    written = load_file(hf / "model.safetensors")
    expected = zero_engine.load_consolidated(DATA / "stage2_fp32")
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in written)


def schedule_fit(rank: int, world_size: int) -> dict:
    """A DeepSpeed run's schedule position into an engine with none (left, and said) and into
    one with a torch scheduler (refused, naming what to do)."""
    config = _config("stage2_fp32", 2, world_size)
    out = {}
    without = {key: value for key, value in config.items() if key != "scheduler"}
    engine = zero_engine.initialize(make_model(), without)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(DATA / "stage2_fp32")
    out["without"] = [str(w.message) for w in caught if "not restored" in str(w.message)]
    out["lr_without"] = engine.get_lr()[0]
    engine.close()
    torch_schedule = {**config, "scheduler": {"type": "StepLR", "params": {"step_size": 2}}}
    engine = zero_engine.initialize(make_model(), torch_schedule)
    try:
        engine.load_checkpoint(DATA / "stage2_fp32")
        out["torch"] = ""
    except CheckpointError as err:
        out["torch"] = str(err)
    out["torch_still_trains"] = engine.global_step == 0
    engine.close()
    return out


def test_a_schedule_that_does_not_map_is_refused_or_left_said() -> None:
    out = run_on_ranks(2, schedule_fit)[0]
    assert len(out["without"]) == 1 and "lr_scheduler" in out["without"][0] and "no scheduler" in out["without"][0]
    assert out["lr_without"] == 0.01, "the optimizer's group options (the rate when saved) are restored"
    assert "does not fit this engine's StepLR" in out["torch"] and "load_optimizer_states=False" in out["torch"]
    assert out["torch_still_trains"], "a refused load changed the counters"


def test_a_deepspeed_checkpoint_serves_as_pretrained_weights() -> None:
    """``initialize(weights=...)`` takes a DeepSpeed directory (or its tag directory) as it takes
    one of ours: the fp32 masters, each rank reading its ranges."""
    expected = zero_engine.load_consolidated(DATA / "stage3_fp32")
    for source in (DATA / "stage3_fp32", DATA / "stage3_fp32" / "global_step3"):
        engine = zero_engine.initialize(make_model(), _config("stage3_fp32", 3, 1), weights=source)
        state = engine.full_state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
        engine.close()


def test_the_loss_scalers_remaining_hysteresis_is_its_current_not_its_configured() -> None:
    """DeepSpeed's DynamicLossScaler saves ``delayed_shift`` (the configured hysteresis) and
    ``cur_hysteresis`` (what is left of it after recent overflows): a resumed run goes on with
    what was left. The recorded fp16 fixture has both at 2; here they differ."""
    from zero_engine.state.deepspeed_checkpoint import translate_loss_scaler

    saved = {"dynamic": True, "cur_scale": 1024.0, "cur_iter": 37, "last_overflow_iter": 30, "scale_factor": 2.0,
             "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 4, "cur_hysteresis": 1,
             "consecutive_hysteresis": False}
    assert translate_loss_scaler(saved) == {"scale": 1024.0, "remaining_hysteresis": 1, "iteration": 37,
                                            "last_overflow": 30}
    assert translate_loss_scaler({**saved, "dynamic": False}) is None
    assert translate_loss_scaler({"dynamic": True, "cur_scale": 8.0}) == {"scale": 8.0}  # the stage 0 wrapper's few fields
