"""``zero_optimization.stage: auto``: budgets that select each candidate (stages 0-3, then stage 3
with offload) on a small model at 2 ranks, the table logged on rank 0, training and checkpoints
equal to the chosen stage set by hand, a clear error when nothing fits; the table's figures
against the ZeRO formula written out by hand; `zero-engine estimate` printing the same table."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import make_model, train_engine
from zero_engine import ConfigError, load_config, load_consolidated
from zero_engine.param_groups import resolve_param_groups
from zero_engine.sharding.units.module_plan import ModulePlan
from zero_engine.stage_choice import GIB, candidates

WORLD, MICRO = 2, 2
ZERO = {"reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0, "activation_memory_gib": 0.0}


def _config(stage: Any, budget: float | None = None) -> dict[str, Any]:
    return engine_config(stage, micro=MICRO, lr=0.01, accum=1, memory_budget_gib=budget, **ZERO)


def _table() -> list[Any]:
    config = load_config(_config("auto", 1.0))
    model = make_model()
    groups = resolve_param_groups(model, None, torch.optim.AdamW)
    num_params = sum(p.numel() for group in groups for p in group.params)
    largest = ModulePlan(model, groups, config.zero_optimization).largest_unit_numel()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # counted as stored, as initialize does
    return candidates(config, num_params, WORLD, largest, frozen), num_params


def test_the_table_is_the_zero_formula_plus_the_largest_unit() -> None:
    table, p = _table()
    n = WORLD
    unit = max(sum(q.numel() for q in [*plan.params, *plan.frozen_params]) for plan in _plans()) * 4
    f = sum(q.numel() for q in make_model().parameters() if not q.requires_grad)  # the frozen layer: stored only
    # fp32 AdamW, per rank: parameters 4, gradients 4, optimizer state 8 bytes per parameter,
    # sharded from stage 3, 2 and 1 on; offloaded: an fp32 host master, gradient and state.
    expected = {
        "stage 0": 4 * p + 4 * p + 8 * p + 4 * f,
        "stage 1": 4 * p + 4 * p + 8 * p // n + 4 * f,
        "stage 2": 4 * p + 4 * p // n + 8 * p // n + 4 * f,
        "stage 3": 4 * p // n + 4 * p // n + 8 * p // n + unit + 4 * f // n,
        "stage 3 + offload_optimizer": 4 * p // n + unit + 4 * f // n,
        "stage 3 + offload_optimizer + offload_param": unit,
    }
    assert {c.name: c.device for c in table} == expected
    offloaded = 4 * p // n * 2 + 8 * p // n
    assert [c.host for c in table][-2:] == [offloaded, offloaded + 4 * f // n]  # fp32: the master is the shard


def test_the_gathered_unit_is_counted_in_the_compute_dtype() -> None:
    """Stage 3 gathers a unit in the compute dtype: 2 bytes per parameter in bf16 and fp16, 4 in
    fp32 (nothing below stage 3)."""
    for dtype, size in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        raw = {"bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
               "zero_optimization": {"stage": "auto", "memory_budget_gib": 1}}
        gathered = {c.name: c.gathered for c in candidates(load_config(raw), 10**6, WORLD, 12_345)}
        assert gathered == {name: 12_345 * size if name.startswith("stage 3") else 0 for name in gathered}, dtype


def _plans() -> list[Any]:
    from zero_engine.sharding.units.module_plan import plan_module_units

    model = make_model()
    groups = resolve_param_groups(model, None, torch.optim.AdamW)
    return plan_module_units(model, groups, None, ZERO["reduce_bucket_size"], 0)[0]


def chosen_stages(rank: int, world_size: int, budgets: list[float], directory: str) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zero_engine").addHandler(handler)
    logging.getLogger("zero_engine").setLevel(logging.INFO)
    chosen = []
    for budget in budgets:
        engine = zero_engine.initialize(make_model(), _config("auto", budget))
        chosen.append((engine.stage.level, engine.offload.optimizer, engine.offload.params))
        engine.close()
    # Ranks with different budgets (GPUs whose free memory differs) agree on the smallest:
    # rank 1's would fit stage 1, rank 0's only stage 2 (GPU review N7).
    engine = zero_engine.initialize(make_model(), _config("auto", budgets[1] if rank == 1 else budgets[2]))
    out: dict[str, Any] = {"differing": engine.stage.level}
    engine.close()
    out.update(chosen=chosen, log=[r for r in records if "stage = 'auto'" in r])
    runs = {}
    for name, config in (("auto", _config("auto", budgets[2])), ("by hand", _config(2))):
        engine = zero_engine.initialize(make_model(), config)
        losses, _ = train_engine(engine, rank, world_size, range(3), MICRO, 1)
        engine.save_checkpoint(Path(directory) / name)
        runs[name] = {"losses": losses, "state": engine.full_state_dict()}
        engine.close()
    out["runs"] = runs
    try:
        zero_engine.initialize(make_model(), _config("auto", 1e-9))
    except ConfigError as err:
        out["too_small"] = str(err)
    return out


def test_budgets_choose_each_candidate_and_training_equals_that_stage_by_hand(tmp_path: Path) -> None:
    table, _ = _table()
    devices = [c.device for c in table]
    assert devices == sorted(devices, reverse=True) and len(set(devices)) == len(devices), devices
    budgets = [(device + 0.5) / GIB for device in devices]  # each candidate just fits, the ones before do not
    results = run_on_ranks(WORLD, chosen_stages, budgets, str(tmp_path))
    expected = [(0, False, False), (1, False, False), (2, False, False), (3, False, False), (3, True, False),
                (3, True, True)]
    for result in results:
        assert result["chosen"] == expected and result["differing"] == 2
        assert result["too_small"].startswith("zero_optimization.stage = 'auto': nothing fits the budget of")
        assert "Raise memory_budget_gib" in result["too_small"]
        assert result["runs"]["auto"]["losses"] == result["runs"]["by hand"]["losses"]
        for key, value in result["runs"]["by hand"]["state"].items():
            assert torch.equal(result["runs"]["auto"]["state"][key], value), key
    log = results[0]["log"]
    assert len(log) == len(budgets) + 1  # one table per initialize, rank 0 alone
    assert "the smallest of the ranks' (rank 0's)" in log[-1] and "chose stage 2" in log[-1]
    assert log[2].startswith("zero_optimization.stage = 'auto' chose stage 2 for a budget of")
    assert all(c.name in log[2] for c in table) and "[chosen]" in log[2] and "[too large]" in log[2]
    assert not results[1]["log"]
    auto, by_hand = load_consolidated(tmp_path / "auto"), load_consolidated(tmp_path / "by hand")
    assert sorted(auto) == sorted(by_hand) and all(torch.equal(auto[k], by_hand[k]) for k in auto)


def test_stage_auto_on_cpu_needs_a_budget() -> None:
    with pytest.raises(ConfigError, match="stage = 'auto' needs zero_optimization.memory_budget_gib"):
        zero_engine.initialize(make_model(), _config("auto"))
    with pytest.raises(ConfigError, match="chooses offload itself"):
        config = _config("auto", 1.0)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        zero_engine.initialize(make_model(), config)


def test_estimate_prints_the_table_initialize_weighs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from zero_engine.cli import main
    from zero_engine.stage_choice import choose, format_table

    zero = {"stage": "auto", "memory_budget_gib": 40, "activation_memory_gib": 4}
    raw = {"bf16": {"enabled": True}, "zero_optimization": zero}
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(raw))
    assert main(["estimate", str(path), "--params", "7e9", "--world-size", "8", "--largest-unit", "2e8"]) == 0
    printed = capsys.readouterr().out
    table = candidates(load_config(raw), 7 * 10**9, 8, 2 * 10**8)
    assert format_table(table, 40 * GIB, choose(table, 40 * GIB)) in printed
    assert "initialize would choose stage 1" in printed
    assert "stage 0                                       108.308 GiB = states 104.308 GiB" in printed  # 16 B/param
