"""The README's main job under a real torchrun (env:// rendezvous), a few steps, every stage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _main_job(config: str) -> dict[str, float]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / config),
        "--steps", "10", "--eval-batches", "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"stage {config[4]} on 2 rank(s) (gloo)" in done.stdout
    step = re.search(r"\[zero_engine\] step 10 \| loss (\d+\.\d+) \| lr [^|]+ \| grad norm (\d+\.\d+)", done.stdout)
    assert step, done.stdout
    held_out = re.search(r"held-out loss (\d+\.\d+) nats \(unigram baseline (\d+\.\d+)", done.stdout)
    # ten steps learn little: the line says the bar and why (all the --steps asked ran)
    assert "not yet 0.5 nats below it, the bar for learned: all 10 --steps ran" in done.stdout, done.stdout[-500:]
    return {
        "loss": float(step.group(1)),
        "grad_norm": float(step.group(2)),
        "held_out": float(held_out.group(1)),
        "unigram": float(held_out.group(2)),
    }


@pytest.mark.parametrize(  # the fast run: stages 0 and 3, the ends; the slow run adds 1 and 2
    "stages", [(0, 3), pytest.param((0, 1, 2), marks=pytest.mark.slow)], ids=["0-3", "0-1-2"]
)
def test_train_script_under_torchrun_is_the_same_run_at_every_stage(stages: tuple[int, ...]) -> None:
    """The README's main job at stages 0-3 (the shipped configs differ in the stage alone): the
    same training loss, gradient norm and held-out loss at every stage, as printed (the engine's
    progress line, and the script's end; the stages sum gradients in different orders, a few 1e-6
    apart). Ten steps take
    the held-out loss from ln(256) = 5.55 (uniform prediction) to near the corpus's unigram
    entropy, which the script computes from byte counts alone (3.42 against 3.32 when written)."""
    runs = {f"zero{stage}.yaml": _main_job(f"zero{stage}.yaml") for stage in stages}
    first = runs["zero0.yaml"]
    for config, run in runs.items():
        assert run["loss"] == pytest.approx(first["loss"], abs=2e-3), runs
        assert run["grad_norm"] == pytest.approx(first["grad_norm"], abs=2e-2), runs
        assert run["held_out"] == pytest.approx(first["held_out"], abs=2e-3), runs
    assert first["held_out"] < first["unigram"] + 0.25, runs


def test_big_model_script_trains_from_meta_under_a_memory_limit() -> None:
    """The README's larger-than-a-rank run, on the small GPT so that it takes seconds."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "scripts" / "big_model.py"), "--model", "small", "--budget-mib", "400", "--steps", "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"^rank (\d): .*meta build \+ initialize .* losses (\d+\.\d+) (\d+\.\d+)$", done.stdout, re.M)
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], done.stdout
    for _, first, second in lines:
        assert 4.0 < float(first) < 6.0 and 4.0 < float(second) < 6.0, "a byte-level GPT starts near ln(256) = 5.55"


def test_train_script_forces_collectives_at_one_rank_when_asked() -> None:
    """``--force-collectives`` (GPU review N9): one rank runs every collective through a group of
    one, as a first run on one GPU needs (that without it a rank alone issues none, and that the
    forced run trains the same, is tests/test_gpu_readiness.py's, without a script)."""
    for flag, expected in ((["--force-collectives"], "(gloo, collectives forced)"),):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(ROOT / "scripts" / "train.py"), "--steps", "1", "--eval-batches", "1", *flag,
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"stage 1 on 1 rank(s) {expected}" in done.stdout, done.stdout


def _readme_loop() -> str:
    """The README's first training loop, as a user pastes it into a script (no close())."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return re.search(r"<!-- runnable -->\n```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.parametrize("runs", [1, pytest.param(25, marks=pytest.mark.slow)])
def test_the_readme_loop_exits_cleanly_on_two_ranks(tmp_path: Path, runs: int) -> None:
    """Issue 65: the README's loop, pasted into a script (no close()), aborted at exit in 1 run
    in 5 under torchrun on 2 ranks ("terminate called without an active exception": a gloo
    thread letting go of the last collective's tensors, which takes the GIL, once Python was
    finalizing). Every run exits 0 on both ranks (25 runs in the slow run; with the cause put
    back, two of three tries of 25 aborted, after 7 and 6 runs: a race, which the fast run's one
    run rarely sees)."""
    script = tmp_path / "loop.py"
    script.write_text(_readme_loop())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for run in range(runs):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0 and "terminate called" not in done.stderr, (run, done.stderr[-2000:])
