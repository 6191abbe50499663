"""Models built on the meta device, in real processes: deferred initialization identical at
every stage and world size, and pretrained weights that each rank reads only its part of.

The reference for initial values (`tests/meta_cases.py`) is written independently of the engine: the whole model
materialized in one process, each module that owns tensors (registers one first) seeded with
``module_seed(base, path)`` and initialized as a whole, in reverse ``named_modules()`` order so
that a tied tensor ends with its owner's values (as ``b.weight = a.weight`` after construction
leaves it when built eagerly).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from meta_cases import meta_trap_model, reference_init
from models import DeepModel, TrapModel, decay_groups, init_trap_model, train_engine, train_reference
from zero_engine.state.checkpoint import CheckpointError
from zero_engine.state.weights import open_weights

MICRO, STEPS, LR, TOL = 2, 2, 0.05, 2e-5
STAGE3_CUTS = [{"stage3_param_persistence_threshold": 0}, {"stage3_param_persistence_threshold": 30}]
INIT_CASES = [{"stage": s, "reduce_bucket_size": 40} for s in (0, 1, 2)] + [{"stage": 3, **cut} for cut in STAGE3_CUTS]


def _config(zero: dict) -> dict:
    return engine_config(micro=MICRO, lr=LR, **zero)


class TiedWithBias(nn.Module):
    """The tied head has a bias of its own: its ``reset_parameters()`` runs, and must not
    overwrite the embedding's (normal, unbounded) values with its uniform init."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.empty(8), persistent=False)

    def reset_parameters(self) -> None:  # the root's own tensor: a non-persistent cache
        self.positions.copy_(torch.arange(8.0) / 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens) * self.positions[: tokens.shape[-1]].unsqueeze(-1)).mean()


def init_grid(rank: int, world_size: int) -> dict:
    """Every stage from the meta device: initial state, then training as the parity grid does."""
    out: dict = {"init": [], "trained": [], "losses": []}
    for zero in INIT_CASES:
        model = meta_trap_model()
        engine = zero_engine.initialize(
            model, _config(zero), param_groups=decay_groups(model), param_init_fn=init_trap_model
        )
        out["init"].append(engine.full_state_dict())
        losses, _ = train_engine(engine, rank, world_size, range(STEPS), MICRO, 1)
        out["losses"].append(losses)
        out["trained"].append(engine.full_state_dict())
        engine.close()
    out["bf16"] = []  # mixed precision: the fp32 masters take the initial values exactly
    for stage in (1, 3):
        model = meta_trap_model()
        config = dict(_config({"stage": stage, "stage3_param_persistence_threshold": 0}), bf16={"enabled": True})
        engine = zero_engine.initialize(model, config, param_init_fn=init_trap_model)
        out["bf16"].append(engine.full_state_dict())
        engine.close()
    with torch.device("meta"):
        tied = TiedWithBias()
    engine = zero_engine.initialize(tied, _config({"stage": 3, "stage3_param_persistence_threshold": 0}))
    out["tied"] = engine.full_state_dict()
    out["positions"] = tied.positions.clone()
    out["tied_loss"] = engine(torch.arange(8).view(1, 8)).item()
    engine.close()
    try:
        zero_engine.initialize(meta_trap_model(), _config({"stage": 3}))
    except ValueError as err:
        out["error"] = str(err)
    return out


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]
)  # 3: padding
def test_meta_init_is_the_same_model_at_every_stage_and_world_size(world_size: int) -> None:
    per_rank = run_on_ranks(world_size, init_grid, timeout=240)
    expected = reference_init(TrapModel, init_trap_model)
    ref_losses, ref_trained, _ = train_reference(STEPS, MICRO * world_size, lr=LR, initial=expected)
    for rank, result in enumerate(per_rank):
        for case, state, losses, trained in zip(INIT_CASES, result["init"], result["losses"], result["trained"]):
            assert state.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(state[name], value), f"{case} rank {rank}: initial {name} differs"
            for name, value in ref_trained.items():
                diff = (trained[name] - value).abs().max().item()
                assert diff <= TOL, f"{case} rank {rank}: trained {name} differs by {diff}"
        frozen = {name for name, param in TrapModel().named_parameters() if not param.requires_grad}
        for state in result["bf16"]:  # frozen weights are stored in bf16: their fp32 init, rounded once
            for name, value in expected.items():
                assert torch.equal(state[name], value.to(torch.bfloat16).float() if name in frozen else value), name
        tied = result["tied"]
        assert tied["head.weight"].abs().max() > 1 / 16**0.5, "the head's uniform init overwrote the tied embedding"
        assert torch.equal(tied["head.weight"], tied["embed.weight"])
        assert torch.equal(result["positions"], torch.arange(8.0) / 8), "a non-persistent buffer was not initialized"
        assert "<root> (TrapModel: unused, temperature)" in result["error"]
        assert "param_init_fn" in result["error"]
    for step in range(STEPS):
        for case_index, case in enumerate(INIT_CASES):
            mean = sum(r["losses"][case_index][step][0] for r in per_rank) / world_size
            assert mean == pytest.approx(ref_losses[step], abs=TOL), (case, step)
    expected_tied = reference_init(TiedWithBias, lambda m: m.reset_parameters())
    for name, value in expected_tied.items():
        assert torch.equal(per_rank[0]["tied"][name], value), f"TiedWithBias: initial {name} differs"


