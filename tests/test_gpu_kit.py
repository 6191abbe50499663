"""``scripts/gpu_check.sh --dry-run``: the GPU kit's plumbing on a CPU, so the minutes of a
first GPU run are not lost to a missing import or a step that never starts. It installs the
wheels it is given (as the GPU image needs pydantic and hjson from ``.whl``), imports from them,
collects each step's CUDA tests and runs the benchmarks (bench.py with collectives forced at one
rank, bench_lora.py's memory and speed) on a tiny model. The kit fits the device tool's limits:
its step budgets inside one 600 s command, at most 7 files back from ``$OUT`` (the tool returns 8)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from repo_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "hjson")
KIT = ROOT / "scripts" / "gpu_check.sh"


def _kit(tmp_path: Path, wheels: Path, steps: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "WHEELS": str(wheels), "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(KIT), "--dry-run", *steps], capture_output=True, text=True, timeout=400, env=env,
    )


ALL_STEPS = ("versions", "sidestream", "cuda", "gpt300m", "compile", "lora")  # "every step"
NAMED_ONLY = ("longseq",)  # run when named alone


@pytest.mark.parametrize(  # the fast run: the wheels and one pytest step (the benchmarks' plumbing ran on an
    # H100 on 2026-11-28; the slow run dries every step); the CUDA tests' import is the main suite's collection
    "steps", [("sidestream", "longseq"), pytest.param((), marks=pytest.mark.slow)], ids=["some", "all"]
)
def test_the_gpu_kit_reaches_every_step_on_wheels_alone(tmp_path: Path, steps: tuple[str, ...]) -> None:
    """This interpreter's wheels of the versions installed here, as prepare_wheels.sh fetches
    the GPU image's."""
    wheels = tmp_path / "whl"
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *specs],
        check=True, capture_output=True, timeout=300,
    )
    done = _kit(tmp_path, wheels, steps)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    ran = ("versions", *steps) if steps else ALL_STEPS
    assert f"== steps reached: {len(ran)} (dry); failed: none" in done.stdout
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == sorted(f"{step}.log" for step in ran)
    versions = (out / "versions.log").read_text()
    for module in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "hjson"):
        assert f"\n{module} " in f"\n{versions}" and "from the wheels" in versions, versions
    if "cuda" in ran:  # "16/18 tests collected (2 deselected)": every CUDA test but the two timing ones
        cuda = (out / "cuda.log").read_text()
        selected, total = map(int, re.search(r"(\d+)/(\d+) tests collected", cuda).groups())
        assert total - selected == 2 and total >= 18, cuda
    if "gpt300m" in ran:
        runs = (out / "gpt300m.log").read_text()  # the timed job's JSON, then the engine's --rss line
        timed = json.loads(runs.split("\n{", 1)[1].split("\n}", 1)[0].join("{}"))
        assert timed["dtype"] == "bf16" and sorted(timed["systems"]) == ["ddp", "engine3", "fsdp2"], timed
        alone = json.loads(next(line for line in runs.splitlines() if '"system": "engine3"' in line))
        assert alone["memory_report"]["master_parameters"] > 0, alone  # bf16 indeed: fp32 masters beside
    if "sidestream" in ran:  # the side stream's two variants alone
        assert re.search(r"\b2/\d+ tests collected", (out / "sidestream.log").read_text())
    if "longseq" in ran:  # the table, plain and tiled, and the JSON line (on a CPU: both climb to --max-tokens)
        longseq = (out / "longseq.log").read_text()
        assert "| plain | 512 (stopped by --max-tokens) |" in longseq and "| tiled (64 tokens a tile) |" in longseq
        assert '"tiled_at_plain_longest": {"tokens": 512' in longseq, longseq[-2000:]
    if "lora" in ran:
        lora = (out / "lora.log").read_text()  # a memory row, then the step-time table with FSDP2 and int8
        assert "| stage 3 int8 frozen, bf16 base |" in lora and "| FSDP2 |" in lora
        assert "| stage 3 int8 frozen |" in lora


def test_the_kits_step_budgets_fit_one_command() -> None:
    """GPU review K2: the device tool runs one command for at most 600 s; the steps' timeouts
    (each step's second argument) must add up to less, with room for the start."""
    text = KIT.read_text()
    budgets = dict(re.findall(r"^\s*(?:pytest_step|bench|step) (\S+) (\d+)\b", text, re.M))
    budgets = {name: int(seconds) for name, seconds in budgets.items()}
    every = [seconds for name, seconds in budgets.items() if name not in NAMED_ONLY]
    assert len(every) >= 6 and sum(every) <= 580, budgets
    for name in NAMED_ONLY:  # a call of its own, after the wheels
        assert budgets["versions"] + budgets[name] <= 580, budgets


def test_the_gpu_kit_stops_at_once_without_wheels(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = _kit(tmp_path, tmp_path / "empty")
    assert done.returncode == 2 and "prepare_wheels.sh" in done.stdout


# -- scripts/longest_sequence.py: the kit's longseq step (issue 67's figure on a GPU) ------------

@pytest.mark.parametrize("edge", [9_500, 10_000, 10_700, 4_000, 30_000])
def test_the_longest_sequence_search_finds_the_edge_from_either_side(edge: int) -> None:
    """A device whose step runs out of memory beyond ``edge`` tokens, its peak on a line that
    crosses the budget at about 10,000 tokens: the search answers the edge (to its grain) whether
    the line's guess is short of it, past it, or far past it, trying lengths near it only."""
    script = load_script("longest_sequence")
    budget = 2**30
    tried: list[int] = []

    def fake_try(args: Any, device: Any, tiles: int, length: int, steps: int) -> dict | None:
        tried.append(length)
        if length > edge:
            return None
        return {"tokens": length, "peak_bytes": 1000 + length * (budget // 10_000), "step_s": 0.1, "loss": 1.0}

    script.try_length = fake_try
    args = argparse.Namespace(start=1000, grain=100, max_tokens=1 << 20, steps=0, budget_gib=1.0)
    found = script.longest(args, torch.device("cpu"), 0, deadline=time.monotonic() + 60)
    assert found["tokens"] == edge // 100 * 100 and found["stopped_by"] == "", (found, tried)
    assert len(tried) <= 2 + 2 * math.ceil(math.log2(2 + abs(edge - 10_000) / 100)) + 2, tried  # gallop, halve
    tried.clear()
    late = script.longest(args, torch.device("cpu"), 0, deadline=time.monotonic() - 1)  # out of time
    assert late["stopped_by"] == "the time limit" and late["tokens"] <= edge, late
