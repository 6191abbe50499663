"""Stage 3 against one process: the same losses, evaluation losses and final parameters.

The model's traps at stage 3: the tied embedding/head weight is owned by the embedding's unit
and used by the head's, the frozen layer is wrapped and sharded in a frozen unit (never reduced), one parameter is
never used, sizes divide by no world size, two param groups split every unit, and with
``mlp_calls=2`` the norm/fc1/fc2 units run twice in one forward. Every step is followed by an
evaluation forward (eval mode, no_grad), which gathers and frees outside any backward.
"""

from __future__ import annotations

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import DeepModel, decay_groups, make_model, train_engine, train_reference
from zero_engine.memory import HELD_NOW
from zero_engine.sharding.gathering.agreement import PASS_DONE, PassKind, make_row, row_wants
from zero_engine.testing.process_memory import live_tensor_bytes
from structured import StructuredModel, structured_batch

STEPS, MICRO, LR, TOL = 4, 2, 0.05, 2e-5
WRAP_LEAVES = ["Embedding", "Linear", "LayerNorm"]


def stage3_config(case: dict) -> dict:
    return engine_config(
        3, micro=MICRO, lr=LR, accum=case["accum"], optimizer=case.get("optimizer", "AdamW"),
        clip=case.get("clip", 0.0), primitives=case.get("primitives", "auto"),
        reduce_bucket_size=case.get("bucket", 40), stage3_param_persistence_threshold=case.get("persist", 0),
        stage3_wrap_modules=case.get("wrap") or None,
        stage3_prefetch_bucket_size=case.get("stage3_prefetch_bucket_size"),
        stage3_max_live_parameters=case.get("stage3_max_live_parameters"),
    )


def train_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    results = []
    for case in cases:
        model = make_model(mlp_calls=case.get("mlp_calls", 1))
        engine = zero_engine.initialize(model, stage3_config(case), param_groups=decay_groups(model))
        eval_losses: list[float] = []
        losses, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"], eval_losses)
        results.append({
            "losses": losses,
            "norms": norms,
            "eval": eval_losses,
            "state": engine.full_state_dict(),
            "units": [unit.label for unit in engine.gatherer.units if not unit.frozen],
            "frozen_units": [unit.label for unit in engine.frozen_units],
        })
        engine.close()
    return results


GRID = [
    {"accum": 1, "wrap": WRAP_LEAVES},
    {"accum": 3, "wrap": WRAP_LEAVES, "mlp_calls": 2},
    {"accum": 3, "wrap": ["Linear"], "persist": 8},  # biases and norm stay resident
    {"accum": 1, "bucket": 40, "mlp_calls": 2, "clip": 0.05},  # size policy: units by parameter count
    {"accum": 2, "bucket": 10**6},  # one root unit holds everything
    {"accum": 1, "wrap": WRAP_LEAVES, "stage3_prefetch_bucket_size": 1, "stage3_max_live_parameters": 1},
    {"accum": 2, "wrap": WRAP_LEAVES, "primitives": "native"},  # NCCL's collectives, run on gloo
    # Plain SGD (no momentum, no clipping): the update is linear in the gradient, so a missing or
    # doubled division by N or by k shows (Adam and Adagrad are scale-invariant).
    {"accum": 1, "wrap": WRAP_LEAVES, "optimizer": "SGD"},
    {"accum": 3, "wrap": WRAP_LEAVES, "optimizer": "SGD"},
]


