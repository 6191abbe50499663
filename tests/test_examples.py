"""The examples under ``examples/`` (issue 65: the LoRA and TRL guides could not run as written):
each one's ``main()`` on 2 CPU ranks with torchrun's environment, as its launch line runs it,
all four in one spawn (importing transformers, datasets and TRL costs seconds per process).
Each must train, end with a finite loss and leave its adapters in PEFT's layout."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from harness import run_on_ranks

pytest.importorskip("trl", reason="the [trl] extra: pip install -e '.[trl]' (the [test] extra includes it)")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ("lora_peft", "trl_sft", "trl_dpo", "long_sequences")
ADAPTERS = ("lora_peft", "trl_sft", "trl_dpo")  # those that leave adapters in PEFT's layout


def run_examples(rank: int, world: int, out: str) -> dict[str, float]:
    import importlib

    sys.path.insert(0, str(EXAMPLES))
    return {name: importlib.import_module(name).main(["--out", f"{out}/{name}"]) for name in NAMES}


def test_every_example_runs_on_two_ranks(tmp_path: Path) -> None:
    losses = run_on_ranks(2, run_examples, str(tmp_path), allow_numpy=True, backend=None, timeout=400)
    for rank, per_example in enumerate(losses):
        assert all(math.isfinite(loss) for loss in per_example.values()), (rank, per_example)
    for name in ADAPTERS:
        written = sorted(path.name for path in (tmp_path / name).glob("adapter_*"))
        assert written == ["adapter_config.json", "adapter_model.safetensors"], (name, written)
    for name in NAMES:  # each file says how it is launched, as examples/README.md does
        assert f"torchrun --standalone --nproc_per_node=2 examples/{name}.py" in (EXAMPLES / f"{name}.py").read_text()


def test_the_long_sequences_example_runs_as_its_launch_line_says(tmp_path: Path) -> None:
    """Issue 82: run as its own launch line runs it (no ``--out``), each rank made a temporary
    directory of its own and ``save_checkpoint`` raised. The line, word for word, from the
    repository's root; the default directory is one path on every rank (under ``TMPDIR``)."""
    import os
    import subprocess

    line = "torchrun --standalone --nproc_per_node=2 examples/long_sequences.py"
    assert line in (EXAMPLES / "long_sequences.py").read_text()
    command = [sys.executable, "-m", "torch.distributed.run", *line.split()[1:]]
    done = subprocess.run(command, cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checkpoint in {tmp_path / 'zero_engine_long_sequences'}" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "zero_engine_long_sequences" / "latest").exists()