# -- pretrained weights -----------------------------------------------------------------------

SOURCES = ("safetensors", "index", "torch", "bf16", "hf_dir", "checkpoint")
DEEP_WIDTH, DEEP_DEPTH = 48, 3


def _write_weight_files(root: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The same TrapModel weights in every accepted format; returns the paths and the values."""
    values = {k: v.detach().clone() for k, v in TrapModel().state_dict().items()}
    values["temperature"] = torch.tensor(2.5)  # a buffer the file must set, not its init
    torch.save(values, root / "weights.pt")
    # Hugging Face stores a tied weight once: the safetensors file drops the head's name...
    save_file({k: v for k, v in values.items() if k != "head.weight"}, str(root / "weights.safetensors"))
    (root / "hf").mkdir()
    save_file({k: v for k, v in values.items() if k != "head.weight"}, str(root / "hf" / "model.safetensors"))
    # ...and a sharded index the embedding's, across two files.
    (root / "index").mkdir()
    names = [k for k in values if k != "embed.weight"]
    halves = {"part-1.safetensors": names[: len(names) // 2], "part-2.safetensors": names[len(names) // 2 :]}
    for file, keys in halves.items():
        save_file({k: values[k] for k in keys}, str(root / "index" / file))
    weight_map = {k: file for file, keys in halves.items() for k in keys}
    (root / "index" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    bf16 = {k: v.to(torch.bfloat16) for k, v in values.items() if k != "head.weight"}
    save_file(bf16, str(root / "bf16.safetensors"))
    torch.manual_seed(3)
    save_file(DeepModel(DEEP_WIDTH, DEEP_DEPTH).state_dict(), str(root / "deep.safetensors"))
    files = {
        "safetensors": root / "weights.safetensors", "index": root / "index", "torch": root / "weights.pt",
        "bf16": root / "bf16.safetensors", "hf_dir": root / "hf", "checkpoint": root / "checkpoint",
        "deep": root / "deep.safetensors",
    }
    return {k: str(v) for k, v in files.items()}, values


def weights_grid(rank: int, world_size: int, files: dict[str, str]) -> dict:
    out: dict = {"states": {}, "bytes": {}}
    values = torch.load(files["torch"], weights_only=True)
    # A checkpoint written by an eagerly built engine at stage 1, its values from a state dict.
    engine = zero_engine.initialize(TrapModel(), _config({"stage": 1}), weights=values)
    engine.save_checkpoint(files["checkpoint"])
    engine.close()
    for stage in range(4):
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        for source in SOURCES:  # no param_init_fn: the file provides all the root's tensors
            engine = zero_engine.initialize(meta_trap_model(), _config(zero), weights=files[source])
            out["states"][stage, source] = engine.full_state_dict()
            engine.close()
        reader = open_weights(files["deep"])
        with torch.device("meta"):
            deep = DeepModel(DEEP_WIDTH, DEEP_DEPTH)
        engine = zero_engine.initialize(deep, _config(zero), weights=reader)
        out["bytes"][stage] = reader.bytes_read
        out["states"][stage, "deep"] = engine.full_state_dict()
        engine.close()
    engine = zero_engine.initialize(TrapModel(), _config({"stage": 3}), weights=files["safetensors"])
    out["states"]["eager", "safetensors"] = engine.full_state_dict()
    engine.close()
    misfit = dict(values, bogus=torch.ones(2), **{"fc2.weight": torch.zeros(3, 3)})
    del misfit["fc1.bias"]
    try:
        zero_engine.initialize(meta_trap_model(), _config({"stage": 3}), weights=misfit)
    except CheckpointError as err:
        out["misfit"] = str(err)
    return out


def test_weights_are_read_shard_by_shard_from_every_format(tmp_path: Path) -> None:
    world_size = 3
    files, values = _write_weight_files(tmp_path)
    per_rank = run_on_ranks(world_size, weights_grid, files, timeout=240)
    expected = {source: values for source in SOURCES}
    expected["bf16"] = {k: v.to(torch.bfloat16).float() for k, v in values.items()}
    assert not torch.equal(expected["bf16"]["fc1.weight"], values["fc1.weight"])
    deep = load_file(files["deep"])
    total = sum(v.numel() * 4 for v in deep.values())
    for rank, result in enumerate(per_rank):
        for (stage, source), state in result["states"].items():
            want = deep if source == "deep" else expected[source]
            assert state.keys() == want.keys(), (stage, source)
            for name, value in want.items():
                assert torch.equal(state[name], value), f"stage {stage} from {source}, rank {rank}: {name} differs"
        for stage in (0, 1, 2):
            assert result["bytes"][stage] == total, "below stage 3 every rank keeps (and reads) everything"
        # At stage 3 a rank reads its shard: a 1/N share, give or take the padding.
        assert result["bytes"][3] <= total / world_size + len(deep) * world_size * 4, result["bytes"][3]
        message = result["misfit"]
        for part in ("missing: fc1.bias", "unexpected: bogus", "re-shaped: fc2.weight (file [3, 3], model [7, 11])"):
            assert part in message, message
    assert sum(r["bytes"][3] for r in per_rank) == total, "the ranks' shards read every element once"


PADDED_CUT = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40}


def padded_weights_grid(rank: int, world_size: int, files: dict[str, str]) -> dict:
    """Stage 3 cut into units whose sizes the world size does not divide (embed 91, the root's
    19): every rank above 0 reads a range that starts after another rank's padding."""
    out: dict = {"states": {}}
    for source in ("safetensors", "index", "torch"):
        engine = zero_engine.initialize(meta_trap_model(), _config(PADDED_CUT), weights=files[source])
        out["padding"] = [unit.layout.padding_numel for unit in engine.units]
        out["states"][source] = engine.full_state_dict()
        engine.close()
    return out


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_weights_read_into_padded_stage3_units(tmp_path: Path, world_size: int) -> None:
    files, values = _write_weight_files(tmp_path)
    for rank, result in enumerate(run_on_ranks(world_size, padded_weights_grid, files, timeout=240)):
        assert max(result["padding"]) > 0, result["padding"]  # the case this test is for
        for source, state in result["states"].items():
            for name, value in values.items():
                assert torch.equal(state[name], value), f"{world_size} ranks, rank {rank}, {source}: {name} differs"


# -- a real model: Hugging Face GPT-2 ---------------------------------------------------------

GPT2_SEQ, GPT2_LR = 16, 1e-3


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=GPT2_SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )


