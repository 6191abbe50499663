"""Stage 3 on ordinary model code, with no wrap list: the same training as one process.

A DeepSpeed user brings a model written for one process and a config that says only
``stage: 3``. Units are then cut by size, and the model's code decides how its modules run:
blocks in an ``nn.ModuleList`` that ``forward`` iterates (the list itself is never called),
experts in an ``nn.ModuleDict`` called by key, a head that reuses the embedding's weight with
``F.linear``, a container module whose own ``forward`` never runs because its parent calls its
members. Each trains here as in one process (fp32, 2e-5), at 2 and 3 ranks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_engine
from harness import run_on_ranks

VOCAB, DIM, SEQ, MICRO, STEPS, LR, TOL = 24, 16, 6, 2, 3, 0.02, 2e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class ListGPT(nn.Module):
    """Blocks in a ModuleList, iterated; a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class ExpertDict(nn.Module):
    """Experts in a ModuleDict, each called by key on the tokens routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.experts = nn.ModuleDict({name: Block() for name in ("left", "middle", "right")})
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        route = tokens % len(self.experts)
        out = torch.zeros_like(h)
        for index, name in enumerate(self.experts):
            chosen = route == index
            out[chosen] = self.experts[name](h[chosen])
        return self.head(out)


class TiedFunctionalHead(nn.Module):
    """The output layer is the embedding's weight, read in the model's forward (GPT-2's tying
    written functionally); a root parameter passed into the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for block in self.blocks:
            h = block(h)
        return F.linear(h, self.embed.weight)


