"""PyTorch Lightning on zero_engine (`ZeroEngineStrategy`), against Lightning's own DDP strategy
with the same LightningModule, seed and data, on 2 CPU ranks: the logged losses and gradient
norms and the final weights at stages 0-3 (accumulation 2 with a short last window, clipping,
AdamW with two parameter groups, a step schedule, or an epoch schedule); resumed from a checkpoint
(Lightning's DDP first shown to reproduce itself), at the same stage and at another, and from a
checkpoint taken mid-epoch, inside an accumulation window's epoch, against DDP resumed the same
way; ``configure_model`` on the meta device at stage 3; ``validate()``; the consolidated
``.ckpt`` export; the mismatch error.

All runs share one spawn; the rank function returns what each run logged and ended with."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import run_on_ranks


@pytest.fixture(scope="module", autouse=True)
def _environment_restored() -> Iterator[None]:
    """A Trainer built in this process sets MASTER_ADDR, MASTER_PORT, LOCAL_RANK, NODE_RANK and
    OMP_NUM_THREADS there; left set, they made every later rank of the suite a fresh
    interpreter instead of a fork (`harness`: an environment that differs from the server's)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

pytest.importorskip("lightning", reason="the [lightning] extra: pip install -e '.[lightning]'")  # CI installs it

SAMPLES, MICRO, ACCUMULATE, EPOCHS = 88, 4, 2, 2  # 11 micro-batches per rank per epoch: a short last window
STEPS_PER_EPOCH = 6
TOLERANCE = 1e-4


def _module_class() -> Any:
    """The LightningModule, defined where lightning is importable (the rank processes)."""
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule
    from torch import nn

    class Regression(LightningModule):
        def __init__(self, lr: float = 0.05, weight_decay: float = 0.3, meta: bool = False,
                     schedule: str = "step") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.body = None if meta else self._body()

        @staticmethod
        def _body() -> nn.Module:
            return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 1))

        def configure_model(self) -> None:
            if self.body is None:  # under the strategy's meta device at stage 3
                self.body = self._body()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", F.l1_loss(self(x), y), sync_dist=True)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            decayed = [p for name, p in self.named_parameters() if name.endswith("weight") and p.dim() > 1]
            others = [p for name, p in self.named_parameters() if not (name.endswith("weight") and p.dim() > 1)]
            optimizer = torch.optim.AdamW(
                [
                    {"params": decayed, "weight_decay": self.hparams.weight_decay},
                    {"params": others, "weight_decay": 0.0},
                ],
                lr=self.hparams.lr,
            )
            if self.hparams.schedule == "epoch":  # Lightning steps it at each epoch's end
                halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "epoch"}}
            warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return Regression


def _data() -> tuple[Any, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 8, generator=generator)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    train = DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=True)
    val = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=MICRO)
    return train, val


def _logger() -> Any:
    from lightning.pytorch.loggers import Logger

    class Memory(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict[str, float]]] = []

        name, version = "memory", 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, {key: float(value) for key, value in metrics.items()}))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Memory()


