"""``engine.gathered(params, modifier_rank=r)`` at stages 0-3 on 2 and 3 ranks, against one
process: a PiSSA-style rewrite of a frozen base weight and a write of a trainable one by rank 0
(while the other ranks write garbage into the trainable one) then five training steps equal
torch's AdamW in one process that made the same write; a write without a modifier raises on
every rank and leaves the parameters as they were; an error inside the context on one rank
raises on every rank; nested, tied and repeated parameters; the bytes gathered are the named
units' bytes; no optimizer step inside a context. The slow run adds every case at every stage on
3 ranks, and the write and the masters under hybrid sharding (4 ranks, groups of 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_engine
from configs import engine_config
from adapted import VOCAB, TiedAdapted, make_model
from harness import recorded_collectives, run_on_ranks

SEQ, MICRO, STEPS, LR = 4, 2, 5, 0.02
TOL = 2e-5


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=torch.Generator().manual_seed(step))
    return rows[rank * MICRO : (rank + 1) * MICRO]


def rewrite(model: TiedAdapted) -> None:
    """What rank 0 writes: the base without its top singular direction (PiSSA keeps the residual
    in the base), and the adapter doubled."""
    layer = model.layers[0]
    with torch.no_grad():
        u, s, vh = torch.linalg.svd(layer.base.weight.float())
        layer.base.weight.sub_((s[0] * torch.outer(u[:, 0], vh[0])).to(layer.base.weight.dtype))
        layer.adapt.weight.mul_(2.0)


def config(stage: int, dtype: str | None = None, **zero) -> dict:
    return engine_config(
        stage, micro=MICRO, lr=LR, dtype=dtype, stage3_param_persistence_threshold=0, stage3_wrap_modules=["Layer"],
        **zero,
    )


def train(engine, rank: int, world: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = engine(batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_numels(model: nn.Module) -> dict[str, int]:
    return {name: param.numel() for name, param in model.named_parameters()}


def case_write(rank: int, world: int, stage: int, **zero) -> dict:
    """Rank 0's rewrite is kept everywhere; another rank's garbage in the adapter is undone."""
    model = make_model()
    engine = zero_engine.initialize(model, config(stage, **zero))
    layer = model.layers[0]
    with engine.gathered([layer.adapt.bias, layer.base.weight, layer.adapt.weight], modifier_rank=0) as params:
        assert params == [layer.base.weight, layer.adapt.weight, layer.adapt.bias]  # in the module's order
        if rank == 0:
            rewrite(model)
        else:  # undone from rank 0: the adapter's bias only these ranks wrote too
            with torch.no_grad():
                layer.adapt.weight.fill_(7.0)
                layer.adapt.bias.fill_(7.0)
    losses = train(engine, rank, world)
    return {"losses": losses, "state": engine.full_state_dict()}


OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def case_masters(rank: int, world: int, stage: int, offload: bool = False, **zero) -> dict:
    """Under bf16 the fp32 masters are copies of their own: rank 0's write reaches them (what
    `full_state_dict` reads and the next step starts from) on every rank; with offload, on the host."""
    model = make_model()
    engine = zero_engine.initialize(model, config(stage, "bf16", **(OFFLOAD if offload else {}), **zero))
    with engine.gathered(["layers.1.adapt.weight", "layers.1.base.weight"], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.layers[1].adapt.weight.fill_(0.25)
                model.layers[1].base.weight.fill_(-0.5)
    state = engine.full_state_dict()
    return {"adapt": state["layers.1.adapt.weight"], "base": state["layers.1.base.weight"]}


def case_refused(rank: int, world: int, stage: int) -> dict:
    """A write without a modifier raises on every rank (rank 1 wrote; a frozen weight on every
    rank), and every value is as it was; an error inside the context on one rank raises on every
    rank; a step inside a context is refused; training goes on."""
    model = make_model()
    engine = zero_engine.initialize(model, config(stage))
    before = engine.full_state_dict()
    errors = []
    try:
        with engine.gathered([model.layers[1].adapt.weight, "embed.weight"]):
            if rank == 1:
                with torch.no_grad():
                    model.layers[1].adapt.weight[0, 0] += 1.0
    except RuntimeError as error:
        errors.append(str(error))
    try:
        with engine.gathered("layers.0.base.weight"):
            if rank == world - 1:
                raise ValueError("a user's bug")
    except ValueError as error:
        errors.append(f"own: {error}")
    except RuntimeError as error:
        errors.append(str(error))
    unchanged = {name: torch.equal(value, before[name]) for name, value in engine.full_state_dict().items()}
    loss = engine(batch(0, rank, world))
    engine.backward(loss)
    try:
        with engine.gathered("layers.1.adapt.bias"):
            engine.step()
    except RuntimeError as error:
        errors.append(str(error))
    engine.step()
    try:  # a parameter given another shape cannot be written back: refused on every rank, last (it stays so)
        with engine.gathered("layers.0.adapt.weight", modifier_rank=0):
            if rank == 0:
                model.layers[0].adapt.weight.data = torch.zeros(2, 2)
    except ValueError as error:
        errors.append(str(error))
    return {"errors": errors, "unchanged": unchanged}


def case_nested(rank: int, world: int, stage: int) -> dict:
    """Tied and repeated parameters are one; an inner context neither releases a unit the outer
    holds nor loses its write; the outermost exit reshards (stage 3); the bytes gathered are the
    named units' bytes."""
    model = make_model()
    engine = zero_engine.initialize(model, config(stage))
    full = {name: param.shape for name, param in make_model().named_parameters()}
    seen = {}
    calls: list = []
    with recorded_collectives(calls):
        with engine.gathered([model.embed.weight, model.head.weight, "embed.weight"]) as params:
            seen["tied_once"] = len(params) == 1
    # an all-gather is one collective, or on gloo a broadcast per shard (`GroupComm._shard_by_shard`)
    gathered_bytes = sum(nbytes for method, _, _, nbytes in calls if method in ("all_gather", "_shard_by_shard"))
    unit = engine.model_state.placement()[model.embed.weight][0]
    seen["bytes"] = (gathered_bytes, unit.flat_param.numel() * unit.flat_param.element_size() if stage == 3 else 0)
    with engine.gathered("embed.weight"):
        with engine.gathered(["embed.weight", "layers.0.adapt.weight"], modifier_rank=world - 1):
            if rank == world - 1:
                with torch.no_grad():
                    model.embed.weight.mul_(3.0)
        seen["outer_still_whole"] = model.embed.weight.shape == full["embed.weight"]
        seen["adapt_whole"] = model.layers[0].adapt.weight.shape == full["layers.0.adapt.weight"]
        seen["inner_write_seen"] = model.embed.weight.detach().clone()
        loss = engine(batch(0, rank, world))  # a forward inside a hold gathers nothing the hold keeps
        engine.backward(loss)
    seen["after_outer"] = model.embed.weight.shape == full["embed.weight"]
    engine.step()
    seen["state"] = engine.full_state_dict()["embed.weight"]
    return seen


