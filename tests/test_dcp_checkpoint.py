"""DCP checkpoints both ways (issue 86): FSDP2 at 2 ranks trains 5 AdamW steps and saves in
torchtitan's layout; the engine at stages 0-3 and worlds 1-3 loads it and trains 5 more, equal to
FSDP2's own 5 more. The reverse: the engine saves with ``format="dcp"`` and FSDP2 (``dcp.load``
into a fresh ``fully_shard`` model and AdamW) continues as the engine does. A DCP checkpoint of
another model or optimizer is refused on every rank before any weight changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_engine
from harness import run_on_ranks

STEPS, GLOBAL_BATCH, TOL = 5, 6, 2e-5


def make_net(seed: int = 0) -> nn.Module:
    """Plain model code, shapes that cut flat shards mid-row at every world size."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 3))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def global_loss(loss: torch.Tensor) -> float:
    value = loss.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


# -- FSDP2 ------------------------------------------------------------------------------------


def fsdp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def fsdp_run(rank: int, world: int, root: str, tags: list[str], save: bool) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per linear layer and the root, AdamW): with ``save``, 5 steps then a
    save as torchtitan's checkpointer writes it, then 5 more; else from each of ``tags``, 5 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_net(seed)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = batch(step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(global_loss(loss))
        return losses

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}

    out: dict[str, Any] = {}
    if save:
        model, optimizer = build(0)
        out["before"] = train(model, optimizer, range(STEPS))
        dcp.save(fsdp_state(model, optimizer), checkpoint_id=f"{root}/fsdp")
        out["saved"] = full(model)
        out["after"] = train(model, optimizer, range(STEPS, 2 * STEPS))
        out["params"] = full(model)
        return out
    for tag in tags:
        model, optimizer = build(1)  # other weights: only the load makes them the saved ones
        state = fsdp_state(model, optimizer)
        dcp.load(state, checkpoint_id=f"{root}/{tag}")
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        out[tag] = {"after": train(model, optimizer, range(STEPS, 2 * STEPS)), "params": full(model)}
    return out


# -- the engine ---------------------------------------------------------------------------------


def engine_config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},  # the checkpoint's options win
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}, "gradient_clipping": 0.0,  # as FSDP2 trains
    }


def engine_train(engine: Any, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss))
    return losses


def engine_resumes(rank: int, world: int, root: str, stages: list[int]) -> dict[int, Any]:
    """At each stage: the engine loads FSDP2's checkpoint and trains 5 steps."""
    out = {}
    for stage in stages:
        engine = zero_engine.initialize(make_net(2), engine_config(stage, world))
        engine.load_checkpoint(root, tag="fsdp")
        out[stage] = {"after": engine_train(engine, rank, world, range(STEPS, 2 * STEPS)),
                      "params": engine.full_state_dict(), "step": engine.global_step}
        engine.close()
    return out


def engine_saves(rank: int, world: int, root: str, stages: list[int]) -> dict[int, Any]:
    """At each stage: 5 steps, a DCP save, 5 more; and the engine resuming from that save."""
    out = {}
    for stage in stages:
        engine = zero_engine.initialize(make_net(0), {**engine_config(stage, world),
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}})
        engine_train(engine, rank, world, range(STEPS))
        engine.save_checkpoint(root, tag=f"s{stage}w{world}", format="dcp")
        after = engine_train(engine, rank, world, range(STEPS, 2 * STEPS))
        out[stage] = {"after": after, "params": engine.full_state_dict()}
        engine.close()
        resumed = zero_engine.initialize(make_net(3), engine_config(stage, world))
        resumed.load_checkpoint(root, tag=f"s{stage}w{world}")
        out[stage]["resumed"] = engine_train(resumed, rank, world, range(STEPS, 2 * STEPS))
        out[stage]["step"] = resumed.global_step
        resumed.close()
    return out