def _grad_norm_callback() -> Any:
    """DDP's global gradient norm before clipping (the engine logs its own as grad_norm)."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class GradNorm(Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            module.log("grad_norm", torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    return GradNorm()


def lightning_runs(rank: int, world_size: int, root: str, cases: list[tuple[str, dict]]) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zero_engine.integrations.lightning import ZeroEngineStrategy, convert_to_lightning_checkpoint

    Regression = _module_class()
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    torch.save(Regression().state_dict(), Path(root) / f"initial-{rank}.pt")  # the meta case's weights
    for name, case in cases:
        seed_everything(0)
        model = Regression(meta=case.get("meta", False), schedule=case.get("schedule", "step"))
        if case["strategy"] == "ddp":
            strategy, callbacks = "ddp", [_grad_norm_callback()]
        else:
            weights = str(Path(root) / f"initial-{rank}.pt") if case.get("meta") else None
            strategy, callbacks = ZeroEngineStrategy(case["config"], weights=weights), []
        checkpoints = [ModelCheckpoint(dirpath=str(Path(root) / name), every_n_epochs=1, save_top_k=-1)]
        if case.get("step_checkpoints"):  # every 3 optimizer steps: mid-epoch (6 per epoch)
            checkpoints.append(ModelCheckpoint(dirpath=str(Path(root) / name / "steps"), every_n_train_steps=3,
                                               save_top_k=-1))
        logger = _logger()
        trainer = Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=EPOCHS,
            accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.5, logger=logger, log_every_n_steps=1,
            callbacks=[*callbacks, *checkpoints], enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, precision=case.get("precision", "32-true"),
        )
        train, val = _data()
        resume = case.get("resume")
        ckpt_path = str(Path(root) / resume / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt") if resume else None
        if case.get("resume_mid_epoch"):  # after 3 of the epoch's 6 steps
            ckpt_path = str(Path(root) / case["resume_mid_epoch"] / "steps" / "epoch=0-step=3.ckpt")
        try:
            trainer.fit(model, train, val, ckpt_path=ckpt_path)
        except Exception as err:  # noqa: BLE001 - the mismatch case
            if not case.get("expect_error"):
                raise
            results[name] = {"error": str(err)}
            continue
        metrics = trainer.validate(model, val, verbose=False)[0]
        if case.get("test_and_predict"):
            metrics.update(trainer.test(model, val, verbose=False)[0])
            metrics["predictions"] = torch.cat(trainer.predict(model, val))
        if case["strategy"] == "ddp":
            weights = {key: value.detach().clone() for key, value in model.state_dict().items()}
        else:
            weights = trainer.strategy.engine.full_state_dict()
        results[name] = {"rows": logger.rows, "weights": weights, "val_loss": metrics["val_loss"],
                         "test_loss": metrics.get("test_loss"), "predictions": metrics.get("predictions"),
                         "saved": sorted(path.name for path in (Path(root) / name).glob("**/*.ckpt"))}
        if case.get("export") and rank == 0:
            out = convert_to_lightning_checkpoint(
                Path(root) / name / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt", Path(root) / f"{name}.ckpt"
            )
            loaded = Regression.load_from_checkpoint(str(out))
            results[name]["exported"] = {key: value.clone() for key, value in loaded.state_dict().items()}
            results[name]["exported_hparams"] = dict(loaded.hparams)
        if case["strategy"] != "ddp":
            trainer.strategy.engine.close()
    return results


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, **extra}


CASES = [
    ("ddp", {"strategy": "ddp", "test_and_predict": True, "step_checkpoints": True}),
    ("ddp-resumed", {"strategy": "ddp", "resume": "ddp"}),
    ("stage-0", {"strategy": "zero", "config": _config(0, gradient_clipping="auto")}),
    ("stage-1", {"strategy": "zero", "config": _config(1, gradient_accumulation_steps="auto"), "export": True}),
    ("stage-2", {"strategy": "zero", "config": _config(2, gradient_accumulation_steps=ACCUMULATE),
                 "step_checkpoints": True}),
    ("stage-3", {"strategy": "zero", "config": _config(3), "test_and_predict": True, "step_checkpoints": True}),
    # Resumed from the checkpoint of step 3 (mid-epoch), saving every 3 steps again: Lightning saves
    # once more at step 3, on the first micro-batch after the restore, inside a window.
    *[(f"{source}-resumed-mid-epoch", {
        "strategy": "ddp" if source == "ddp" else "zero", "config": _config(int(source[-1])) if source != "ddp" else None,
        "resume_mid_epoch": source, "step_checkpoints": True,
    }) for source in ("ddp", "stage-2", "stage-3")],
    ("ddp-epoch-schedule", {"strategy": "ddp", "schedule": "epoch"}),
    ("stage-2-epoch-schedule", {"strategy": "zero", "config": _config(2), "schedule": "epoch"}),
    ("stage-2-resumed", {"strategy": "zero", "config": _config(2), "resume": "stage-2"}),
    ("stage-3-resumed-from-1", {"strategy": "zero", "config": _config(3), "resume": "stage-1"}),
    ("meta-3", {"strategy": "zero", "config": _config(3), "meta": True}),
    ("bf16-2", {"strategy": "zero", "config": _config(2, bf16={"enabled": "auto"}), "precision": "bf16-mixed"}),
    ("mismatch", {"strategy": "zero", "config": _config(1, gradient_accumulation_steps=4, gradient_clipping=1.0,
                                                        bf16={"enabled": True}), "expect_error": True}),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lightning")


@pytest.fixture(scope="module")
def runs(root: Path) -> dict[str, Any]:
    return run_on_ranks(2, lightning_runs, str(root), CASES, allow_numpy=True, backend=None, timeout=600)[0]


def resumed_on_more_ranks(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """``fit(ckpt_path=...)`` on 3 ranks from a 2-rank checkpoint at the end of its run's last
    epoch: nothing left to train, so the engine holds exactly what was saved."""
    from lightning.pytorch import Trainer

    from zero_engine.integrations.lightning import ZeroEngineStrategy

    model = _module_class()()
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=ZeroEngineStrategy(_config(3)), max_epochs=1,
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    train, _ = _data()
    trainer.fit(model, train, ckpt_path=checkpoint)
    return {"global_step": trainer.global_step, "weights": trainer.strategy.engine.full_state_dict()}


def _steps(rows: list, key: str) -> dict[int, float]:
    return {step: metrics[key] for step, metrics in rows if key in metrics}


def _assert_close(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for step in expected:
        assert math.isclose(got[step], expected[step], rel_tol=TOLERANCE, abs_tol=1e-6), (what, step, got, expected)


def _assert_weights_close(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key in expected:
        difference = (got[key] - expected[key]).abs().max().item()
        assert difference <= TOLERANCE, f"{what}: {key} differs by {difference:.2e}"


def test_lightning_ddp_resumed_from_its_checkpoint_reproduces_its_run(runs: dict) -> None:
    whole, resumed = runs["ddp"], runs["ddp-resumed"]
    tail = {step: value for step, value in _steps(whole["rows"], "train_loss").items() if step >= STEPS_PER_EPOCH}
    assert len(_steps(whole["rows"], "grad_norm")) == EPOCHS * STEPS_PER_EPOCH
    assert _steps(resumed["rows"], "train_loss") == tail  # exactly
    for key in whole["weights"]:
        assert (resumed["weights"][key] == whole["weights"][key]).all(), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_logs_and_ends_as_lightning_ddp(runs: dict, stage: int) -> None:
    ddp, zero = runs["ddp"], runs[f"stage-{stage}"]
    for key in ("train_loss", "grad_norm"):
        _assert_close(_steps(zero["rows"], key), _steps(ddp["rows"], key), f"stage {stage} {key}")
    _assert_weights_close(zero["weights"], ddp["weights"], f"stage {stage}")
    assert zero["val_loss"] == pytest.approx(ddp["val_loss"], abs=TOLERANCE)  # validate() through the engine


def test_test_and_predict_run_through_the_engine_at_stage_3(runs: dict) -> None:
    ddp, zero = runs["ddp"], runs["stage-3"]
    assert zero["test_loss"] == pytest.approx(ddp["test_loss"], abs=TOLERANCE)
    assert zero["predictions"].shape == ddp["predictions"].shape == (8, 1)  # this rank's half of 16 rows
    assert torch.allclose(zero["predictions"], ddp["predictions"], atol=TOLERANCE)


def test_clipping_was_in_play(runs: dict) -> None:
    norms = _steps(runs["ddp"]["rows"], "grad_norm").values()
    assert max(norms) > 0.5  # gradient_clip_val 0.5 clipped some step


@pytest.mark.parametrize("name, reference", [("stage-2-resumed", "stage-2"), ("stage-3-resumed-from-1", "stage-1")])
def test_a_resumed_run_reproduces_the_uninterrupted_one(runs: dict, name: str, reference: str) -> None:
    resumed, whole = runs[name], runs[reference]
    tail = {step: value for step, value in _steps(whole["rows"], "train_loss").items() if step >= STEPS_PER_EPOCH}
    if name == "stage-2-resumed":  # the same stage: exactly, as Lightning's DDP does
        assert _steps(resumed["rows"], "train_loss") == tail
        for key in whole["weights"]:
            assert (resumed["weights"][key] == whole["weights"][key]).all(), key
    else:
        _assert_close(_steps(resumed["rows"], "train_loss"), tail, name)
        _assert_weights_close(resumed["weights"], whole["weights"], name)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_run_resumed_mid_epoch_with_accumulation_trains_and_saves_as_ddp_resumed(runs: dict, stage: int) -> None:
    """From the checkpoint of step 3 of 6 in the first epoch (accumulation 2): the same losses and
    weights as Lightning's DDP resumed from its own, and every checkpoint saved again, the one
    Lightning takes inside the first window after the restore included."""
    ddp, zero = runs["ddp-resumed-mid-epoch"], runs[f"stage-{stage}-resumed-mid-epoch"]
    assert min(_steps(ddp["rows"], "train_loss")) == 3  # resumed at step 3
    _assert_close(_steps(zero["rows"], "train_loss"), _steps(ddp["rows"], "train_loss"), f"stage {stage} resumed")
    _assert_weights_close(zero["weights"], ddp["weights"], f"stage {stage} resumed mid-epoch")
    steps = [name for name in zero["saved"] if "step=" in name and name.startswith("epoch=") and "-v" not in name]
    assert zero["saved"] == ddp["saved"] and "epoch=0-step=3.ckpt" in steps and "epoch=1-step=12.ckpt" in steps


def test_an_epoch_schedule_drives_the_engine_optimizer(runs: dict) -> None:
    """A schedule stepped at each epoch's end (interval "epoch") stays Lightning's, rebound to the
    engine's optimizer: the second epoch trains at half the rate, as with DDP."""
    ddp, zero = runs["ddp-epoch-schedule"], runs["stage-2-epoch-schedule"]
    _assert_close(_steps(zero["rows"], "train_loss"), _steps(ddp["rows"], "train_loss"), "epoch schedule")
    _assert_weights_close(zero["weights"], ddp["weights"], "epoch schedule")
    assert _steps(ddp["rows"], "train_loss") != _steps(runs["ddp"]["rows"], "train_loss")  # the schedule acted