@pytest.mark.parametrize(
    "world_size", [pytest.param(w, marks=pytest.mark.slow) if w != 3 else w for w in (1, 2, 3, 4)]
)  # the fast run keeps the odd world size (padding); 2 ranks run in most other tests
def test_stage3_matches_single_process(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, train_grid, GRID)
    for index, case in enumerate(GRID):
        results = [rank_results[index] for rank_results in per_rank]
        ref_eval: list[float] = []
        ref_losses, ref_state, ref_norms = train_reference(
            STEPS, MICRO * case["accum"] * world_size, case.get("optimizer", "AdamW"), LR, case.get("clip", 0.0),
            ref_eval,
            mlp_calls=case.get("mlp_calls", 1),
        )
        for step in range(STEPS):
            window = [loss for r in results for loss in r["losses"][step]]
            assert sum(window) / len(window) == pytest.approx(ref_losses[step], abs=TOL), (case, step)
        for rank, result in enumerate(results):
            assert result["eval"] == pytest.approx(ref_eval, abs=TOL), (case, rank)
            assert result["norms"] == pytest.approx(ref_norms, abs=1e-4), (case, rank)
            assert result["state"].keys() == ref_state.keys()
            for name, ref in ref_state.items():
                diff = (result["state"][name] - ref).abs().max().item()
                assert diff <= TOL, f"{case} rank {rank}: {name} differs by {diff}"
        assert torch.equal(results[0]["state"]["unused"], make_model().unused.detach())
    # The unit policies did what the grid says they do.
    assert per_rank[0][0]["units"] == ["<root>", "embed", "norm", "fc1", "fc2"]
    assert per_rank[0][2]["units"] == ["<root>", "fc1", "fc2"]  # biases resident, embed in the root
    assert per_rank[0][3]["units"] == ["<root>", "embed", "fc1", "fc2"]
    assert per_rank[0][4]["units"] == ["<root>"]
    # The frozen layer (49 + 7 elements) is sharded too, in a unit of its own beside the trainable ones
    # (wrapped as a Linear; in the root's frozen unit where the root holds it), its bias where the
    # persistence threshold lets it.
    frozen = [per_rank[0][case]["frozen_units"] for case in (0, 2, 3, 4)]
    assert frozen == [["frozen [frozen]"]] * 3 + [["<root> [frozen]"]], frozen


# -- memory, communication, export, failures, structured inputs: one spawn per world size --------

WIDTH = 16


def _deep_config(**zero: object) -> dict:
    zero = {"stage3_wrap_modules": ["Linear"], "stage3_param_persistence_threshold": 0, **zero}
    return engine_config(3, micro=4, lr=LR, **zero)


def _deep_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _deep_engine(**zero: object):
    torch.manual_seed(0)
    return zero_engine.initialize(DeepModel(WIDTH), _deep_config(**zero))


def _deep_steps(engine, rank: int, steps: range, **forward: object) -> None:
    for step in steps:
        engine.backward(engine(_deep_batch(step, rank), **forward))
        engine.step()


class RootScaled(DeepModel):
    """DeepModel with a parameter of the model itself: a root unit, gathered for the whole forward."""

    def __init__(self) -> None:
        super().__init__(WIDTH)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor, **options: int) -> torch.Tensor:
        return super().forward(x * self.scale, **options)


def _root_engine():
    torch.manual_seed(0)
    return zero_engine.initialize(RootScaled(), _deep_config())


def rows_and_root(rank: int) -> dict:
    """The agreement rows a steady-state step sends, and where the root unit is gathered."""
    out: dict = {}
    engine = _root_engine()
    root = [unit for index, unit in enumerate(engine.gatherer.units) if index in engine.gatherer.root_units]
    _deep_steps(engine, rank, range(2))  # the order is recorded; the forward's first window is agreed
    rows: list[list[int]] = []
    each_rank = engine.comm.each_rank
    engine.comm.each_rank = lambda row: rows.append(list(row)) or each_rank(row)
    loss = engine(_deep_batch(2, rank))
    out["forward_rows"] = [row for row in rows if row[2] != PASS_DONE]  # drains depend on timing
    out["gathered_after_forward"] = [unit.has_full_storage for unit in engine.gatherer.units]
    engine.backward(loss)
    engine.step()
    engine.comm.each_rank = each_rank
    out["gathered_after_backward"] = [unit.has_full_storage for unit in engine.gatherer.units]
    with torch.no_grad():
        engine(_deep_batch(3, rank))
    out["root_after_no_grad"] = root[0].has_full_storage
    # A call between a forward and its backward lets the kept root go; the backward gathers it again.
    loss = engine(_deep_batch(4, rank))
    engine.full_state_dict()
    out["root_after_call"] = root[0].has_full_storage
    engine.backward(loss)
    engine.step()
    out["with_call"] = engine.full_state_dict()
    engine.close()
    engine = _root_engine()
    _deep_steps(engine, rank, range(2))
    engine.backward(engine(_deep_batch(2, rank)))
    engine.step()
    with torch.no_grad():
        engine(_deep_batch(3, rank))
    _deep_steps(engine, rank, range(4, 5))
    out["without_call"] = engine.full_state_dict()
    out["root_index"] = engine.gatherer.root_units
    out["labels"] = [unit.label for unit in engine.gatherer.units]
    engine.close()
    return out


