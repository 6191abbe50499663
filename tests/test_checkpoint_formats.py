"""The checkpoint format seam (STRUCTURE item 5): a format is a probe, a reader and a writer in
one table (`zero_engine.state.formats`). A toy format registered here, in a layout of its own (a
head file and one file per rank, no manifest), saves at stage 3 on 2 ranks and resumes on 3 at
stages 1 and 3, found by its probe, training on exactly as the engine's own format resumes;
``save_checkpoint(format=...)`` and ``checkpoint_format`` choose the writer, a wrong name is
refused before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zero_engine
from harness import run_on_ranks
from models import make_model, train_engine
from zero_engine.state import formats
from zero_engine.state.every_rank import on_every_rank
from zero_engine.state.payload import Counters, PieceIndex, Resumable, extra_payload, manifest_of, rank_payload
from zero_engine.state.sources import Source
from zero_engine.state.storage import Checkpoint, FileWriter

HEAD = "toy-head.pt"


def _toy_finds(directory: Path, tag: str | None) -> bool:
    return tag is not None and (directory / tag / HEAD).is_file()


def _toy_save(state: Resumable, counters: Counters, directory: Path, tag: str, client_state: Any,
              writer: FileWriter) -> Path:
    path, comm = directory / tag, state.model.comm

    def write() -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(rank_payload(state), path / f"toy-{comm.rank}.pt")
        if comm.rank == 0:
            manifest = manifest_of(state, counters, tag, {})
            torch.save({"manifest": manifest, "extra": extra_payload(state, counters, client_state)}, path / HEAD)

    on_every_rank(comm, "toy save", write)
    return path


def _toy_read(directory: Path, tag: str | None) -> Source:
    path = directory / str(tag)
    head = torch.load(path / HEAD, weights_only=True)
    ranks = range(head["manifest"]["world_size"])
    payloads = [torch.load(path / f"toy-{rank}.pt", weights_only=True) for rank in ranks]
    index = PieceIndex((piece for payload in payloads for piece in payload["pieces"]), [p["rng"] for p in payloads])
    return Source(Checkpoint(path, head["manifest"]), index, head["extra"], [], "toy")


TOY = formats.CheckpointFormat("toy", _toy_finds, _toy_read, _toy_save)


def _config(stage: int, **extra: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra,
    }


def _save_both(rank: int, world_size: int, root: str) -> dict:
    formats.register(TOY)
    engine = zero_engine.initialize(make_model(), _config(3, checkpoint_format="toy"))
    train_engine(engine, rank, world_size, range(3), 2, 2)
    written = {
        "toy": engine.save_checkpoint(root, tag="toy").name,  # the config's default
        "own": engine.save_checkpoint(root, tag="own", format="zero_engine").name,
    }
    refusals = {}
    for name in ("deepspeed", "nope"):
        try:
            engine.save_checkpoint(root, tag=f"bad-{name}", format=name)
        except ValueError as err:
            refusals[name] = str(err)
    written["files"] = sorted(p.name for p in (Path(root) / "toy").iterdir())
    return {**written, "refusals": refusals, "left": sorted(p.name for p in Path(root).iterdir())}


def _resume(rank: int, world_size: int, root: str, stage: int) -> dict:
    formats.register(TOY)
    out = {}
    for tag in ("toy", "own"):
        engine = zero_engine.initialize(make_model(seed=7), _config(stage))  # other initial values
        engine.load_checkpoint(root, tag=tag)
        losses, norms = train_engine(engine, rank, world_size, range(3, 6), 2, 2)
        out[tag] = {"step": engine.global_step, "losses": losses, "norms": norms, "state": engine.full_state_dict(),
                    "reader": formats.reading(root, tag).name}
    return out


def _unknown_key(rank: int, world_size: int, name: str = "orbax") -> str:
    try:
        zero_engine.initialize(make_model(), _config(1, checkpoint_format=name))
    except zero_engine.ConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("stages", [(3,), pytest.param((1,), marks=pytest.mark.slow)])
def test_a_registered_format_saves_at_stage_3_on_2_ranks_and_resumes_on_3(tmp_path: Path, stages: tuple) -> None:
    saved = run_on_ranks(2, _save_both, str(tmp_path))[0]
    assert (saved["toy"], saved["own"]) == ("toy", "own")
    assert saved["files"] == ["toy-0.pt", "toy-1.pt", HEAD]  # the toy's own layout: no manifest
    assert "'deepspeed' is read, not written" in saved["refusals"]["deepspeed"]
    assert "'nope' is not a registered format" in saved["refusals"]["nope"]
    assert saved["left"] == ["latest", "own", "toy"]  # nothing written for a refused name
    for stage in stages:
        resumed = run_on_ranks(3, _resume, str(tmp_path), stage)
        for rank, found in enumerate(resumed):
            toy, own = found["toy"], found["own"]
            assert (toy["reader"], own["reader"]) == ("toy", "zero_engine")
            assert toy["step"] == own["step"] == 6
            assert toy["losses"] == own["losses"] and toy["norms"] == own["norms"], (stage, rank)
            for name, value in own["state"].items():
                assert torch.equal(toy["state"][name], value), (stage, rank, name)


def test_the_default_format_key_names_what_is_written() -> None:
    message = run_on_ranks(1, _unknown_key)[0]
    assert message.startswith("checkpoint_format: checkpoint format 'orbax' is not a registered format"), message
    assert "'zero_engine'" in message


def test_readers_are_picked_by_probe(tmp_path: Path) -> None:
    """The built-in probes: ours by its manifest, DeepSpeed's by its model-states file; a
    registered format is asked first, and a directory none claims is read as ours."""
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "manifest.json").write_text("{}")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / HEAD).write_bytes(b"")
    assert formats.reading(tmp_path, "ours").name == "zero_engine"
    assert formats.reading(tmp_path, "theirs").name == "deepspeed"
    assert formats.reading(tmp_path, "toy").name == "zero_engine"  # not registered: read as ours
    formats.register(TOY)
    try:
        assert formats.reading(tmp_path, "toy").name == "toy"
        assert formats.finds_any(tmp_path, "toy") and not formats.finds_any(tmp_path, "elsewhere")
    finally:
        formats.unregister("toy")
    assert [f.name for f in formats.known()] == ["dcp", "deepspeed", "zero_engine"]
    with pytest.raises(ValueError, match="the formats written are 'dcp', 'zero_engine'"):
        formats.writing("deepspeed")