def case_masters_offload(rank: int, world: int, stage: int) -> dict:
    return case_masters(rank, world, stage, offload=True)


def case_write_hybrid(rank: int, world: int, stage: int) -> dict:
    """Hybrid sharding: the write reaches every shard group's shards and masters."""
    return case_write(rank, world, stage, shard_group_size=2)


def case_masters_hybrid(rank: int, world: int, stage: int) -> dict:
    return case_masters(rank, world, stage, shard_group_size=2)


CASES = {
    "write": case_write, "masters": case_masters, "masters_offload": case_masters_offload, "refused": case_refused,
    "nested": case_nested, "write_hybrid": case_write_hybrid, "masters_hybrid": case_masters_hybrid,
}


def run_cases(rank: int, world: int, cases: list[tuple[str, int]]) -> dict:
    torch.set_num_threads(1)
    return {(name, stage): CASES[name](rank, world, stage) for name, stage in cases}


def reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    rewrite(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)  # the engine's default
    losses = []
    for step in range(STEPS):
        loss = model(torch.cat([batch(step, rank, world) for rank in range(world)]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def check(results: list[dict], world: int, cases: list[tuple[str, int]]) -> None:
    ref_losses, ref_state = reference(world)
    initial = make_model()
    for name, stage in cases:
        for rank, result in enumerate(results):
            got = result[(name, stage)]
            where = f"{name} stage {stage} rank {rank} of {world}"
            if name.startswith("write"):  # each rank's loss is its micro-batch's: their mean is the global batch's
                mean = [sum(r[(name, stage)]["losses"][step] for r in results) / world for step in range(STEPS)]
                assert mean == pytest.approx(ref_losses, abs=TOL), where
                for key, value in ref_state.items():
                    torch.testing.assert_close(got["state"][key], value, atol=TOL, rtol=0, msg=f"{where}: {key}")
            elif name.startswith("masters"):
                assert bool((got["adapt"] == 0.25).all()) and bool((got["base"] == -0.5).all()), where
            elif name == "refused":
                errors = got["errors"]
                assert len(errors) == 4, (where, errors)
                assert "without modifier_rank" in errors[0] and "'layers.1.adapt.weight' on rank(s) [1]" in errors[0], where
                assert "as they were" in errors[0], where
                if rank == world - 1:
                    assert errors[1] == "own: a user's bug", where
                else:
                    assert f"rank(s) [{world - 1}] raised inside the context" in errors[1], where
                assert "inside engine.gathered()" in errors[2], where
                assert "shape changed inside the context" in errors[3], where
                assert all(got["unchanged"].values()), (where, got["unchanged"])
            else:
                assert got["tied_once"] and got["outer_still_whole"] and got["after_outer"] == (stage < 3), where
                assert got["adapt_whole"] == (stage < 3), where  # the inner exit released its own unit
                gathered, unit_bytes = got["bytes"]
                assert gathered == unit_bytes, (where, got["bytes"])
                torch.testing.assert_close(got["inner_write_seen"], initial.embed.weight.detach() * 3.0)
                torch.testing.assert_close(got["state"], results[0][(name, stage)]["state"], atol=0, rtol=0)


# the fast run on 2 ranks: every case at the stages where its paths differ (the slow run: every stage, 3 ranks)
FAST = [(name, stage) for name in ("write", "masters") for stage in (0, 1, 2, 3)]
FAST += [("masters_offload", 3), ("refused", 0), ("refused", 3), ("nested", 0), ("nested", 3)]
EVERY = [(name, stage) for name in ("write", "masters", "refused", "nested") for stage in (0, 1, 2, 3)]
EVERY += [("masters_offload", stage) for stage in (1, 2, 3)]


def test_gathered_two_ranks() -> None:
    results = run_on_ranks(2, run_cases, FAST)
    check(results, 2, FAST)


@pytest.mark.slow
def test_gathered_three_ranks() -> None:
    results = run_on_ranks(3, run_cases, EVERY)
    check(results, 3, EVERY)


@pytest.mark.slow
def test_gathered_with_hybrid_sharding() -> None:
    cases = [("write_hybrid", 3), ("masters_hybrid", 3)]
    results = run_on_ranks(4, run_cases, cases)
    check(results, 4, cases)


def test_gathered_three_ranks_stage3() -> None:
    cases = [(name, 3) for name in ("write", "masters", "masters_offload", "refused", "nested")]
    results = run_on_ranks(3, run_cases, cases)
    check(results, 3, cases)