def refusals(rank: int, world: int, root: str) -> dict[str, Any]:
    """A DCP checkpoint that does not fit, each way: refused on every rank, naming the key, the
    engine's weights untouched; ``weights=`` takes the model part alone."""
    found: dict[str, Any] = {}
    wider = nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11), nn.GELU(), nn.Linear(11, 5), nn.Tanh(), nn.Linear(5, 3))
    deeper = nn.Sequential(*make_net(2), nn.Linear(3, 3))
    sgd = {**engine_config(3, world), "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    for case, model, config in [("re-shaped", wider, engine_config(3, world)), ("missing", deeper, engine_config(1, world)),
                                ("optimizer", make_net(2), sgd)]:
        engine = zero_engine.initialize(model, config)
        before = engine.full_state_dict()
        try:
            engine.load_checkpoint(root, tag="fsdp")
            found[case] = "accepted"
        except zero_engine.CheckpointError as err:
            found[case] = str(err)
        after = engine.full_state_dict()
        found[f"{case} untouched"] = all(torch.equal(before[name], after[name]) for name in before)
        engine.close()
    engine = zero_engine.initialize(make_net(2), engine_config(2, world), weights=f"{root}/fsdp")
    found["weights"] = engine.full_state_dict()
    engine.close()
    return found


def assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(ours) == sorted(theirs), what
    for name in theirs:
        gap = (ours[name].float() - theirs[name].float()).abs().max().item()
        assert gap <= TOL, f"{what}: {name} off by {gap}"


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("dcp")
    return root, run_on_ranks(2, fsdp_run, str(root), [], True, allow_numpy=True)[0]


@pytest.mark.parametrize("world", [2, pytest.param(1, marks=pytest.mark.slow), 3])
def test_the_engine_resumes_fsdp2s_checkpoint_at_every_stage(fsdp_saved: tuple[Path, dict[str, Any]], world: int) -> None:
    root, fsdp = fsdp_saved
    stages = [0, 1, 2, 3] if world == 2 else [3]
    for stage, found in run_on_ranks(world, engine_resumes, str(root), stages)[0].items():
        assert max(abs(a - b) for a, b in zip(found["after"], fsdp["after"])) <= TOL, (stage, found["after"], fsdp["after"])
        assert_close(found["params"], fsdp["params"], f"stage {stage}, world {world}")


def test_a_dcp_checkpoint_that_does_not_fit_is_refused_on_every_rank(fsdp_saved: tuple[Path, dict[str, Any]]) -> None:
    root, fsdp = fsdp_saved
    for rank, found in enumerate(run_on_ranks(2, refusals, str(root))):
        for case in ("re-shaped", "missing", "optimizer"):
            assert "failed on 2 of 2 ranks" in found[case], (rank, case, found[case])
            assert found[f"{case} untouched"], (rank, case)
        assert "re-shaped: 0.bias (checkpoint [10], model [11]), 0.weight (checkpoint [10, 7], model [11, 7])" in found["re-shaped"]
        assert "missing: 6.bias, 6.weight" in found["missing"], found["missing"]
        assert "optimizer options amsgrad, betas" in found["optimizer"] and "not SGD's" in found["optimizer"], found["optimizer"]
        assert_close(found["weights"], fsdp["saved"], "weights=")


def test_fsdp2_resumes_the_engines_dcp_checkpoint(tmp_path: Path) -> None:
    cases = {1: [0], 3: [1, 3]}
    ours = {world: run_on_ranks(world, engine_saves, str(tmp_path), stages)[0] for world, stages in cases.items()}
    tags = [f"s{stage}w{world}" for world, stages in cases.items() for stage in stages]
    theirs = run_on_ranks(2, fsdp_run, str(tmp_path), tags, False, allow_numpy=True)[0]
    for world, stages in cases.items():
        for stage in stages:
            found, fsdp = ours[world][stage], theirs[f"s{stage}w{world}"]
            assert max(abs(a - b) for a, b in zip(found["after"], fsdp["after"])) <= TOL, (stage, world)
            assert_close(fsdp["params"], found["params"], f"FSDP2 from stage {stage}, world {world}")
            assert found["resumed"] == pytest.approx(found["after"], abs=1e-7), (stage, world)  # and here, exactly
            assert found["step"] == 2 * STEPS  # the counter saved (5), then 5 steps here
