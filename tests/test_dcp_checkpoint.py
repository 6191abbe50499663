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
from tiny import llama
from zero_engine.state import formats, storage

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

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, schedule: Any = None) -> list[float]:
        losses = []
        for step in steps:
            x, y = batch(step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if schedule is not None:
                schedule.step()
            losses.append(global_loss(loss))
        return losses

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}

    out: dict[str, Any] = {}
    if save:
        model, optimizer = build(0)
        schedule = decaying(optimizer)  # torchtitan saves its position as the part "lr_scheduler"
        out["before"] = train(model, optimizer, range(STEPS), schedule)
        dcp.save({**fsdp_state(model, optimizer), "lr_scheduler": schedule.state_dict()}, checkpoint_id=f"{root}/fsdp")
        out["saved"] = full(model)
        out["after"] = train(model, optimizer, range(STEPS, 2 * STEPS), schedule)
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


def decaying(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.2 * step))


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
    """At each stage: the engine loads FSDP2's checkpoint (the schedule's position too) and
    trains 5 steps."""
    out = {}
    for stage in stages:
        engine = zero_engine.initialize(make_net(2), engine_config(stage, world), lr_scheduler=decaying)
        engine.load_checkpoint(root, tag="fsdp")
        out[stage] = {"after": engine_train(engine, rank, world, range(STEPS, 2 * STEPS)),
                      "params": engine.full_state_dict(), "step": engine.global_step}
        engine.close()
    return out


def engine_saves(rank: int, world: int, root: str, stages: list[int]) -> dict[int, Any]:
    """At each stage: 5 steps, a DCP save, 5 more; and the engine resuming from that save. At
    stage 3 the config's ``checkpoint_format`` chooses DCP, elsewhere ``format=``."""
    out = {}
    for stage in stages:
        optimizer = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}
        by_key = {"checkpoint_format": "dcp"} if stage == 3 else {}
        engine = zero_engine.initialize(make_net(0), {**engine_config(stage, world), "optimizer": optimizer, **by_key})
        engine_train(engine, rank, world, range(STEPS))
        engine.save_checkpoint(root, tag=f"s{stage}w{world}", format=None if by_key else "dcp")
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
    for case, model, config, tag in [
        ("re-shaped", wider, engine_config(3, world), "fsdp"), ("missing", deeper, engine_config(1, world), "fsdp"),
        ("optimizer", make_net(2), sgd, "fsdp"), ("state shape", make_net(2), engine_config(3, world), "odd-state"),
    ]:
        engine = zero_engine.initialize(model, config)
        before = engine.full_state_dict()
        try:
            engine.load_checkpoint(root, tag=tag)
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


# -- a Hugging Face model with a tied head, there and back -----------------------------------------


