"""Faults and careless input: nothing lost, nothing silent, nothing hung.

Each case here failed before the fix it guards: a checkpoint whose ``client_state`` made the
whole checkpoint unloadable, a re-save killed between two renames, a save error on one rank
that left the others inside a collective, ``save_checkpoint`` / ``full_state_dict`` called on
rank 0 alone, a NaN step that poisoned every weight in fp32 and bf16, unchecked scheduler and
optimizer options, and raw tracebacks from the CLI and ``engine.backward``.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RankFailure, run_on_ranks
from models import make_model, micro_batch

import zero_engine
from configs import engine_config
from zero_engine import CheckpointError, ConfigError
from zero_engine.cli import main as cli_main
from zero_engine.state import storage
from zero_engine.state.storage import open_checkpoint

MICRO = 2


def _train(engine: Any, rank: int, world_size: int, steps: range, poison: int | None = None) -> list[float]:
    """One micro-batch per step; at step ``poison`` rank 1's loss is multiplied by NaN."""
    losses = []
    for step in steps:
        loss = engine(*micro_batch(step, 0, rank, world_size, MICRO, 1))
        if step == poison and rank == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _engine(stage: int, optimizer: str = "AdamW", **options: Any) -> Any:
    return zero_engine.initialize(make_model(), engine_config(stage, micro=MICRO, lr=0.05, optimizer=optimizer, **options))