def user_holds(rank: int) -> dict:
    """Holds taken outside the hooks (`ParamGatherer.hold`): nested, beside a forward's own,
    kept through an evaluation forward without gathering again, and released by the last
    release only; training afterwards is as if no hold was taken."""
    out: dict = {}
    engine = _deep_engine()
    gatherer = engine.gatherer
    _deep_steps(engine, rank, range(2))
    gathers = [0] * len(gatherer.units)
    for index, unit in enumerate(gatherer.units):
        unit.unshard = _counting(unit.unshard, gathers, index)
    full = engine.full_state_dict()  # a call: the gathers agreed for the next forward are settled
    gatherer.hold([1, 2])
    gatherer.hold([2])  # nested: one more hold on unit 2
    engine.full_state_dict()  # a collective call does not free held units
    out["held"] = [unit.has_full_storage for unit in gatherer.units]
    out["values_equal"] = all(
        torch.equal(param.detach(), full[name])
        for index in (1, 2) for name, param in zip(gatherer.units[index].names, gatherer.units[index].params)
    )
    gathers[:] = [0] * len(gathers)
    with torch.no_grad():
        out["held_output"] = engine(_deep_batch(7, rank))
    out["gathers_in_forward"] = list(gathers)
    out["held_after_forward"] = [unit.has_full_storage for unit in gatherer.units]
    gatherer.release([1, 2])
    out["after_first_release"] = [unit.has_full_storage for unit in gatherer.units]
    gatherer.release([2])
    out["after_last_release"] = [unit.has_full_storage for unit in gatherer.units]
    with torch.no_grad():
        out["free_output"] = engine(_deep_batch(7, rank))
    _deep_steps(engine, rank, range(2, 4))
    out["trained"] = engine.full_state_dict()  # checked against four plain steps (`without_failure`)
    engine.close()
    return out


def _counting(function, counts: list[int], index: int):
    def counted(*args, **kwargs):
        counts[index] += 1
        return function(*args, **kwargs)
    return counted


