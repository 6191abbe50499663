"""The README's main job under a real torchrun (env:// rendezvous), a few steps, every stage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config", ["zero0.yaml", "zero1.yaml", "zero2.yaml", "zero3.yaml"])
def test_train_script_under_torchrun(config: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / config),
        "--steps", "10", "--eval-batches", "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"stage {config[4]} on 2 rank(s) (gloo)" in done.stdout
    assert re.search(r"step   10  loss \d+\.\d+", done.stdout), done.stdout
    held_out = float(re.search(r"held-out loss (\d+\.\d+)", done.stdout).group(1))
    assert 0 < held_out < 5.6, "ten steps from ln(256) = 5.55 should not make the loss worse"


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