class Encoder(nn.Module):
    """A module with a forward of its own that the model never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # never runs
        raise AssertionError("the model calls the layers itself")


class NestedContainers(nn.Module):
    """Containers whose own forward never runs: the encoder's layers and scale used by the model,
    and stages of a ModuleList of ModuleDicts."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = Encoder()
        self.stages = nn.ModuleList(nn.ModuleDict({"mix": Block(), "out": nn.Linear(DIM, DIM)}) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in (self.encoder.first, self.encoder.second):
            h = layer(h) * self.encoder.scale
        for stage in self.stages:
            h = stage["out"](stage["mix"](h))
        return self.head(h)


# (model class, reduce_bucket_size, what the size rule makes units of, units read outside their modules)
MODELS: dict[str, tuple[type[nn.Module], int, set[str], set[str]]] = {
    # Each block has 1,104 elements; the list 3,312 would reach 3,000 and is never called.
    "ModuleList of blocks": (ListGPT, 3_000, {"blocks.0", "blocks.1", "blocks.2"}, set()),
    "ModuleDict of experts by key": (ExpertDict, 3_000, {"experts.left", "experts.middle", "experts.right"}, set()),
    # The embedding (384 elements) is a unit of its own, as each linear layer; the head reads the
    # embedding's weight after the embedding's forward ended.
    "head reusing the embedding weight": (
        TiedFunctionalHead, 380, {"embed", *(f"blocks.{i}.{fc}" for i in (0, 1) for fc in ("fc1", "fc2"))}, {"embed"},
    ),
    # The encoder (2,224) is chosen but never called; each stage's ModuleDict (1,376) gives its members.
    "nested containers never called": (
        NestedContainers, 1_200, {"encoder", *(f"stages.{i}.{key}" for i in (0, 1) for key in ("mix", "out"))},
        {"encoder"},
    ),
}


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,  # the reference does not clip
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (MICRO * world_size, SEQ + 1), generator=torch.Generator().manual_seed(step))
    rows = tokens[rank * MICRO : (rank + 1) * MICRO] if rank >= 0 else tokens
    return rows[:, :-1], rows[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("zero_engine").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train_every_model(rank: int, world_size: int) -> dict[str, Any]:
    results = {}
    for name, (_, bucket, _, _) in MODELS.items():
        messages = _Messages()
        logging.getLogger("zero_engine").addHandler(messages)
        config = _config()
        config["zero_optimization"]["reduce_bucket_size"] = bucket
        engine = zero_engine.initialize(_make(name), config)
        losses = []
        for step in range(STEPS):
            inputs, targets = _batch(step, rank, world_size)
            loss = _loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[name] = {
            "losses": losses, "state": engine.full_state_dict(),
            "units": {unit.label for unit in engine.gatherer.units},
            "read_outside": {line.split("'")[1] for line in messages.lines if "is read outside" in line},
        }
        logging.getLogger("zero_engine").removeHandler(messages)
        engine.close()
    return results


def _reference(name: str, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        inputs, targets = _batch(step, -1, world_size)
        loss = _loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_ordinary_models_train_at_stage_3_without_a_wrap_list(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, train_every_model)
    for name, (_, _, units, read_outside) in MODELS.items():
        ref_losses, ref_state = _reference(name, world_size)
        ours = [result[name] for result in per_rank]
        assert ours[0]["units"] == units | {"<root>"}, name
        logged = ours[0]["read_outside"]
        assert logged == read_outside, f"{name}: units gathered where they are read: {logged}"
        for step in range(STEPS):
            mean = sum(result["losses"][step] for result in ours) / world_size
            assert mean == pytest.approx(ref_losses[step], abs=TOL), (name, step)
        for key, value in ref_state.items():
            for rank, result in enumerate(ours):
                diff = (result["state"][key] - value).abs().max().item()
                assert diff <= TOL, f"{name}, rank {rank}: {key} differs by {diff}"


# -- one process: what is refused, and the plan -----------------------------------------------------


def _stage3(model: nn.Module, **zero: Any) -> Any:
    config = _config()
    config["zero_optimization"].update(zero)
    return zero_engine.initialize(model, config)


def test_a_container_that_is_only_iterated_is_never_a_unit() -> None:
    from zero_engine.param_groups import resolve_param_groups
    from zero_engine.sharding.units.module_plan import can_be_called, plan_module_units

    for name, (_, bucket, units, _) in MODELS.items():
        model = _make(name)
        groups = resolve_param_groups(model, None, torch.optim.AdamW)
        plans, _ = plan_module_units(model, groups, None, bucket, 0)
        assert {plan.label for plan in plans} == units | {"<root>"}, name
        assert all(can_be_called(plan.module) for plan in plans), name
    assert not can_be_called(nn.ModuleList()) and not can_be_called(nn.ModuleDict())
    assert can_be_called(nn.Sequential()) and can_be_called(Encoder())


def test_a_wrap_list_naming_a_container_is_refused_at_initialize() -> None:
    with pytest.raises(ValueError, match=r"stage3_wrap_modules names \['ModuleList'\], which has no forward of its own"
                       r".*Name the classes of its members instead \(\['Block'\]\)"):
        _stage3(ListGPT(), stage3_wrap_modules=["ModuleList"])


class _KeptReference(nn.Module):
    """Keeps a parameter in a plain list, where no module hook or read can see it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.kept = [self.proj.weight]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(tokens))
        return F.linear(h, self.kept[0])


def test_a_parameter_used_through_a_hidden_reference_is_named_with_the_fix() -> None:
    """Not a shape error from torch: the parameter, the code that used it and the fix."""
    engine = _stage3(_KeptReference(), reduce_bucket_size=200)
    with pytest.raises(zero_engine.ShardedParameterError, match=r"parameter 'proj.weight' \(unit 'proj'\) was used in "
                       r"a forward while sharded, by module <root> \(_KeptReference\), .*test_stage3_any_model.py:\d+ "
                       r"\(forward\).* Read it from its module where it is used.*threshold above 256") as info:
        engine(torch.zeros(2, SEQ, dtype=torch.long))
    assert "mat2" in str(info.value.__cause__) or "size" in str(info.value.__cause__)  # torch's own, chained
    engine.close()


class _ReadsInAThread(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(tokens))
        out: list[Any] = []
        worker = threading.Thread(target=lambda: out.append(self._read()))
        worker.start()
        worker.join()
        if isinstance(out[0], BaseException):
            raise out[0]
        return F.linear(h, out[0])

    def _read(self) -> Any:
        try:
            return self.embed.weight
        except BaseException as error:  # noqa: BLE001 (handed to the forward's thread)
            return error


def test_a_parameter_read_from_another_thread_is_refused_with_the_fix() -> None:
    engine = _stage3(_ReadsInAThread(), reduce_bucket_size=200)
    with pytest.raises(zero_engine.ShardedParameterError, match=r"parameter 'embed.weight' \(unit 'embed'\) was read "
                       r"from another thread during the forward of <root>.*persistence_threshold above 384"):
        engine(torch.zeros(2, SEQ, dtype=torch.long))
    engine.close()


def test_reading_a_parameter_outside_a_forward_gathers_nothing() -> None:
    """Between steps ``module.weight`` is the empty shard, as in DeepSpeed (full_state_dict()
    gives values); reading it neither gathers nor communicates."""
    model = TiedFunctionalHead()
    engine = _stage3(model, reduce_bucket_size=380)
    assert model.embed.weight.numel() == 0 and not any(unit.has_full_storage for unit in engine.gatherer.units)
    engine.close()
    assert type(model.embed._parameters) is dict  # close() puts the plain mapping back


# -- the plan and the read watch, at their edges (issue 52's mutation audit) ----------------------------


def test_a_module_of_exactly_the_limit_is_a_unit() -> None:
    """``reduce_bucket_size`` is the least a unit holds: Linear(4, 8) has 40 elements, a unit at
    limit 40; Linear(8, 4) has 36 and stays with the root."""
    from zero_engine.param_groups import resolve_param_groups
    from zero_engine.sharding.units.module_plan import plan_module_units

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    groups = resolve_param_groups(model, None, torch.optim.AdamW)
    plans, _ = plan_module_units(model, groups, None, 40, 0)
    assert [(plan.module, len(plan.params)) for plan in plans] == [(model, 2), (model[0], 2)]
    plans, _ = plan_module_units(model, groups, None, 41, 0)
    assert [(plan.module, len(plan.params)) for plan in plans] == [(model, 4)]


class _TiedPair(nn.Module):
    """Two units sharing one weight: the second uses the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))).pow(2).mean()