def behaviour(rank: int, world_size: int) -> dict:
    out: dict = {"rows_and_root": rows_and_root(rank), "user_holds": user_holds(rank)}

    # Memory and traffic on 8 units, measured in the second step (optimizer state exists); then
    # a live limit of one unit's padded size exactly (N22: a prefetch that did not count its own
    # unit against the limit would fit beside the running one).
    for name in ("default", "live_limit"):
        zero = {"stage3_max_live_parameters": max(out["default"]["padded"])} if name == "live_limit" else {}
        engine = None  # the last engine's tensors must not count in the baseline
        baseline = live_tensor_bytes()
        engine = _deep_engine(**zero)
        _deep_steps(engine, rank, range(1))
        engine.backward(engine(_deep_batch(1, rank)))
        memory = engine.memory_report()
        live = live_tensor_bytes() - baseline
        gathered_after_backward = [unit.has_full_storage for unit in engine.gatherer.units]
        engine.step()
        out[name] = {
            "memory": memory,
            "live": live,
            "comm": engine.comm_report(),
            "gathered_after_backward": gathered_after_backward,
            "padded": [unit.layout.padded_numel for unit in engine.gatherer.units],
            "optimizer_tensors": len(engine.optimizer.state),
        }
        engine.close()

    # Export: every rank, or rank 0 alone.
    engine = _deep_engine()
    _deep_steps(engine, rank, range(2))
    out["full"] = engine.full_state_dict()
    engine.comm.reset_report()
    out["rank0"] = engine.full_state_dict(rank0_only=True)
    out["rank0_comm"] = engine.comm_report()
    engine.close()

    # A forward that raises leaves nothing gathered, and training goes on as if it never ran.
    engine = _deep_engine()
    _deep_steps(engine, rank, range(2))
    try:
        engine(_deep_batch(99, rank), fail_at=5)
    except ValueError as error:
        out["raised"] = str(error)
    out["gathered_after_failure"] = [unit.has_full_storage for unit in engine.gatherer.units]
    engine.eval()
    with torch.no_grad():  # an evaluation in between, then training again
        engine(_deep_batch(98, rank))
    engine.train()
    _deep_steps(engine, rank, range(2, 4))
    out["after_failure"] = engine.full_state_dict()
    engine.close()
    engine = _deep_engine()
    _deep_steps(engine, rank, range(4))
    out["without_failure"] = engine.full_state_dict()
    engine.close()

    # The order changes on every rank alike (layers skipped, an evaluation in between): the
    # prefetches and proposals guess wrong, gather in vain, and the result is still stage 0's.
    changing = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        config = _deep_config()
        config["zero_optimization"]["stage"] = stage
        engine = zero_engine.initialize(DeepModel(WIDTH), config)
        for step, skip in enumerate([-1, 2, 5, -1, 2]):
            engine.backward(engine(_deep_batch(step, rank), skip=skip))
            engine.step()
            if step == 2:
                with torch.no_grad():
                    engine(_deep_batch(50, rank), skip=7)
        changing[stage] = engine.full_state_dict()
        engine.close()
    out["changing_order"] = changing

    # Activation checkpointing, reentrant or not: layers recomputed in backward gather again
    # (their storage was freed after the forward) and train as stage 0 without checkpointing.
    checkpointed = {}
    for stage, mode in ((0, None), (3, "reentrant"), (3, "non_reentrant")):
        torch.manual_seed(0)
        config = _deep_config()
        config["zero_optimization"]["stage"] = stage
        engine = zero_engine.initialize(DeepModel(WIDTH, checkpointing=mode), config)
        _deep_steps(engine, rank, range(3))
        checkpointed[mode] = engine.full_state_dict()
        engine.close()
    out["checkpointing"] = checkpointed

    # Structured inputs and outputs: stage 3 gives what stage 0 gives.
    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = StructuredModel()
        config = _deep_config(stage3_wrap_modules=["StructuredBlock"])
        config["zero_optimization"]["stage"] = stage
        engine = zero_engine.initialize(model, config)
        trace = []
        for step in range(3):
            batch, cache = structured_batch(step, rank)
            output = engine(batch, cache=cache, scale=0.5)
            assert output.cache is cache, "a non-tensor member must pass through untouched"
            engine.backward(output.loss)
            engine.step()
            trace.append(output.loss.item())
        losses[stage] = trace
        engine.close()
    out["structured"] = losses
    return out


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])  # 3: padding
def test_stage3_memory_traffic_export_and_failures(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, behaviour)
    psi = 8 * (WIDTH * WIDTH + WIDTH)
    for rank, out in enumerate(per_rank):
        default = out["default"]
        unit_bytes = [4 * padded for padded in default["padded"]]
        assert len(unit_bytes) == 8
        memory = default["memory"]
        # Parameters, gradients and optimizer state: the stage 0 total / N, up to padding and
        # AdamW's per-tensor step counters.
        held = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
        padding = sum(unit_bytes) // 4 - psi
        assert memory["parameters"] == memory["gradients"] == sum(unit_bytes) // world_size
        assert 0 <= held - 16 * psi / world_size <= 16 * padding / world_size + 8 * default["optimizer_tensors"]
        assert not any(default["gathered_after_backward"]), "units stayed gathered after backward"
        # The report is what the process holds between backward and step: the storages behind
        # every live tensor (gathered units freed; what autograd saved is measured as the
        # process holds it in test_stage3_memory.py), besides the agreement the gatherer has
        # already proposed for the next pass (one round in flight, a row of int64 per rank) and
        # at most one reduced bucket whose completed gloo work has not yet let go of it.
        held = sum(memory[key] for key in HELD_NOW)
        rounds = 8 * len(make_row(0, PassKind.FORWARD, [], 0)) * world_size
        assert 0 <= default["live"] - held <= rounds + max(unit_bytes), (rank, default["live"], memory)
        # Forward holds the running unit and the prefetched next one; a live limit of one unit
        # stops prefetching.
        largest_two = sum(sorted(unit_bytes)[-2:])
        assert memory["peak_gathered_forward"] == largest_two
        assert out["live_limit"]["memory"]["peak_gathered_forward"] == max(unit_bytes)
        assert 0 < memory["peak_gathered_backward"] <= largest_two + max(unit_bytes)
        # Traffic: all-gather in forward and backward, reduce-scatter of gradients.
        comm, share = default["comm"], (world_size - 1) / world_size
        assert comm["all_gather"]["sent"] == 2 * sum(unit_bytes) * share
        assert comm["reduce_scatter"]["sent"] == sum(unit_bytes) * share
        assert 3 * 4 * psi * share <= comm["total"]["sent"] <= 1.05 * 3 * sum(unit_bytes) * share
        # Export.
        if rank == 0:
            assert out["rank0"].keys() == out["full"].keys()
            assert all(torch.equal(out["rank0"][k], out["full"][k]) for k in out["full"])
        else:
            assert out["rank0"] == {}
        # One rooted gather of each unit's fp32 masters, counted as the ring volume (N-1)/N as every kind
        assert out["rank0_comm"]["gather"]["sent"] == sum(unit_bytes) * share
        assert out["rank0_comm"]["all_gather"]["sent"] == 0
        # Failure and recovery.
        assert out["raised"] == "failing inside layer 5 on purpose"
        assert not any(out["gathered_after_failure"])
        for name, value in out["without_failure"].items():
            assert torch.equal(out["after_failure"][name], value), name
        assert out["structured"][3] == pytest.approx(out["structured"][0], abs=1e-5)
        for name, value in out["changing_order"][0].items():
            assert (out["changing_order"][3][name] - value).abs().max().item() <= TOL, name
        for mode in ("reentrant", "non_reentrant"):
            for name, value in out["checkpointing"][None].items():
                assert (out["checkpointing"][mode][name] - value).abs().max().item() <= TOL, (mode, name)
        _check_rows_and_root(out["rows_and_root"])
        _check_user_holds(out["user_holds"], out["without_failure"])