def _wait_for(path: Path, seconds: float) -> bool:
    """Whether ``path`` appears within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as err:  # noqa: BLE001 (the test reports what each rank raised)
        return type(err).__name__, str(err)
    return "", ""


# -- checkpoints on two ranks: one spawn, every case -------------------------------------------


def checkpoint_faults(rank: int, world_size: int, directory: str) -> dict:
    out: dict = {}
    root = Path(directory)
    engine = _engine(1)
    _train(engine, rank, world_size, range(1))

    # client_state the loader would refuse: refused before anything is written.
    out["namespace"] = _outcome(lambda: engine.save_checkpoint(root, client_state={"args": argparse.Namespace(lr=1)}))
    out["after_namespace"] = sorted(p.name for p in root.iterdir()) if root.exists() else []
    engine.save_checkpoint(root, client_state={"args": vars(argparse.Namespace(lr=1))})
    out["client_state"] = engine.load_checkpoint(root)

    # A full disk on rank 1 alone: every rank raises, the staging directory goes, and the
    # ranks' collectives are still in step (training and a later save work).
    _train(engine, rank, world_size, range(1, 2))
    class FullDisk(storage.FileWriter):
        def write_file(self, path: Path, payload: Any) -> dict:
            raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        engine.checkpoint_writer = FullDisk()
    out["full_disk"] = _outcome(lambda: engine.save_checkpoint(root))
    engine.checkpoint_writer = storage.FILES
    out["after_full_disk"] = sorted(p.name for p in root.iterdir())
    _train(engine, rank, world_size, range(2, 3))
    out["saved_after"] = engine.save_checkpoint(root).name

    # A target that is a file (rank 0 prepares the directory) and tags that differ by rank:
    # every rank raises, before any rank writes.
    if rank == 0:
        (root / "a-file").write_text("not a directory")
    out["target_is_a_file"] = _outcome(lambda: engine.save_checkpoint(root / "a-file"))
    out["tags_differ"] = _outcome(lambda: engine.save_checkpoint(root, tag=f"mine{rank}"))
    out["pretrained_into_a_file"] = _outcome(lambda: engine.save_pretrained(root / "a-file"))
    out["after_refusals"] = sorted(p.name for p in root.iterdir())

    # A checkpoint missing on rank 1's disk: every rank raises, rank 0 restores nothing.
    before = engine.full_state_dict()
    out["missing_on_one"] = _outcome(lambda: engine.load_checkpoint(root if rank == 0 else root / "elsewhere"))
    after = engine.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)

    # Another optimizer's state is refused at load, not at the first step.
    sgd = _engine(1, optimizer="SGD")
    _train(sgd, rank, world_size, range(1))
    sgd.save_checkpoint(root, tag="sgd")
    sgd.close()
    out["other_optimizer"] = _outcome(lambda: engine.load_checkpoint(root, tag="sgd"))
    engine.load_checkpoint(root, tag="sgd", load_optimizer_states=False)
    _train(engine, rank, world_size, range(3, 4))
    engine.close()

    # A backward's call row is read before its first reduction, not when it is sent: rank 0
    # ends a micro-step that reduces nothing (stage 0, accumulation 2) before rank 1 has sent
    # its row (rank 1 waits for rank 0's file first). Then both step together.
    engine = _engine(0, accum=2)
    rank0_done = root.parent / "rank0-done"
    if rank == 0:
        _train(engine, rank, world_size, range(1))
        rank0_done.touch()
    else:
        loss = engine(*micro_batch(0, 0, rank, world_size, MICRO, 1))
        out["peer_ended_first"] = _wait_for(rank0_done, seconds=60)
        engine.backward(loss)
        engine.step()
    out["stepped_after"] = _train(engine, rank, world_size, range(1, 2))
    engine.close()

    # full_state_dict on rank 0 alone between a forward and its backward (stage 1: the peer's
    # next collective is its boundary reduction): every rank raises.
    engine = _engine(1)
    loss = engine(*micro_batch(0, 0, rank, world_size, MICRO, 1))
    out["between_forward_and_backward"] = _outcome(engine.full_state_dict if rank == 0 else loss.backward)
    engine.close()

    # save_checkpoint on rank 0 alone (stage 0: its peer's next collective is a gradient
    # all-reduce; with accumulation the peer's first micro-step reduces nothing, so its row is
    # read when it sends the next one) and full_state_dict on rank 0 alone at stage 3 (the
    # peer's next forward gathers): every rank raises, naming each rank's call, and a new
    # engine works after the first two. Last: the groups are spent.
    save, export = (lambda e: e.save_checkpoint(root, tag="rank0")), (lambda e: e.full_state_dict())
    pretrained = lambda e: e.save_pretrained(root.parent / "hf")  # noqa: E731
    cases = (("0", 0, 1, save), ("0_accumulating", 0, 2, save), ("2_pretrained", 2, 1, pretrained), ("3", 3, 1, export))
    for case, stage, accum, call in cases:
        diverging = _engine(stage, accum=accum)
        _train(diverging, rank, world_size, range(accum))
        on_rank0_only = functools.partial(call, diverging) if rank == 0 else functools.partial(
            _train, diverging, rank, world_size, range(accum, 3 * accum)
        )
        out[f"rank0_only_{case}"] = _outcome(on_rank0_only)
        out[f"refused_later_{case}"] = _outcome(functools.partial(diverging.save_checkpoint, root, tag="later"))
        diverging.close()
        if case == "2_pretrained":  # then a reference engine (every weight frozen, stage 3): rank 0 exports alone
            out["rank0_only_3_frozen"] = _frozen_engine_exported_on_rank0_alone(rank, world_size)
    return out


def _frozen_engine_exported_on_rank0_alone(rank: int, world_size: int) -> tuple[str, str]:
    """Reliability review N29: a stage 3 engine with nothing to train (a reference model) whose
    full_state_dict rank 0 calls alone while rank 1 runs forwards: its frozen units are sharded,
    so the call is collective and every rank raises, before any rank gathers alone."""
    frozen = make_model()
    frozen.requires_grad_(False)
    reference = zero_engine.initialize(frozen, engine_config(3, micro=MICRO, lr=0.05, stage3_param_persistence_threshold=0))
    batch = micro_batch(0, 0, rank, world_size, MICRO, 1)

    def forwards() -> None:
        with torch.no_grad():
            for _ in range(3):
                reference(*batch)

    with torch.no_grad():
        reference(*batch)
    outcome = _outcome(reference.full_state_dict if rank == 0 else forwards)
    reference.close()
    return outcome


def test_checkpoint_faults_end_the_same_way_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    results = run_on_ranks(2, checkpoint_faults, str(directory))
    for rank, out in enumerate(results):
        kind, message = out["namespace"]
        assert kind == "CheckpointError" and "rank 0: ValueError: client_state would not load back" in message, out
        assert "argparse.Namespace" in message and "vars(args)" in message
        assert out["after_namespace"] == [], "a refused save left files behind"
        assert out["client_state"] == {"args": {"lr": 1}}

        kind, message = out["full_disk"]
        assert kind == "CheckpointError", (rank, out["full_disk"])
        assert "failed on 1 of 2 ranks" in message and "rank 1: OSError" in message and "No space left" in message
        assert ".tmp-global_step2" in message, "the error names no path"
        assert out["after_full_disk"] == ["global_step1", "latest"], "the failed save left its staging directory"
        assert out["saved_after"] == "global_step3"

        kind, message = out["target_is_a_file"]
        assert kind == "CheckpointError" and "rank 0: " in message and "a-file" in message, out["target_is_a_file"]
        kind, message = out["tags_differ"]
        assert kind == "CheckpointError" and "different tags ('mine0', 'mine1')" in message, out["tags_differ"]
        kind, message = out["pretrained_into_a_file"]
        assert kind == "CheckpointError" and "save_pretrained" in message and "rank 0: FileExistsError" in message, message
        assert out["after_refusals"] == ["a-file", "global_step1", "global_step3", "latest"], out["after_refusals"]

        kind, message = out["missing_on_one"]
        assert kind == "FileNotFoundError" and "rank 1: FileNotFoundError" in message and "elsewhere" in message
        assert out["unchanged"], f"rank {rank} restored a checkpoint its peer could not read"

        kind, message = out["other_optimizer"]
        assert kind == "CheckpointError" and "saved with optimizer SGD, this engine's is AdamW" in message

        if rank == 1:
            assert out["peer_ended_first"], "rank 0 waited for rank 1's call row before any reduction"
        assert math.isfinite(out["stepped_after"][0])

        kind, message = out["between_forward_and_backward"]
        assert kind == "DivergedRanksError" and "rank 0 is in full_state_dict()" in message, message
        kind, message = out["rank0_only_3_frozen"]
        assert kind == "DivergedRanksError" and "rank 0 is in full_state_dict()" in message, message
        for case in ("0", "0_accumulating", "2_pretrained", "3"):
            kind, message = out[f"rank0_only_{case}"]
            assert kind == "DivergedRanksError", (case, rank, out[f"rank0_only_{case}"])
            call = {"3": "full_state_dict()", "2_pretrained": "save_pretrained()"}.get(case, "save_checkpoint()")
            assert f"rank 0 is in {call}" in message, message
            assert "rank 1 is in training" in message or "rank 1 is in forward" in message, message
            assert out[f"refused_later_{case}"][0] == "DivergedRanksError"
    assert open_checkpoint(directory, "global_step3").manifest["optimizer"] == "AdamW"
    assert open_checkpoint(directory, "sgd").manifest["optimizer"] == "SGD"


# -- a re-save of one tag killed at each rename --------------------------------------------------


def resave_and_die(rank: int, world_size: int, directory: str, point: str) -> None:
    """Save tag "last" at step 1, then again at step 2, rank 0 (which publishes) killed at
    ``point``: the rename that publishes the new copy beside the old ("pending"), the one that
    moves the old copy away ("retire"), or the one that moves the new copy in ("promote")."""
    engine = _engine(1)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="last")
    _train(engine, rank, world_size, range(1, 2))
    if rank == 0:
        rename = os.rename

        def rename_or_die(src: Any, dst: Any) -> None:
            source, target = Path(src).name, Path(dst).name
            hit = {
                "pending": target.startswith(".next-"),
                "retire": target.startswith(".old-"),
                "promote": source.startswith(".next-"),
            }[point]
            if hit:
                os.kill(os.getpid(), signal.SIGKILL)
            rename(src, dst)

        os.rename = rename_or_die
    engine.save_checkpoint(directory, tag="last")


def resume_and_resave(rank: int, world_size: int, directory: str) -> int:
    engine = _engine(2)
    engine.load_checkpoint(directory)
    step = engine.global_step
    _train(engine, rank, world_size, range(step, step + 1))
    engine.save_checkpoint(directory, tag="last")
    return step


@pytest.mark.parametrize(
    "point, survivor",
    [pytest.param("pending", 1, marks=pytest.mark.slow), ("retire", 2), pytest.param("promote", 2, marks=pytest.mark.slow)],
)
def test_a_resave_killed_at_any_rename_leaves_the_tag_loadable(tmp_path: Path, point: str, survivor: int) -> None:
    directory = tmp_path / "ckpt"
    with pytest.raises(RankFailure):
        run_on_ranks(2, resave_and_die, str(directory), point)
    assert (directory / "latest").read_text() == "last"
    assert open_checkpoint(directory).manifest["global_step"] == survivor, f"killed at {point!r}"
    zero_engine.load_consolidated(directory)  # every file of it verified
    assert run_on_ranks(2, resume_and_resave, str(directory)) == [survivor, survivor]
    assert sorted(p.name for p in directory.iterdir()) == ["last", "latest"], "the move was not finished"
    assert open_checkpoint(directory).manifest["global_step"] == survivor + 1


# -- a non-finite step is skipped at every precision ---------------------------------------------


def nan_steps(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("zero_engine").addHandler(handler)
        options = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.05}}}
        config = {**engine_config(case["stage"], micro=MICRO, lr=0.05, dtype=case["dtype"]), **options}
        engine = zero_engine.initialize(make_model(), config)
        _train(engine, rank, world_size, range(1))
        before, lr_before = engine.full_state_dict(), engine.get_lr()
        _train(engine, rank, world_size, range(1, 2), poison=1)
        after, lr_after = engine.full_state_dict(), engine.get_lr()
        losses = _train(engine, rank, world_size, range(2, 4))
        logging.getLogger("zero_engine").removeHandler(handler)
        results.append({
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "lr_unchanged": lr_before == lr_after,
            "skipped": engine.skipped_steps,
            "global_step": engine.global_step,
            "finite_after": all(torch.isfinite(v).all().item() for v in engine.full_state_dict().values())
            and all(math.isfinite(loss) for loss in losses),
            "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING],
        })
        engine.close()
    return results


NAN_CASES = [{"stage": 2, "dtype": "fp32"}, {"stage": 3, "dtype": "bf16"}]


def test_a_nan_on_one_rank_skips_the_step_on_every_rank_with_a_warning() -> None:
    per_rank = run_on_ranks(2, nan_steps, NAN_CASES)
    for rank, results in enumerate(per_rank):
        for case, result in zip(NAN_CASES, results):
            assert result["unchanged"], f"{case} rank {rank}: a NaN step changed the weights"
            assert result["lr_unchanged"], f"{case}: the schedule advanced on a skipped step"
            assert result["skipped"] == 1 and result["global_step"] == 4, (case, result)
            assert result["finite_after"], (case, result)
            if rank == 0:
                assert any("step 1 skipped: the gradient norm is not finite" in w for w in result["warnings"]), result


# -- one process: configs, calls and the CLI -----------------------------------------------------


@pytest.mark.parametrize(
    "config, match",
    [
        ({"zero_optimization": {"stage": True}}, r"zero_optimization.stage = True: a number is expected, not a boolean"),
        ({"comm": {"timeout_s": float("inf")}}, r"comm.timeout_s = inf: Input should be a finite number"),
        ({"comm": {"timeout_s": 1e300}}, r"comm.timeout_s = 1e\+300: Input should be less than or equal to 1000000000000"),
        ({"fp16": {"enabled": True, "loss_scale": float("inf")}}, r"fp16.loss_scale = inf: Input should be a finite"),
        ({"optimizer": {"type": "AdamW", "params": {"amsgrad": "false"}}}, r"optimizer.params.amsgrad = 'false': must be true or false"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": True}}}, r"momentum = True: must be a finite number"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": float("nan")}}}, r"warmup_max_lr = nan: must be a non-negative"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}}, r"total_num_steps = 0: must be a positive integer"),
        (
            {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}},
            r"total_num_steps = 500 must exceed warmup_num_steps = 1000 \(the default\)",
        ),
        ({"scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": "0.5"}}}, r"gamma = '0.5': must be a finite number"),
    ],
)
def test_bad_options_are_refused_at_load_naming_the_key(config: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        zero_engine.load_config(config)


def train_with_the_longest_timeout(rank: int, world_size: int) -> float:
    from zero_engine.config import MAX_TIMEOUT_S

    config = engine_config(3, micro=MICRO, lr=0.05)
    config["comm"] = {"timeout_s": MAX_TIMEOUT_S}  # the engine's own groups are made with it
    engine = zero_engine.initialize(make_model(), config)
    losses = _train(engine, rank, world_size, range(1))
    engine.close()
    return losses[0]


def test_the_longest_timeout_accepted_at_load_makes_working_groups() -> None:
    """The bound on comm.timeout_s is what a process group takes (1e15 s overflowed in torch, and
    9.3e12 s in gloo); at the bound, the engine's groups are made and train."""
    assert all(math.isfinite(loss) for loss in run_on_ranks(2, train_with_the_longest_timeout))