def tied_pair_run(rank: int, world_size: int) -> dict[str, Any]:
    from zero_engine.param_groups import resolve_param_groups
    from zero_engine.sharding.units.module_plan import plan_module_units

    messages = _Messages()
    logging.getLogger("zero_engine").addHandler(messages)
    torch.manual_seed(0)
    model = _TiedPair()
    groups = resolve_param_groups(model, None, torch.optim.AdamW)
    plans = {plan.label: plan for plan in plan_module_units(model, groups, None, DIM, 0)[0]}  # the engine's plan
    config = _config()
    config["zero_optimization"]["reduce_bucket_size"] = DIM
    engine = zero_engine.initialize(model, config)
    for step in range(2):
        engine.backward(engine(torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * 10 + rank))))
        engine.step()
    logging.getLogger("zero_engine").removeHandler(messages)
    result = {
        "second_uses_the_tied_weight": any(p is model.first.weight for p in plans["second"].uses),
        "second_owns": [p is model.second.bias for p in plans["second"].params],
        "read_outside": [line for line in messages.lines if "is read outside" in line],
    }
    engine.close()
    return result


def test_a_weight_tied_across_units_is_in_the_second_units_uses() -> None:
    """The first unit owns the tied weight; the second's plan must list it among what it uses,
    so it is gathered with the second's own hooks, not served by the read watch (which would
    log a read outside, and serves no read inside a compiled unit)."""
    for result in run_on_ranks(2, tied_pair_run):
        assert result["second_uses_the_tied_weight"] and result["second_owns"] == [True], result
        assert result["read_outside"] == [], result


class _Reader(nn.Module):
    """Reads another unit's weight (a module it holds outside the module tree) in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + F.linear(x, self.__dict__["peer"].weight)


class _ReadsPeer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.peer, self.reader, self.after = nn.Linear(DIM, DIM), _Reader(), nn.Linear(DIM, DIM)
        self.reader.__dict__["peer"] = self.peer  # not a submodule: the read goes through the watch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(torch.tanh(self.reader(x))).pow(2).mean()


def served_read_run(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _ReadsPeer()
    config = _config()
    config["zero_optimization"]["reduce_bucket_size"] = DIM * DIM
    engine = zero_engine.initialize(model, config)
    peer_unit = next(i for i, unit in enumerate(engine.gatherer.units) if unit.label == "peer")
    seen: list[int] = []  # the peer unit's gathered bytes as ``after`` starts (read past the watch)
    model.after.register_forward_pre_hook(
        lambda module, args: seen.append(engine.gatherer.units[peer_unit].gathered_bytes)
    )
    for step in range(2):
        engine.backward(engine(torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * 10 + rank))))
        engine.step()
    holders = [module for module, needs in engine.gatherer._needs.items() if peer_unit in needs]
    result = {"holders": [type(module).__name__ for module in holders], "peer_numel_in_after": seen}
    engine.close()
    return result


def test_a_served_read_is_held_by_the_innermost_running_module_and_released_with_it() -> None:
    """The reader's forward reads the peer unit's weight: the reader (the innermost module
    running) holds it from then on, so it is freed when the reader's forward ends, before the
    next module runs; held by the root, it would stay gathered through the whole forward."""
    for result in run_on_ranks(2, served_read_run):
        assert result["holders"] == ["Linear", "_Reader"], result  # the peer itself, and its reader
        assert result["peer_numel_in_after"] == [0, 0], result