def _check_user_holds(out: dict, trained_without_holds: dict) -> None:
    units = len(out["held"])
    held = [index in (1, 2) for index in range(units)]
    assert out["held"] == held and out["values_equal"]
    assert out["held_after_forward"] == held
    # the forward gathered every unit once, except the two it found held
    assert out["gathers_in_forward"] == [0 if index in (1, 2) else 1 for index in range(units)]
    assert torch.equal(out["held_output"], out["free_output"])
    assert out["after_first_release"] == [index == 2 for index in range(units)]
    assert out["after_last_release"] == [False] * units
    for name, value in trained_without_holds.items():
        assert torch.equal(out["trained"][name], value), name


def _check_rows_and_root(out: dict) -> None:
    """A forward that follows the recorded order agrees on its gathers a window at a time. Of
    its 9 units (the root, then layers 0-7), the end of the last backward agreed the first
    window (root, layers 0-2); the forward asks for the next two (layers 3-6, then 7) and, at
    its end, for the backward's first two units (layers 7, 6; the backward sends a row per
    unit anyway): 3 rows, where a row per gather sent 9. The root unit stays gathered from the
    forward into its backward, and only there."""
    rows, (root,), layer = out["forward_rows"], out["root_index"], out["labels"].index
    assert out["labels"][root] == "<root>"
    expected = [[3, 4, 5, 6], [7], [7, 6]]
    assert [row_wants(row) for row in rows] == [[layer(f"layers.{k}") for k in wants] for wants in expected], rows
    assert [index for index, gathered in enumerate(out["gathered_after_forward"]) if gathered] == [root]
    assert not any(out["gathered_after_backward"])
    assert not out["root_after_no_grad"] and not out["root_after_call"]
    for name, value in out["without_call"].items():
        assert torch.equal(out["with_call"][name], value), name