def _gpt2_batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, 100, (rows, GPT2_SEQ), generator=torch.Generator().manual_seed(step))


def gpt2_grid(rank: int, world_size: int, directory: str) -> list[dict]:
    """Each stage: GPT-2 rebuilt on meta, its weights from the saved directory, then trained."""
    from transformers import GPT2LMHeadModel

    out = []
    for stage in range(4):
        with torch.device("meta"):
            model = GPT2LMHeadModel(_gpt2_config())
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": GPT2_LR, "weight_decay": 0.0}},
            "gradient_clipping": 0.0,  # the reference does not clip
            # Threshold 0: every parameter sharded at stage 3 (the default keeps all 28 whole). No
            # stage3_wrap_modules: the model's _no_split_modules (GPT2Block) cuts the units.
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine = zero_engine.initialize(model, config, weights=directory)
        initial = engine.full_state_dict()
        losses = []
        for step in range(STEPS):
            tokens = _gpt2_batch(step, MICRO * world_size)[rank * MICRO : (rank + 1) * MICRO]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        units = sorted(unit.label for unit in engine.units if unit.sharded_params)
        out.append({"initial": initial, "losses": losses, "trained": engine.full_state_dict(), "units": units})
        engine.close()
    return out


def _gpt2_reference(directory: Path, world_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=GPT2_LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        tokens = _gpt2_batch(step, MICRO * world_size)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def gpt2_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(_gpt2_config()).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)]
)
def test_hugging_face_gpt2_from_meta_with_its_saved_weights(world_size: int, gpt2_directory: Path) -> None:
    saved = load_file(str(gpt2_directory / "model.safetensors"))
    assert "lm_head.weight" not in saved, "save_pretrained stores the tied head once"
    saved["lm_head.weight"] = saved["transformer.wte.weight"]
    per_rank = run_on_ranks(world_size, gpt2_grid, str(gpt2_directory), timeout=300, allow_numpy=True)
    ref_losses, ref_trained = _gpt2_reference(gpt2_directory, world_size)
    for rank, results in enumerate(per_rank):
        assert results[3]["units"] == ["<root>", "transformer.h.0", "transformer.h.1"], results[3]["units"]
        for stage, result in enumerate(results):
            assert result["initial"].keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(result["initial"][name], value), f"stage {stage} rank {rank}: {name} differs"
            for name, value in ref_trained.items():
                diff = (result["trained"][name] - value).abs().max().item()
                assert diff <= TOL, f"stage {stage} rank {rank}: trained {name} differs by {diff}"
    for stage in range(4):
        for step in range(STEPS):
            mean = sum(results[stage]["losses"][step] for results in per_rank) / world_size
            assert mean == pytest.approx(ref_losses[step], abs=TOL), (stage, step)