def test_configure_model_on_the_meta_device_trains_as_the_eager_build(runs: dict) -> None:
    _assert_close(_steps(runs["meta-3"]["rows"], "train_loss"), _steps(runs["ddp"]["rows"], "train_loss"), "meta")
    _assert_weights_close(runs["meta-3"]["weights"], runs["ddp"]["weights"], "meta")


def test_the_exported_checkpoint_loads_into_the_module_alone(runs: dict) -> None:
    exported = runs["stage-1"]["exported"]
    assert sorted(exported) == sorted(runs["ddp"]["weights"])
    assert runs["stage-1"]["exported_hparams"] == {"lr": 0.05, "weight_decay": 0.3, "meta": False, "schedule": "step"}
    assert any((exported[key] != runs["stage-1"]["weights"][key]).any() for key in exported), "epoch 0, not the end"


def test_a_config_that_disagrees_with_the_trainer_names_both(runs: dict) -> None:
    message = runs["mismatch"]["error"]
    assert "gradient_accumulation_steps = 4, but the Lightning Trainer has accumulate_grad_batches = 2" in message
    assert "gradient_clipping = 1.0, but the Lightning Trainer has gradient_clip_val = 0.5" in message
    assert "bf16.enabled = True, but the Lightning Trainer has precision='32-true' = False" in message