def test_yaml_counts_read_as_strings_become_integers(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  type: WarmupDecayLR\n  params:\n    total_num_steps: 1e4\n    warmup_num_steps: 1e2\n")
    assert zero_engine.load_config(path).scheduler.params == {"total_num_steps": 10000, "warmup_num_steps": 100}


def test_a_schedule_that_fails_when_run_is_refused_at_initialize() -> None:
    config = {"scheduler": {"type": "StepLR", "params": {"step_size": 0}}}
    with pytest.raises(ConfigError, match=r"scheduler StepLR .* fails when run: ZeroDivisionError"):
        zero_engine.initialize(make_model(), config)


def test_careless_arguments_get_the_engines_own_messages(tmp_path: Path) -> None:
    """Reliability review D14: every parameter frozen after initialize is named by the engine
    (not torch's "element 0 of tensors does not require grad"), a loss made without gradients
    says so; sizes and dtypes are read the same whichever way they are written ("0GB" is
    refused as 0 is, 1e30 bytes and "float64" are accepted as 10**30 and torch.float64 are);
    a weights= file holding a pickle that would run code is refused naming the file, without
    suggesting weights_only=False."""
    model = make_model()
    engine = zero_engine.initialize(model, engine_config(0, micro=MICRO, lr=0.05))
    batch = micro_batch(0, 0, 0, 1, MICRO, 1)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="the loss does not require a gradient"):
            engine.backward(engine(*batch))
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"requires_grad changed after zero_engine.initialize .*'fc1.weight'"):
        engine.backward(engine(*batch))
    engine.close()
    engine = zero_engine.initialize(make_model(), engine_config(1, micro=MICRO, lr=0.05, dtype="bf16"))
    for size in ("0GB", 0, "0.0001KB", -1.0):
        with pytest.raises(ValueError, match="a positive number of bytes"):
            engine.named_full_parameters(bucket_bytes=size)
    streamed = dict(engine.named_full_parameters(bucket_bytes=1e30, dtype="float64"))
    assert streamed and all(t.dtype == torch.float64 for t in streamed.values() if t.is_floating_point())
    with pytest.raises(ValueError, match="a floating torch dtype"):
        engine.named_full_parameters(dtype="int8")
    engine.close()
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"args": argparse.Namespace(lr=1)}, unsafe)
    with pytest.raises(CheckpointError, match=r"weights: .*unsafe\.pt: refused by torch.load") as refused:
        zero_engine.initialize(make_model(), engine_config(0, micro=MICRO, lr=0.05), weights=unsafe)
    assert "weights_only=False" not in str(refused.value)


