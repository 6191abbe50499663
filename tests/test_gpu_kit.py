"""``scripts/gpu_check.sh --dry-run``: the GPU kit's plumbing on a CPU, so the ten minutes of
a first GPU run are not lost to a missing import or a step that never starts. It installs the
wheels it is given (as the GPU image needs pydantic and hjson from ``.whl``), imports from them,
collects each step's CUDA tests and runs the benchmark with collectives forced at one rank."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson")


def _kit(tmp_path: Path, wheels: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WHEELS": str(wheels), "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True, timeout=400,
        env=env,
    )


def test_the_gpu_kit_reaches_every_step_on_wheels_alone(tmp_path: Path) -> None:
    """This interpreter's wheels of the versions installed here, as prepare_wheels.sh fetches
    the GPU image's."""
    wheels = tmp_path / "whl"
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *specs],
        check=True, capture_output=True, timeout=300,
    )
    done = _kit(tmp_path, wheels)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "== steps reached: 6 of 6 (dry); failed: none" in done.stdout
    versions = (tmp_path / "out" / "versions.log").read_text()
    for module in ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson"):
        assert f"\n{module} " in f"\n{versions}" and "from the wheels" in versions, versions
    for step, tests in (("cuda_nccl", 6), ("allocator", 1), ("lightning", 1)):
        assert f"{tests}/" in (tmp_path / "out" / f"{step}.log").read_text(), step  # "6/11 tests collected"
    bench = json.loads((tmp_path / "out" / "bench-tiny.json").read_text())
    assert sorted(bench["systems"]) == ["ddp", "engine3+opt", "fsdp2"]


def test_the_gpu_kit_stops_at_once_without_wheels(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = _kit(tmp_path, tmp_path / "empty")
    assert done.returncode == 2 and "prepare_wheels.sh" in done.stdout
