"""``engine.save_pretrained`` and ``zero-engine consolidate --format hf``: the model in Hugging
Face's layout, streamed, in real processes.

What ``from_pretrained`` reads back must equal ``full_state_dict()`` exactly (tied weights
written once, under the name transformers keeps); the index must name every tensor in the file
that holds it; a second export into the same directory must leave no file of the first; the
engine must train on as if it had not saved. And rank 0's resident high-water mark during the
save must grow by about one unit plus one shard, not by the model: measured as the process holds
it, with the whole model gathered first (``full_state_dict``) shown to break the same bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from zero_engine.state.export import parse_dtype, parse_shard_size, plan_shards
from zero_engine.state.safetensors_file import TensorSpec
from zero_engine.testing.process_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

MICRO, SEQ, LR = 2, 16, 1e-3
MiB = 2**20


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens = torch.randint(0, 100, (MICRO * world_size, SEQ), generator=torch.Generator().manual_seed(step))
        tokens = tokens[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# Each case: zero_optimization keys, save_pretrained's arguments, and a second shard size for
# the re-save into the same directory (None: none).
CASES = {
    "stage3": ({"stage": 3, "stage3_param_persistence_threshold": 0}, {}, None),
    "stage2_shards": ({"stage": 2}, {"max_shard_size": "20KB"}, "5GB"),
    "stage1_bf16": ({"stage": 1}, {"max_shard_size": 30_000, "dtype": "bfloat16"}, None),
    "stage3_offload": (
        {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
        {"max_shard_size": "0.05MB"},
        "15KB",
    ),
}


def gpt2_exports(rank: int, world_size: int, root: str, cases: list[str]) -> dict:
    out = {}
    for name in cases:
        zero, arguments, resave = CASES[name]
        config = engine_config(micro=MICRO, lr=LR, **zero)
        engine = zero_engine.initialize(_gpt2(), config)
        twin = zero_engine.initialize(_gpt2(), config)  # the same training without the export
        _train(engine, rank, world_size, range(2))
        _train(twin, rank, world_size, range(2))
        directory = Path(root) / name
        returned = engine.save_pretrained(directory, **arguments)
        files_when_returned = sorted(path.name for path in directory.iterdir())  # complete on every rank
        state = engine.full_state_dict()
        if resave is not None:
            first_files = files_when_returned
            engine.save_pretrained(directory, max_shard_size=resave)
            files_when_returned = sorted(path.name for path in directory.iterdir())
        losses, twin_losses = _train(engine, rank, world_size, range(2, 4)), _train(twin, rank, world_size, range(2, 4))
        after, twin_after = engine.full_state_dict(), twin.full_state_dict()
        out[name] = {
            "returned": str(returned),
            "files": files_when_returned,
            "first_files": first_files if resave is not None else None,
            "state": state if rank == 0 else None,
            "trains_on": losses == twin_losses and all(torch.equal(after[k], twin_after[k]) for k in after),
        }
        for each in (engine, twin):
            each.close()
    return out


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("exports")
    return root, run_on_ranks(2, gpt2_exports, str(root), list(CASES), allow_numpy=True, timeout=300)


def _files_equal_state(directory: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """``from_pretrained`` gives back ``state`` exactly (cast to ``dtype`` when given)."""
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(directory, dtype=dtype or torch.float32).state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        expected = value if dtype is None else value.to(dtype)
        assert loaded[key].dtype == expected.dtype and torch.equal(loaded[key], expected), key


def _read_layout(directory: Path) -> dict[str, str]:
    """The weight map, checked against the files: every tensor in the file the index names, the
    index's total the tensors' bytes; one file without an index."""
    index_file = directory / "model.safetensors.index.json"
    shards = sorted(directory.glob("model*.safetensors"))
    if not index_file.exists():
        assert [path.name for path in shards] == ["model.safetensors"]
        with safe_open(shards[0], "pt") as file:
            return {key: shards[0].name for key in file.keys()}
    index = json.loads(index_file.read_text())
    assert [path.name for path in shards] == sorted(set(index["weight_map"].values()))
    total, found = 0, {}
    for shard in shards:
        with safe_open(shard, "pt") as file:
            assert file.metadata() == {"format": "pt"}
            for key in file.keys():
                tensor = file.get_tensor(key)
                total += tensor.numel() * tensor.element_size()
                found[key] = shard.name
    assert found == index["weight_map"] and index["metadata"]["total_size"] == total
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_loads_back_as_the_trained_model(case: str, gpt2_runs: tuple[Path, list[dict]]) -> None:
    root, per_rank = gpt2_runs
    directory = root / case
    results = [ranks[case] for ranks in per_rank]
    state = results[0]["state"]
    assert all(result["returned"] == str(directory) for result in results)
    assert results[0]["files"] == results[1]["files"]  # every rank saw the finished export
    assert {"config.json", "generation_config.json"} <= set(results[0]["files"])
    arguments, resave = CASES[case][1], CASES[case][2]
    dtype = parse_dtype(arguments.get("dtype")) if resave is None else None
    _files_equal_state(directory, state, dtype)
    weight_map = _read_layout(directory)
    # GPT-2 ties lm_head to the token embedding: written once, under the embedding's name
    assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map
    assert set(weight_map) == set(state) - {"lm_head.weight"}
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert all(result["trains_on"] for result in results), "the export changed the training"
    if case == "stage2_shards":
        assert len([name for name in results[0]["first_files"] if name.startswith("model-")]) >= 5
    if resave is not None:  # the second export's layout alone: no shard of the first is left
        expected = len(plan_shards(_entries(state), parse_shard_size(resave)))
        shard_names = [name for name in results[0]["files"] if name.endswith(".safetensors")]
        assert len(shard_names) == expected and (expected > 1) == ("model.safetensors.index.json" in results[0]["files"])
        assert set(results[0]["first_files"]) - set(results[0]["files"]), "the re-save wrote the same names"


def _entries(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(key, torch.float32, tuple(value.shape)) for key, value in state.items() if key != "lm_head.weight"]


def test_cli_writes_the_engines_export_from_a_checkpoint(tmp_path: Path) -> None:
    """``zero-engine consolidate CKPT OUT --format hf`` in one process: the same tensors as the
    engine's own export of the same state, and the same shard layout."""
    run_on_ranks(2, _save_both, str(tmp_path), allow_numpy=True, timeout=300)
    out = tmp_path / "from_checkpoint"
    command = [sys.executable, "-m", "zero_engine.cli", "consolidate", str(tmp_path / "ckpt"), str(out),
               "--format", "hf", "--max-shard-size", "20KB"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    engine_files = sorted(path.name for path in (tmp_path / "engine").glob("model*"))
    assert sorted(path.name for path in out.iterdir()) == engine_files
    assert _read_layout(out) == _read_layout(tmp_path / "engine")
    for name in engine_files:
        if name.endswith(".safetensors"):
            ours, theirs = load_file(out / name), load_file(tmp_path / "engine" / name)
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _save_both(rank: int, world_size: int, root: str) -> None:
    engine = zero_engine.initialize(_gpt2(), engine_config(3, micro=MICRO, lr=LR, stage3_param_persistence_threshold=0))
    _train(engine, rank, world_size, range(2))
    engine.save_checkpoint(Path(root) / "ckpt")
    engine.save_pretrained(Path(root) / "engine", max_shard_size="20KB")


def test_bad_arguments_are_refused_before_any_collective() -> None:
    for value in (0, -3, "5 parsecs", True, 1.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_shard_size(value)
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2MiB") == 2 * MiB
    for value in ("int8", torch.int64, 3):
        with pytest.raises(ValueError, match="dtype"):
            parse_dtype(value)


# -- memory: one unit and one shard, not the model --------------------------------------------

WIDTH, DEPTH = 1024, 12  # 12 blocks of two 4 MiB weights: 96 MiB of fp32 masters
UNIT_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4
SHARD = 6 * MiB  # the model is 16 shards' worth
SLACK = 4 * MiB


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def export_growth(rank: int, world_size: int, root: str, stages: list[int]) -> dict:
    """Rank 0's resident high-water mark above its level before the call: the streamed export,
    then ``full_state_dict(rank0_only=True)`` (the whole model on rank 0)."""
    torch.manual_seed(0)
    out = {}
    for stage in stages:
        engine = zero_engine.initialize(Tower(), engine_config(stage, micro=1, lr=LR, stage3_param_persistence_threshold=0))
        engine.backward(engine(torch.randn(1, WIDTH)).sum())
        engine.step()
        growth = {}
        # The whole model first: the first collective call after a step also completes the
        # gathers already agreed for the next forward (at stage 3, up to the prefetch depth of
        # units, the forward's own peak), which is not the export's memory.
        for label, call in (
            ("whole", lambda: engine.full_state_dict(rank0_only=True)),
            ("export", lambda: engine.save_pretrained(Path(root) / f"stage{stage}", max_shard_size=SHARD)),
        ):
            before = resident_bytes()
            reset_peak_resident()
            kept = call()
            growth[label] = peak_resident_bytes() - before
            del kept
        out[stage] = growth
        engine.close()
    return out


@pytest.mark.parametrize("stages", [[3], pytest.param([2], marks=pytest.mark.slow)])
def test_rank0_memory_grows_by_a_unit_and_a_shard_and_the_others_by_nothing(stages: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    model_bytes = DEPTH * UNIT_BYTES
    rank0, rank1 = run_on_ranks(2, export_growth, str(tmp_path), stages, timeout=300)
    for stage in stages:
        # The other ranks send their shard from the master itself: no whole unit (GPU review P4).
        assert rank1[stage]["export"] < UNIT_BYTES / 2, (stage, rank1[stage])
        growth = rank0[stage]
        # One gathered unit and one tensor's copy at a time (tensors go straight into their
        # file): below the unit plus max_shard_size that holding a shard's tensors would take.
        bound = UNIT_BYTES + WIDTH * WIDTH * 4 + SLACK
        assert bound < UNIT_BYTES + SHARD + SLACK and growth["export"] <= bound, (stage, growth, bound)
        assert growth["whole"] >= model_bytes - SLACK > bound, (stage, growth)  # the same probe sees a whole model
        assert len(list((tmp_path / f"stage{stage}").glob("model-*.safetensors"))) >= 16


def test_each_shard_holds_at_most_max_shard_size_unless_one_tensor_is_larger() -> None:
    """Shards are filled in order up to ``max_shard_size`` bytes (a shard of exactly that size
    is full), and a tensor larger than that sits alone in its own."""
    sizes = [4, 8, 4, 40, 12, 16, 4, 4]  # fp32 elements: 16, 32, 16, 160, 48, 64, 16, 16 bytes
    entries = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate(sizes)]
    shards = plan_shards(entries, 64)
    assert [[entry.name for entry in shard] for shard in shards] == [
        ["t0", "t1", "t2"], ["t3"], ["t4"], ["t5"], ["t6", "t7"]
    ]
    for shard in shards:
        assert len(shard) == 1 or sum(entry.nbytes for entry in shard) <= 64, shard
    assert [entry.name for shard in shards for entry in shard] == [entry.name for entry in entries]