def test_misused_calls_say_what_to_do() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, engine_config(0, micro=MICRO, lr=0.05))
    with pytest.raises(ValueError, match="already wrapped by an engine"):
        zero_engine.initialize(model, engine_config(0, micro=MICRO, lr=0.05))
    with pytest.raises(TypeError, match="got an Engine"):
        zero_engine.initialize(engine, {})
    loss = engine(*micro_batch(0, 0, 0, 1, MICRO, 1))
    with pytest.raises(TypeError, match=r"loss must be a scalar tensor, got dict \(pass the loss in it"):
        engine.backward({"loss": loss})
    engine.backward(loss)
    engine.step()
    engine.close()
    zero_engine.initialize(model, engine_config(0, micro=MICRO, lr=0.05)).close()  # free again once closed


def test_cli_refuses_bad_numbers_and_unsafe_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    for argv, message in (
        (["estimate", str(config), "--params", "1e9", "--world-size", "0"], "--world-size: '0' is not a positive integer"),
        (["estimate", str(config), "--params", "inf"], "--params: 'inf' is not a positive integer"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    # A checkpoint whose extra.pt holds a pickle that would run code: refused, naming the file.
    engine = _engine(0)
    _train(engine, 0, 1, range(1))
    path = engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    torch.save({"module": {}, "client_state": argparse.Namespace()}, path / "extra.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["extra.pt"] = {"bytes": (path / "extra.pt").stat().st_size, "sha256": storage.sha256_of(path / "extra.pt")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert "extra.pt: refused by torch.load(weights_only=True)" in err and "argparse.Namespace" in err
    with pytest.raises(CheckpointError, match="extra.pt: refused"):
        zero_engine.load_consolidated(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_a_decay_must_end_after_its_warmup_at_the_boundary(name: str) -> None:
    """total_num_steps equal to warmup_num_steps leaves no step to decay over: refused, for
    both decaying schedules; one step more is a schedule."""
    with pytest.raises(ConfigError, match="total_num_steps = 100 must exceed warmup_num_steps = 100: the decay"):
        zero_engine.load_config({"scheduler": {"type": name, "params": {"total_num_steps": 100, "warmup_num_steps": 100}}})
    config = zero_engine.load_config({"scheduler": {"type": name, "params": {"total_num_steps": 101, "warmup_num_steps": 100}}})
    assert config.scheduler.params["total_num_steps"] == 101


# -- a held resource failing on one rank (STRUCTURE item 1) ---------------------------------------


class _FakeHeld:
    """A resource a feature holds (`zero_engine.sharding.tiers.held.Held`), failing when told."""

    kind, what, consequence, step_read_ahead = "fake", "a fake resource's read", "Start again.", 0
    host_bytes = 0

    def __init__(self) -> None:
        self.failed: OSError | None = None

    def failure(self) -> OSError | None:
        return self.failed

    def error(self, message: str) -> Exception:
        return RuntimeError(message)

    def report(self) -> dict[str, int]:
        return {"read": 0}

    def reset_report(self) -> None:
        pass

    def close(self) -> None:
        pass


def a_held_resource_that_fails(rank: int, world_size: int) -> list[tuple[str, str, float]]:
    """Stage 3 on 2 ranks with a fake held resource registered on both: rank 1's fails before a
    step, then (in a new engine) before a forward. What each rank raised, and how fast."""
    found = []
    for when in ("step", "forward"):
        config = engine_config(3, micro=MICRO, lr=0.05, stage3_param_persistence_threshold=0)
        config["comm"] = {"timeout_s": 60}  # a rank left waiting would wait this long
        engine = zero_engine.initialize(make_model(), config)
        fake = engine.held.add(_FakeHeld())
        _train(engine, rank, world_size, range(1))
        started = time.monotonic()
        if when == "step":
            engine.backward(engine(*micro_batch(1, 0, rank, world_size, MICRO, 1)))
            if rank == 1:
                fake.failed = OSError(errno.EIO, "planted")
            error, message = _outcome(engine.step)
        else:
            if rank == 1:
                fake.failed = OSError(errno.EIO, "planted")
            error, message = _outcome(lambda: engine(*micro_batch(1, 0, rank, world_size, MICRO, 1)))
        found.append((error, message, time.monotonic() - started))
        engine.close()
    return found


def test_a_held_resource_failing_on_one_rank_raises_on_every_rank_at_the_step_and_in_a_gather() -> None:
    """Whatever a feature holds reaches the step's agreement and stage 3's rounds through the
    build's registry, not by name: a fake resource failing on rank 1 makes both ranks raise its
    error at the step (counted in the norm's all-reduce) and at the next forward's gather round,
    at once, naming the ranks and this rank's own failure."""
    per_rank = run_on_ranks(2, a_held_resource_that_fails, timeout=200)
    for rank, outcomes in enumerate(per_rank):
        (step_error, step_message, step_seconds), (gather_error, gather_message, gather_seconds) = outcomes
        assert step_error == gather_error == "RuntimeError", outcomes
        assert "a fake resource's read failed on 1 of 2 ranks at step 1, before its update" in step_message, step_message
        assert "a fake resource's read failed on rank 1 (a read for a gather" in gather_message, gather_message
        for message in (step_message, gather_message):
            assert ("planted" if rank == 1 else "this rank's went through") in message, message
        assert step_seconds < 20 and gather_seconds < 20, outcomes