def skip_on_one_rank(rank: int, world_size: int, skip_step: int, uneven: bool) -> dict[int, dict]:
    """The last rank leaves out layer 2 of eight at ``skip_step``, at stage 0 and stage 3.
    ``uneven``: the layer after it is smaller, so the ranks' next gathers differ in size too."""
    states = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = DeepModel(WIDTH)
        if uneven:
            model.layers[3] = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        config = {**_deep_config(), "comm": {"timeout_s": 30}}  # a hang would become a timeout error
        config["zero_optimization"]["stage"] = stage
        engine = zero_engine.initialize(model, config)
        for step in range(skip_step + 2):
            skip = 2 if step == skip_step and rank == world_size - 1 else -1
            engine.backward(engine(_deep_batch(step, rank), skip=skip))
            engine.step()
        states[stage] = engine.full_state_dict()
        engine.close()
    return states


@pytest.mark.parametrize(  # the fast run: a skip at the first step where the next gathers differ in size too
    "skip_step, uneven",
    [pytest.param(0, False, marks=pytest.mark.slow), pytest.param(1, False, marks=pytest.mark.slow), (0, True)],
)
def test_a_module_skipped_on_one_rank_trains_as_at_stage_0(skip_step: int, uneven: bool) -> None:
    # Step 0 has no recorded order (no prefetch): the forward gathers differ. Step 1 prefetches
    # the recorded next layer on every rank, so the backward's prefetches are where the ranks
    # part. Before stage 3 took part in other ranks' gathers, both raised DivergedRanksError;
    # uneven sizes would abort gloo's transport if different gathers were ever paired.
    for states in run_on_ranks(3, skip_on_one_rank, skip_step, uneven, timeout=120):
        for name, value in states[0].items():
            assert (states[3][name] - value).abs().max().item() <= TOL, name


def test_units_follow_no_split_modules_unless_the_config_names_classes() -> None:
    """A Hugging Face model declares its blocks in ``_no_split_modules``: without
    ``stage3_wrap_modules`` those are the units; the config's list wins; a model that declares
    nothing (or only classes it does not have) keeps the size rule."""
    from zero_engine.param_groups import resolve_param_groups
    from zero_engine.sharding.units.module_plan import plan_module_units

    def labels(model: torch.nn.Module, wrap: list[str] | None) -> list[str]:
        groups = resolve_param_groups(model, None, torch.optim.AdamW)
        plans, _ = plan_module_units(model, groups, wrap, min_unit_numel=10**9, persistence_threshold=0)
        return [plan.label for plan in plans]

    model = make_model()
    assert labels(model, None) == ["<root>"]  # the size rule, at a limit nothing reaches
    model._no_split_modules = {"Linear", "NotInThisModel"}  # a set, as transformers 5 keeps it
    assert labels(model, None) == ["<root>", "frozen", "fc1", "fc2", "head"]
    assert labels(model, ["LayerNorm"]) == ["<root>", "norm"]
    model._no_split_modules = ["NotInThisModel"]
    assert labels(model, None) == ["<root>"]


def test_a_step_refuses_a_unit_gathered_after_the_backward_with_nothing_holding_it() -> None:
    """GPU review Q1's guard: the backward's end frees every unit, so a unit gathered at the
    step with no hold on it was gathered between the backward and the step (the early launch
    of the next forward's gathers), and would carry the shards from before the step into the
    next forward: the step raises instead of training on them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    engine = zero_engine.initialize(model, engine_config(3, micro=2, lr=0.1, stage3_param_persistence_threshold=0))
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()  # nothing gathered: steps
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.gatherer.units[0].unshard(engine.comm)  # what the early launch did
    with pytest.raises(RuntimeError, match="gathered with nothing holding it"):
        engine.step()
