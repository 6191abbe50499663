"""DeepSpeed's monitor sections: the CSV rows and TensorBoard events read back hold the values
the engine reported (loss, learning rate, gradient norm, fp16 loss scale) against samples seen,
written by rank 0 alone; a monitor whose package is missing fails at initialize."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import decay_groups, make_model, micro_batch
from zero_engine import ConfigError

MICRO, ACCUM, STEPS = 2, 2, 3


def monitored(rank: int, world_size: int, directory: str) -> dict:
    config = engine_config(2, micro=MICRO, lr=0.01, accum=ACCUM, dtype="fp16", fp16={"initial_scale_power": 8})
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4}}
    for section in ("csv_monitor", "tensorboard"):
        config[section] = {"enabled": True, "output_path": str(Path(directory) / f"rank{rank}"), "job_name": "run"}
    model = make_model()
    engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
    reported: dict[str, list] = {"loss": [], "lr": [], "grad_norm": [], "loss_scale": []}
    for step in range(STEPS):
        losses = []
        for micro in range(ACCUM):
            loss = engine(*micro_batch(step, micro, rank, world_size, MICRO, ACCUM))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        reported["loss"].append(sum(losses) / ACCUM)
        reported["lr"].append(engine.get_lr()[0])
        reported["grad_norm"].append(engine.get_global_grad_norm())
        reported["loss_scale"].append(engine.loss_scale)
    samples = engine.batch.train_batch_size
    engine.close()
    return {"reported": reported, "samples": samples}


def _csv(path: Path) -> list[tuple[int, float]]:
    with path.open() as handle:
        rows = list(csv.reader(handle))
    return [(int(step), float(value)) for step, value in rows[1:]]


def test_csv_and_tensorboard_hold_what_the_engine_reported(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_on_ranks(2, monitored, str(tmp_path), allow_numpy=True)  # TensorBoard's writer uses numpy
    rank0 = results[0]
    steps = [rank0["samples"] * (step + 1) for step in range(STEPS)]
    names = {"loss": "Train/Samples/train_loss", "lr": "Train/Samples/lr", "grad_norm": "Train/Samples/grad_norm",
             "loss_scale": "Train/Samples/loss_scale"}
    events = EventAccumulator(str(tmp_path / "rank0" / "run"))
    events.Reload()
    for key, name in names.items():
        expected = list(zip(steps, rank0["reported"][key]))
        written = _csv(tmp_path / "rank0" / "run" / (name.replace("/", "_") + ".csv"))
        assert [s for s, _ in written] == steps, name
        assert [v for _, v in written] == pytest.approx([v for _, v in expected], rel=1e-6), name
        scalars = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in scalars] == steps, name
        assert [v for _, v in scalars] == pytest.approx([v for _, v in expected], rel=1e-6), name  # float32 in events
    assert not (tmp_path / "rank1").exists(), "only rank 0 writes"


@pytest.mark.parametrize("section, package", [("wandb", "wandb"), ("comet", "comet_ml")])
def test_a_monitor_without_its_package_fails_at_initialize(
    section: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # not importable, whether installed here or not
    config = engine_config(1, micro=MICRO, lr=0.01)
    config[section] = {"enabled": True}
    with pytest.raises(ConfigError, match=rf"{section}.enabled = true needs the {package} package"):
        zero_engine.initialize(make_model(), config)
    config[section] = {"enabled": False}  # switched off: silent
    zero_engine.initialize(make_model(), config).close()


PROGRESS_SCRIPT = """
import logging, sys
import torch
import zero_engine
{logging}
class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)
    def forward(self, input_ids):
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), input_ids.roll(1, 1).reshape(-1))
torch.manual_seed(0)
config = {{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
          "wall_clock_breakdown": True, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
          "zero_optimization": {{"stage": 3}}}}
engine = zero_engine.initialize(TinyLM(), config)
losses = []
for micro in range(8):
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(micro))
    loss = engine(input_ids=ids)
    losses.append(loss.item())
    engine.backward(loss)
    engine.step()
print("MEANS", sum(losses[:4]) / 4, sum(losses[4:]) / 4)
"""


@pytest.mark.parametrize("logging_set_up", ["none", "warning", "info"])
def test_the_progress_line_is_seen_by_default_and_follows_the_applications_logging(
    tmp_path: Path, logging_set_up: str
) -> None:
    """Issue 65: with steps_per_print, rank 0 prints a line every that many optimizer steps: the
    step, its window's mean loss (as the script computes it), the learning rate, the gradient
    norm, samples/s and tokens/s, and with wall_clock_breakdown the phases' times; on stdout when
    the application configured no logging, through its handlers (at its level) when it did."""
    import subprocess

    setup = {"none": "", "warning": "logging.basicConfig(level=logging.WARNING)",
             "info": "logging.basicConfig(level=logging.INFO)"}[logging_set_up]
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS_SCRIPT.format(logging=setup))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    means = [float(value) for value in done.stdout.split("MEANS ")[1].split()]
    out = done.stdout if logging_set_up == "none" else done.stderr
    lines = [line for line in out.splitlines() if "step 2 |" in line or "step 4 |" in line]
    if logging_set_up == "warning":
        assert lines == [] and "zero_engine" not in done.stdout, (done.stdout, done.stderr)
        return
    prefix = "[zero_engine] " if logging_set_up == "none" else "INFO:zero_engine:"
    assert len(lines) == 2 and all(line.startswith(prefix) for line in lines), (done.stdout, done.stderr)
    for line, mean in zip(lines, means):
        fields = dict(part.rsplit(" ", 1) for part in line[len(prefix):].split(" | ") if " " in part)
        assert float(fields["loss"]) == pytest.approx(mean, abs=1e-4), (line, mean)
        assert fields["lr"] == "1.00e-03" and float(fields["grad norm"]) > 0, line
        assert "samples/s" in line and "tokens/s" in line, line
    assert all(re.search(rf"\| {phase} \d+\.\d ms", line) for line in lines for phase in ("forward", "backward", "step"))


def test_the_progress_lines_rates_are_the_steps_samples_and_tokens_over_the_seconds(monkeypatch) -> None:
    """Reliability review N21, N22: samples/s = steps x train_batch_size / seconds; tokens/s =
    the tokens a rank's forwards were given x the data-parallel ranks (not the world: the ranks of
    a sequence group read one batch) / seconds. A clock that reads 0, then 1 second at the line."""
    import torch

    from zero_engine import progress

    clock = iter([0.0, 1.0, 1.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    line = progress.Progress(every=2, breakdown=False, train_batch_size=8, data_ranks=3,
                             device=torch.device("cpu"), printing=True)
    for step in range(2):
        line.add_inputs((), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
        said = line.after_step(step + 1, [1e-3], 0.5, None, 0)
    assert said is not None
    assert "16.0 samples/s" in said  # 2 steps x 8 samples in 1 s
    assert "192 tokens/s" in said  # 2 forwards x 32 tokens x 3 data-parallel ranks in 1 s
