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
    calls: list = []
    with recorded_collectives(calls):
        with engine.gathered([layer.adapt.bias, layer.base.weight, layer.adapt.weight], modifier_rank=0) as params:
            assert params == [layer.base.weight, layer.adapt.weight, layer.adapt.bias]  # in the module's order
            if rank == 0:
                rewrite(model)
            else:  # undone from rank 0: the adapter's bias only these ranks wrote too
                with torch.no_grad():
                    layer.adapt.weight.fill_(7.0)
                    layer.adapt.bias.fill_(7.0)
    broadcasts = sum(method == "broadcast" for method, *_ in calls)  # the three written back as one
    losses = train(engine, rank, world)
    return {"losses": losses, "state": engine.full_state_dict(), "broadcasts": broadcasts}


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
    """A write without a modifier raises on every rank (rank 1 wrote; rank 0 alone wrote another
    parameter, which must come back from rank 1, not be broadcast from rank 0; a frozen weight
    on every rank), and every value is as it was; an error inside the context on one rank
    raises on every rank, and what another rank wrote meanwhile is put back; a step inside a
    context is refused; a parameter given a tensor of another shape is refused and points at
    the engine's storage again; every rank writing its own value without a modifier leaves
    rank 0's everywhere (the ranks agree); bad arguments are refused before the context;
    training goes on."""
    model = make_model()
    engine = zero_engine.initialize(model, config(stage))
    before = engine.full_state_dict()
    errors = []
    try:
        with engine.gathered([model.layers[1].adapt.weight, "embed.weight", "layers.1.adapt.bias"]):
            with torch.no_grad():
                if rank == 1:
                    model.layers[1].adapt.weight[0, 0] += 1.0
                if rank == 0:
                    model.layers[1].adapt.bias[0] += 1.0
    except RuntimeError as error:
        errors.append(str(error))
    try:
        with engine.gathered(["layers.0.base.weight", "layers.0.adapt.weight"], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    model.layers[0].adapt.weight.add_(1.0)
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
    shape = model.layers[0].adapt.weight.shape
    try:  # a parameter given another shape cannot be written back: refused on every rank, and undone
        with engine.gathered("layers.0.adapt.weight", modifier_rank=0):
            if rank == 0:
                model.layers[0].adapt.weight.data = torch.zeros(2, 2)
    except ValueError as error:
        errors.append(str(error))
    reshaped_back = model.layers[0].adapt.weight.shape == shape
    try:  # every rank its own value, no modifier: nothing can undo it below stage 3, rank 0's is kept
        with engine.gathered("layers.1.base.weight"):
            with torch.no_grad():
                model.layers[1].base.weight.fill_(float(rank + 1))
    except RuntimeError as error:
        errors.append(str(error))
    everywhere = engine.full_state_dict()["layers.1.base.weight"]
    refused = []
    for arguments, modifier in (
        ((), world), ((), -1), ((), "0"), ((), 1.0), ((), True),  # modifier_rank: a rank of this job, an int
        ((model.layers[0],), None), ((7,), None), ((model.layers[0].adapt.weight.detach(),), None),
        (([model.layers[0].adapt.weight.data],), None),
    ):
        try:
            engine.gathered(*arguments, modifier_rank=modifier)
        except (TypeError, ValueError) as error:
            refused.append(type(error).__name__)
    loss = engine(batch(1, rank, world))  # training goes on
    engine.backward(loss)
    engine.step()
    return {"errors": errors, "unchanged": unchanged, "reshaped_back": reshaped_back,
            "everywhere": everywhere, "refused": refused, "loss": loss.item()}


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
                assert got["broadcasts"] == 1, (where, got["broadcasts"])  # one dtype: one broadcast (GPU review Q4)
                mean = [sum(r[(name, stage)]["losses"][step] for r in results) / world for step in range(STEPS)]
                assert mean == pytest.approx(ref_losses, abs=TOL), where
                for key, value in ref_state.items():
                    torch.testing.assert_close(got["state"][key], value, atol=TOL, rtol=0, msg=f"{where}: {key}")
            elif name.startswith("masters"):
                assert bool((got["adapt"] == 0.25).all()) and bool((got["base"] == -0.5).all()), where
            elif name == "refused":
                errors = got["errors"]
                assert len(errors) == 5, (where, errors)
                assert "without modifier_rank" in errors[0] and "'layers.1.adapt.weight' on rank(s) [1]" in errors[0], where
                assert "'layers.1.adapt.bias' on rank(s) [0]" in errors[0] and "as they were" in errors[0], where
                if rank == world - 1:
                    assert errors[1] == "own: a user's bug", where
                else:
                    assert f"rank(s) [{world - 1}] raised inside the context" in errors[1], where
                    assert "as they were" in errors[1], where
                assert "inside engine.gathered()" in errors[2], where
                assert "shape changed inside the context" in errors[3], where
                assert got["reshaped_back"], where
                assert "Every rank wrote ['layers.1.base.weight']" in errors[4] or stage == 3, (where, errors[4])
                assert all(got["unchanged"].values()), (where, got["unchanged"])
                assert got["refused"] == ["ValueError"] * 2 + ["TypeError"] * 7, (where, got["refused"])
                assert torch.equal(got["everywhere"], results[0][(name, stage)]["everywhere"]), where
                if stage < 3:  # rank 0's value, on every rank
                    assert bool((got["everywhere"] == 1.0).all()), where
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


# -- one process -------------------------------------------------------------------------------


def test_a_fingerprint_changes_with_any_write() -> None:
    """Reliability review N08: the fingerprint's weighted sums see elements moved (rows swapped,
    two elements of one row or of one column of its blocks swapped), the plain sum any change
    (one element, NaN, -0.0 over 0.0), at every width and across the block boundary."""
    from zero_engine.state.gathered import fingerprints

    def swap(tensor: torch.Tensor, i: int, j: int) -> None:
        flat = tensor.view(-1)
        flat[i], flat[j] = flat[j].clone(), flat[i].clone()

    def sums(tensor: torch.Tensor) -> tuple:
        return fingerprints([tensor])[0][3:]

    torch.manual_seed(0)
    for shape in [(6, 4), (3, 5000), (9000,)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            original = torch.randn(shape).to(dtype)
            original.view(-1)[3] = 0.0
            writes = {
                "rows swapped": lambda t: t.copy_(t.roll(1, 0)),
                "same row": lambda t: swap(t, 0, 1),
                "same column": lambda t: swap(t, 0, 4096),
                "one element": lambda t: t.view(-1)[-1].add_(1.0),
                "nan": lambda t: t.view(-1)[2].fill_(float("nan")),
                "negative zero": lambda t: t.view(-1)[3].fill_(-0.0),
            }
            before = sums(original)
            for what, write in writes.items():
                if what == "same column" and original.numel() <= 4096:
                    continue
                copy = original.clone()
                write(copy)
                assert not torch.equal(copy.view(torch.uint8), original.view(torch.uint8)), (shape, dtype, what)
                assert sums(copy) != before, (shape, dtype, what)
            assert sums(original.clone()) == before  # unwritten: the same


def test_a_loose_parameters_fp32_copy_takes_a_kept_write_under_bf16() -> None:
    """Reliability review N09: a parameter outside every param group keeps fp32 values under bf16;
    a write kept by ``gathered(modifier_rank=0)`` reaches them (what full_state_dict reads)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = zero_engine.initialize(
        model, engine_config(0, micro=2, lr=0.1, dtype="bf16"), param_groups=[{"params": [model.weight]}]
    )
    with engine.gathered(["bias"], modifier_rank=0):
        with torch.no_grad():
            model.bias.fill_(0.25)
    assert torch.equal(engine.full_state_dict()["bias"], torch.full((2,), 0.25))


def test_gathered_reads_back_once_per_device_whatever_the_number_of_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU review Q4: entering and leaving ``gathered()`` reads the fingerprints back to the host
    once per device each (a read per parameter waits for a GPU once per parameter)."""
    reads: list[int] = []
    real = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> object:
        reads.append(1)
        return real(self)

    def reads_for(num_layers: int) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(num_layers)])
        engine = zero_engine.initialize(model, engine_config(3, micro=2, lr=0.1, stage3_param_persistence_threshold=0))
        reads.clear()
        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        with engine.gathered(modifier_rank=0):
            with torch.no_grad():
                model[0].weight.add_(1.0)
        monkeypatch.setattr(torch.Tensor, "tolist", real)
        return len(reads)

    assert reads_for(10) == reads_for(1)  # a fingerprint each, the call row and the exit exchange: 5