def test_bf16_mixed_runs_the_engine_in_bf16(runs: dict) -> None:
    """``precision="bf16-mixed"`` fills ``bf16.enabled: auto``: bf16 compute on fp32 masters
    (Lightning's DDP autocasts instead), so only bf16's precision is asked of the losses."""
    bf16, ddp = _steps(runs["bf16-2"]["rows"], "train_loss"), _steps(runs["ddp"]["rows"], "train_loss")
    assert sorted(bf16) == sorted(ddp)
    assert all(bf16[step] == pytest.approx(ddp[step], rel=5e-2, abs=2e-2) for step in ddp)
    assert bf16 != ddp
    assert {str(value.dtype) for value in runs["bf16-2"]["weights"].values()} == {"torch.float32"}


def test_a_checkpoint_resumes_at_another_stage_and_world_size(runs: dict, root: Path) -> None:
    from zero_engine import load_consolidated

    checkpoint = root / "stage-1" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    resumed = run_on_ranks(3, resumed_on_more_ranks, str(checkpoint), allow_numpy=True, backend=None, timeout=300)
    saved = load_consolidated(checkpoint)
    for result in resumed:
        assert result["global_step"] == STEPS_PER_EPOCH
        assert sorted(result["weights"]) == sorted(saved)
        for key in saved:
            assert (result["weights"][key] == saved[key]).all(), key


def test_the_strategy_names_are_registered_on_import() -> None:
    from lightning.pytorch import Trainer

    from zero_engine.integrations.lightning import ZeroEngineStrategy

    trainer = Trainer(strategy="zero_engine_stage_2", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ZeroEngineStrategy) and trainer.strategy.stage == 2


def test_stage_auto_builds_configure_model_eagerly() -> None:
    """Whether stage 3 (and so the meta device) fits is known only once the model exists."""
    from zero_engine.integrations.lightning import ZeroEngineStrategy

    strategy = ZeroEngineStrategy({"zero_optimization": {"stage": "auto", "memory_budget_gib": 1}})
    assert strategy.stage == "auto"
    with strategy.model_sharded_context():
        assert not torch.empty(1).is_meta
    with ZeroEngineStrategy({"zero_optimization": {"stage": 3}}).model_sharded_context():
        assert torch.empty(1).is_meta


def test_the_module_is_on_the_strategy_device_when_the_engine_is_built() -> None:
    """As DDPStrategy.setup does, the strategy moves a module built in ``__init__`` to its root
    device before the engine takes it (on a GPU the engine would otherwise keep it on the CPU);
    a module built on the meta device in ``configure_model`` is left to the engine."""
    from lightning.pytorch import Trainer

    from zero_engine.integrations.lightning import ZeroEngineStrategy

    events: list[tuple[str, Any]] = []

    class Recording(ZeroEngineStrategy):
        def model_to_device(self) -> None:
            events.append(("moved", self.root_device))
            super().model_to_device()

        def _build_engine(self, trainer: Any, module: Any) -> Any:
            events.append(("built", next(module.parameters()).device))
            return super()._build_engine(trainer, module)

    for meta, stage, expected in ((False, 2, ["moved", "built"]), (True, 3, ["built"])):
        events.clear()
        trainer = Trainer(accelerator="cpu", devices=1, strategy=Recording(_config(stage)), max_steps=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(_module_class()(meta=meta), train_dataloaders=_data()[0])
        assert [event for event, _ in events] == expected, (meta, events)
        assert events[-1][1] == (torch.device("meta") if meta else trainer.strategy.root_device), events
