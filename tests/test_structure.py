"""The package's structure, as `scripts/structure_metrics.py` reads it: no count of ranks taken
from the world size outside `comm/` (the mesh answers by use, so a new axis changes the mesh
alone)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _metrics():
    spec = importlib.util.spec_from_file_location("structure_metrics", ROOT / "scripts" / "structure_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_world_size_outside_comm():
    metrics = _metrics()
    found = []
    for path in sorted((ROOT / "zero_engine").rglob("*.py")):
        relative = path.relative_to(ROOT / "zero_engine").as_posix()
        if relative.startswith(("comm/", "testing/")):
            continue
        found += [f"{relative}:{line}" for line in metrics._world_size_reads(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_sees_each_kind_of_read():
    reads = _metrics()._world_size_reads(ast.parse(
        "def f(world_size):\n    x = world_size\n    y = self.comm.world_size\n    z = comm.world_size\n"
        "    w = group.world_size\n"
    ))
    assert reads == [1, 2, 3, 4]  # a group's own size (line 5) is its size, not a degree