def test_unreadable_weights_fail_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing-here does not exist"):
        open_weights(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no model.safetensors"):
        open_weights(tmp_path / "empty")
    save_file({"w": torch.ones(64)}, str(tmp_path / "cut.safetensors"))
    data = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"cut.safetensors: the tensors take 256 data bytes, the file holds 248"):
        open_weights(tmp_path / "cut.safetensors")
    # Headers that point outside the data, or into another tensor's bytes, as the reference
    # loader refuses them (a negative start read header bytes as weights).
    for name, offsets, match in [
        ("negative", {"a": [-8, 248], "b": [248, 256]}, "data_offsets that are not two non-negative"),
        ("overlap", {"a": [0, 128], "b": [64, 192]}, r"tensor 'b' at bytes \[64, 192\) overlaps"),
        ("gap", {"a": [0, 64], "b": [128, 192]}, r"tensor 'b' at bytes \[128, 192\) leaves a gap"),
    ]:
        header = {key: {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}
                  for key, (begin, end) in offsets.items()}
        encoded = json.dumps(header).encode()
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(max(e for _, e in offsets.values())))
        with pytest.raises(CheckpointError, match=f"{name}.safetensors: .*{match}"):
            open_weights(path)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="junk.safetensors: not a safetensors file"):
        open_weights(tmp_path / "junk.safetensors")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard files that are missing: \['gone.safetensors'\]"):
        open_weights(tmp_path / "index")
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="list.pt: holds a list, not a state dict"):
        open_weights(tmp_path / "list.pt")