def tokens(step: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randint(0, 64, (GLOBAL_BATCH, 12), generator=torch.Generator().manual_seed(900 + step))
    share = GLOBAL_BATCH // world
    return rows[rank * share : (rank + 1) * share]


def perturbed_llama(seed: int) -> nn.Module:
    model = llama(tied=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def fsdp_llama(rank: int, world: int, root: str, load: str | None) -> dict[str, Any]:
    """FSDP2 over a tied tiny Llama (each decoder layer and the root): 3 steps and a save, then
    3 more; or from ``load``, 3 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    model = perturbed_llama(7) if load else llama(tied=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            ids = tokens(step, rank, world)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(global_loss(loss))
        return losses

    out: dict[str, Any] = {}
    if load is None:
        out["before"] = train(range(3))
        dcp.save(fsdp_state(model, optimizer), checkpoint_id=f"{root}/hf")
    else:
        state = fsdp_state(model, optimizer)
        dcp.load(state, checkpoint_id=f"{root}/{load}")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    out["after"] = train(range(3, 6))
    out["params"] = {name: param.full_tensor().detach().clone() for name, param in model.named_parameters()}
    return out


def engine_llama(rank: int, world: int, root: str) -> dict[str, Any]:
    """The engine at stage 3 loads FSDP2's save of the tied Llama, saves it again as DCP, and
    trains 3 steps."""
    config = {**engine_config(3, world), "zero_optimization": {"stage": 3, "reduce_bucket_size": 500}}
    engine = zero_engine.initialize(perturbed_llama(5), config)
    engine.load_checkpoint(root, tag="hf")
    engine.save_checkpoint(root, tag="hf-back", format="dcp")
    losses = []
    for step in range(3, 6):
        ids = tokens(step, rank, world)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(global_loss(loss))
    params = engine.full_state_dict()
    engine.close()
    return {"after": losses, "params": params}


def test_a_tied_hugging_face_model_goes_from_fsdp2_to_the_engine_and_back(tmp_path: Path) -> None:
    fsdp = run_on_ranks(2, fsdp_llama, str(tmp_path), None, allow_numpy=True)[0]
    ours = run_on_ranks(3, engine_llama, str(tmp_path), allow_numpy=True)[0]
    back = run_on_ranks(2, fsdp_llama, str(tmp_path), "hf-back", allow_numpy=True)[0]
    for found, what in ((ours, "the engine from FSDP2"), (back, "FSDP2 from the engine's save")):
        assert max(abs(a - b) for a, b in zip(found["after"], fsdp["after"])) <= TOL, (what, found["after"], fsdp["after"])
    assert_close({name: ours["params"][name] for name in fsdp["params"]}, fsdp["params"], "the engine from FSDP2")
    assert torch.equal(ours["params"]["lm_head.weight"], ours["params"]["model.embed_tokens.weight"])  # still tied
    assert_close(back["params"], fsdp["params"], "FSDP2 from the engine's save")


def assert_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(ours) == sorted(theirs), what
    for name in theirs:
        gap = (ours[name].float() - theirs[name].float()).abs().max().item()
        assert gap <= TOL, f"{what}: {name} off by {gap}"


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("dcp")
    return root, run_on_ranks(2, fsdp_run, str(root), [], True, allow_numpy=True)[0]


@pytest.mark.parametrize("world, stages", [
    (2, [0, 1, 2, 3]), (3, [3]),
    pytest.param(1, [0, 1, 2, 3], marks=pytest.mark.slow), pytest.param(3, [0, 1, 2], marks=pytest.mark.slow),
])
def test_the_engine_resumes_fsdp2s_checkpoint_at_every_stage(fsdp_saved: tuple[Path, dict[str, Any]], world: int,
                                                             stages: list[int]) -> None:
    root, fsdp = fsdp_saved
    for stage, found in run_on_ranks(world, engine_resumes, str(root), stages)[0].items():
        assert max(abs(a - b) for a, b in zip(found["after"], fsdp["after"])) <= TOL, (stage, found["after"], fsdp["after"])
        assert_close(found["params"], fsdp["params"], f"stage {stage}, world {world}")


def test_a_dcp_checkpoint_that_does_not_fit_is_refused_on_every_rank(fsdp_saved: tuple[Path, dict[str, Any]]) -> None:
    import torch.distributed.checkpoint as dcp

    root, fsdp = fsdp_saved
    odd = {"state.0.weight.exp_avg": torch.zeros(3), "param_groups.0.weight.lr": 0.01}  # a moment of 3 for a 10 x 7 weight
    dcp.save({"model": make_net(0).state_dict(), "optimizer": odd}, checkpoint_id=root / "odd-state")  # one process
    for rank, found in enumerate(run_on_ranks(2, refusals, str(root))):
        for case in ("re-shaped", "missing", "optimizer", "state shape"):
            assert "failed on 2 of 2 ranks" in found[case], (rank, case, found[case])
            assert found[f"{case} untouched"], (rank, case)
        assert "re-shaped: 0.bias (checkpoint [10], model [11]), 0.weight (checkpoint [10, 7], model [11, 7])" in found["re-shaped"]
        assert "missing: 6.bias, 6.weight" in found["missing"], found["missing"]
        assert "optimizer options amsgrad, betas" in found["optimizer"] and "not SGD's" in found["optimizer"], found["optimizer"]
        assert "optimizer.state.0.weight.exp_avg has shape [3], its parameter [10, 7]" in found["state shape"]
        assert_close(found["weights"], fsdp["saved"], "weights=")


@pytest.mark.parametrize("cases", [
    {1: [0], 2: [1], 3: [3]},
    pytest.param({1: [1, 3], 2: [0, 3], 3: [0, 1]}, marks=pytest.mark.slow),  # with the fast one: stages 0, 1, 3 at worlds 1-3
])
def test_fsdp2_resumes_the_engines_dcp_checkpoint(tmp_path: Path, cases: dict[int, list[int]]) -> None:
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


class FullDisk(storage.FileWriter):
    """A disk that fills at the first file the save writes through the writer."""

    def write_file(self, path: Path, payload: Any) -> dict[str, int | str]:
        raise OSError(f"{path}: No space left on device")


def damaged_and_failed(rank: int, world: int, root: str) -> dict[str, str]:
    """A DCP save verified as the own format's are: a flipped byte in a data file is refused on
    every rank; a save whose disk fills leaves nothing behind."""
    engine = zero_engine.initialize(make_net(0), engine_config(1, world))
    engine_train(engine, rank, world, range(2))
    path = engine.save_checkpoint(root, tag="good", format="dcp")
    if rank == 0:
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / "__1_0.distcp").write_bytes(bytes(data))
    engine.comm.barrier()
    found = {}
    for case, call in [("damaged", lambda: engine.load_checkpoint(root, tag="good")),
                       ("full disk", lambda: engine.save_checkpoint(root, tag="full", format="dcp"))]:
        engine.checkpoint_writer = FullDisk() if case == "full disk" else storage.FILES
        try:
            call()
            found[case] = "accepted"
        except zero_engine.CheckpointError as err:
            found[case] = str(err)
    found["left"] = sorted(p.name for p in Path(root).iterdir())
    engine.close()
    return found


def test_a_dcp_save_is_verified_and_atomic(tmp_path: Path) -> None:
    for found in run_on_ranks(2, damaged_and_failed, str(tmp_path)):
        assert "failed on 2 of 2 ranks" in found["damaged"] and "__1_0.distcp: checksum does not match" in found["damaged"]
        assert "No space left on device" in found["full disk"], found["full disk"]
        assert found["left"] == ["good", "latest"], found["left"]  # no half-written tag, no staging directory


def test_zero_engine_convert_goes_between_dcp_and_the_other_formats(fsdp_saved: tuple[Path, dict[str, Any]],
                                                                    tmp_path: Path) -> None:
    """``zero-engine convert``: FSDP2's checkpoint into this engine's format (which resumes as the
    DCP one does), and a DeepSpeed checkpoint into DCP's (which torch's own ``dcp_to_torch_save``
    reads, the same weights)."""
    import subprocess
    import sys

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, fsdp = fsdp_saved
    cli = [sys.executable, "-m", "zero_engine.cli", "convert"]
    done = subprocess.run([*cli, str(root), str(tmp_path / "ours"), "--tag", "fsdp"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "a dcp checkpoint as zero_engine" in done.stdout, done.stdout
    assert (tmp_path / "ours" / "fsdp" / "manifest.json").is_file()
    found = run_on_ranks(2, engine_resumes, str(tmp_path / "ours"), [3])[0][3]
    assert max(abs(a - b) for a, b in zip(found["after"], fsdp["after"])) <= TOL
    assert_close(found["params"], fsdp["params"], "resumed from the converted checkpoint")

    deepspeed = Path(__file__).parent / "data" / "deepspeed_checkpoints" / "stage3_bf16"
    done = subprocess.run([*cli, str(deepspeed), str(tmp_path / "dcp"), "--to", "dcp"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    tag = (tmp_path / "dcp" / "latest").read_text()
    dcp_to_torch_save(tmp_path / "dcp" / tag, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    direct = zero_engine.load_consolidated(deepspeed)
    assert sorted(full["model"]) == sorted(direct)
    assert all(torch.equal(full["model"][name], direct[name]) for name in direct)
    assert any(key.endswith(".exp_avg_sq") for key in full["optimizer"]), sorted(full["optimizer"])[:4]
    assert full["train_state"]["step"] == formats.open_source(deepspeed).extra["global_step"] > 0


@pytest.mark.parametrize("shape", [(5,), (4, 6), (3, 4, 5), ()])
def test_pieces_and_chunks_meet_in_the_flat_order(shape: tuple[int, ...]) -> None:
    """A flat piece as rectangles, each one run of the flat order; any chunk (FSDP2's row
    block, a tensor-parallel column block, a 3-D corner) as runs holding exactly its elements."""
    import itertools
    import math

    from zero_engine.state.dcp_layout import rectangles, runs

    total = math.prod(shape)
    whole = torch.arange(total).view(shape)
    for start in range(total + 1):
        for numel in range(total - start + 1):
            at = 0
            for rect in rectangles(shape, start, numel):
                cut = whole[tuple(slice(o, o + s) for o, s in zip(rect.offsets, rect.sizes))]
                assert torch.equal(cut.reshape(-1), torch.arange(start + rect.lo, start + rect.hi))
                assert (rect.lo, [r.start for r in runs(shape, rect.offsets, rect.sizes)]) == (at, [start + rect.lo])
                at = rect.hi
            assert at == numel
    for offsets in itertools.product(*(range(d) for d in shape)):
        for sizes in itertools.product(*(range(1, d - o + 1) for d, o in zip(shape, offsets))):
            chunk = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            found = runs(shape, offsets, sizes)
            assert sum(run.numel for run in found) == chunk.numel()
            for run in found:
                assert torch.equal(chunk[run.within : run.within + run.numel], torch.arange(run.start, run.start + run.numel))
