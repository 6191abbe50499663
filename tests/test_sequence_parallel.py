"""``sequence_parallel_size``: Ulysses sequence parallelism (`zero_engine.transforms.ulysses`)
against the same Hugging Face model trained in one process on the same global batches, in real
processes on gloo: the per-step loss, gradient norm and every parameter after the steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from sequence_cases import (
    ACCUM,
    MICRO,
    STEPS,
    TOL,
    assert_trains_as,
    batches,
    case_inputs,
    case_model,
    prompt_labels,
    reference,
    sequence_llama,
)


def sequence_parallel(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        config = engine_config(case["stage"], micro=MICRO, accum=ACCUM, lr=1e-3, clip=1.0,
                               optimizer_params={"weight_decay": 0.0}, recompute_units=case.get("recompute"))
        config["sequence_parallel_size"] = case["k"]
        model = case_model(case)
        engine = zero_engine.initialize(model, config)
        data_rank = engine.data_parallel_rank
        losses, norms = [], []
        for step in batches(case["length"], engine.data_parallel_world_size, case.get("steps", STEPS)):
            ids = step[data_rank]
            step_losses = []
            for micro in range(ACCUM):
                loss = engine(**case_inputs(case, ids[micro], micro)).loss
                engine.backward(loss)
                step_losses.append(loss.item())
                engine.step()
            losses.append(step_losses)
            norms.append(engine.get_global_grad_norm())
        results.append({"losses": losses, "norms": norms, "state": engine.full_state_dict(),
                        "batch": engine.train_batch_size(), "all_to_all": engine.comm_report()["all_to_all"]})
        engine.close()
    return results


def _check(case: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    assert_trains_as(reference(case), per_rank, case, case.get("steps", STEPS))
    for result in per_rank:
        assert result["batch"] == MICRO * ACCUM * case["world"] // case["k"]
        assert result["all_to_all"]["sent"] > 0


# 8 query and 2 key/value heads: at k = 4 the key/value heads are repeated; a length k does not
# divide is padded; labels -100 on the first third: at k = 4 rank 0's slice has no valid label.
GRIDS = {
    # the Qwen3 twin: each head's queries and keys normalized before the exchange
    2: [{"world": 2, "k": 2, "stage": 3, "attention": "eager", "length": 15, "qwen3": True},
        # the Mistral twin: a window of 5 keys over the whole sequence, not over a rank's slice
        {"world": 2, "k": 2, "stage": 3, "attention": "sdpa", "length": 16, "window": 5, "packed": True},
        # left-padded as collators label it: the last pad's output is read (it predicts the first
        # real token), and at 15 tokens the split's own end pad must weigh nothing in its empty row
        {"world": 2, "k": 2, "stage": 0, "attention": "eager", "length": 15, "padded": "left"}],
    3: [{"world": 3, "k": 3, "stage": 3, "attention": "sdpa", "length": 16, "heads": 6, "packed": True},
        # padding on every other micro-batch, with a window: no mask is kept from the last forward
        {"world": 3, "k": 3, "stage": 0, "attention": "eager", "length": 14, "heads": 6, "padded": "alternate",
         "window": 4}],
}
# At 4 ranks (4 processes on CI's 2 cores: the slow run): k = 4 repeats the key/value heads;
# 2 data-parallel x 2 sequence with each decoder layer recomputed in backward (its exchanges too).
WORLD_4 = [{"world": 4, "k": 4, "stage": 3, "attention": "sdpa", "length": 18, "padded": "left"},
           {"world": 4, "k": 2, "stage": 0, "attention": "eager", "length": 15, "recompute": True}]
SLOW_GRIDS = {
    2: [{"world": 2, "k": 2, "stage": stage, "attention": attention, "length": 15, "steps": 10}
        for stage in (1, 2) for attention in ("sdpa", "eager")]
    + [{"world": 2, "k": 2, "stage": 0, "attention": "sdpa", "length": 16, "steps": 10}],
    3: [{"world": 3, "k": 3, "stage": 0, "attention": "sdpa", "length": 17, "heads": 6, "steps": 10}],
    4: [{"world": 4, "k": 2, "stage": stage, "attention": "sdpa", "length": 17, "steps": 10} for stage in (1, 2, 3)]
    + [{"world": 4, "k": 4, "stage": 3, "attention": "eager", "length": 18, "window": 6, "steps": 10}] + WORLD_4,
}


@pytest.mark.parametrize("world", sorted(GRIDS))
def test_sequence_parallel_matches_one_process(world: int) -> None:
    per_rank = run_on_ranks(world, sequence_parallel, GRIDS[world], allow_numpy=True, timeout=400)
    for index, case in enumerate(GRIDS[world]):
        _check(case, [result[index] for result in per_rank])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_GRIDS))
def test_sequence_parallel_matches_one_process_at_stages_1_and_2(world: int) -> None:
    per_rank = run_on_ranks(world, sequence_parallel, SLOW_GRIDS[world], allow_numpy=True, timeout=600)
    for index, case in enumerate(SLOW_GRIDS[world]):
        _check(case, [result[index] for result in per_rank])


# What else the engine holds or runs, with the sequence split over every rank's group (the issue's
# item 1): the same Llama, its embedding and first MLP frozen where a case says so, against one
# process started from the engine's own first values (int8 frozen weights: the decoded base).
FROZEN = ("model.embed_tokens.", "model.layers.0.mlp.")
COMPOSED = {
    2: [{"k": 2, "stage": 3, "frozen": True, "zero": {"zero_quantized_nontrainable_weights": True,
                                                       "stage3_param_persistence_threshold": 0}},
        {"k": 2, "stage": 2, "zero": {"offload_optimizer": {"device": "cpu"}}},
        {"k": 2, "stage": 3, "frozen": True, "zero": {
            "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"},
            "stage3_param_persistence_threshold": 0}},
        {"k": 2, "stage": 3, "muon": True},
        {"k": 2, "stage": 1, "muon": True, "zero": {"offload_optimizer": {"device": "nvme"}}},
        {"k": 2, "stage": 3, "frozen": "all"}],  # an engine without an optimizer: the loss alone
    # hybrid: 2 shard groups of 2 ranks, each one sequence group; 2 data-parallel ranks
    4: [{"k": 2, "stage": 3, "frozen": True, "zero": {"shard_group_size": 2}}],
}


def _composed_model(case: dict[str, Any]) -> Any:
    model = sequence_llama()
    for name, param in model.named_parameters():
        param.requires_grad_(not (case.get("frozen") == "all" or case.get("frozen") and name.startswith(FROZEN)))
    return model


def _composed_config(case: dict[str, Any], directory: str) -> dict[str, Any]:
    zero = {key: {**value, "nvme_path": directory} if key.startswith("offload_") else value
            for key, value in case.get("zero", {}).items()}
    config = engine_config(case["stage"], micro=MICRO, accum=ACCUM, lr=1e-3, clip=1.0,
                           optimizer_params={"weight_decay": 0.0}, **zero)
    config["sequence_parallel_size"] = case["k"]
    if case.get("muon"):
        config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}}
    if case.get("frozen") == "all":
        del config["optimizer"]
    return config


def composed(rank: int, world_size: int, cases: list[dict[str, Any]], directory: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for case in cases:
        engine = zero_engine.initialize(_composed_model(case), _composed_config(case, directory))
        first = engine.full_state_dict()
        losses = []
        for step in batches(15, engine.data_parallel_world_size, 3):
            step_losses = []
            for micro in range(ACCUM):
                loss = engine(**case_inputs(case, step[engine.data_parallel_rank][micro])).loss
                if engine.optimizer is not None:
                    engine.backward(loss)
                    engine.step()
                step_losses.append(loss.item())
            losses.append(step_losses)
        report = engine.comm_report()
        results.append({"first": first, "losses": losses, "state": engine.full_state_dict(),
                        "all_to_all": report["all_to_all"]["sent"], "nvme": report.get("nvme", {}),
                        "int8_units": sum(unit.quantized for unit in engine.frozen_units),
                        "replicas": engine.comm.num_replicas})
        engine.close()
    return results


def composed_reference(case: dict[str, Any], first: dict[str, torch.Tensor], data_ranks: int) -> dict[str, Any]:
    """One process from ``first``: AdamW, or torch's Muon on DeepSpeed's matrices and AdamW on
    the rest (Newton-Schulz in fp32, as `test_muon`'s reference), or no optimizer."""
    from contextlib import nullcontext

    from muon_cases import deepspeed_rule, fp32_newton_schulz

    model = _composed_model(case)
    model.load_state_dict(first)
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if case.get("muon"):
        optimizers = [torch.optim.Muon([p for n, p in trained if deepspeed_rule(n, p)], lr=0.02, weight_decay=0.01),
                      torch.optim.AdamW([p for n, p in trained if not deepspeed_rule(n, p)], lr=3e-3,
                                        betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)]
    else:
        optimizers = [torch.optim.AdamW([p for _, p in trained], lr=1e-3, weight_decay=0.0)] if trained else []
    losses = []
    with fp32_newton_schulz() if case.get("muon") else nullcontext():
        for step in batches(15, data_ranks, 3):
            step_losses = []
            for ids in step:
                for micro in range(ACCUM):
                    loss = model(**case_inputs(case, ids[micro]), use_cache=False).loss
                    if optimizers:
                        (loss / (ACCUM * data_ranks)).backward()
                    step_losses.append(loss.item())
            if optimizers:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            losses.append(step_losses)
    return {"losses": losses, "state": model.state_dict()}


@pytest.mark.parametrize("world", sorted(COMPOSED))
def test_sequence_parallelism_composes_with_what_else_the_engine_holds(world: int) -> None:
    """int8 frozen weights, CPU and NVMe offload (parameter shards too), Muon, an engine without
    an optimizer, hybrid sharding: each at k = 2 matches one process within 2e-5, its sequences
    split (the all-to-alls moved bytes) and the feature in force."""
    import tempfile

    from disk import DISK

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        per_rank = run_on_ranks(world, composed, COMPOSED[world], directory, allow_numpy=True, timeout=400)
    for index, case in enumerate(COMPOSED[world]):
        results = [result[index] for result in per_rank]
        expected = composed_reference(case, results[0]["first"], world // case["k"])
        for rank, result in enumerate(results):
            data_rank = rank // case["k"]
            for step, step_losses in enumerate(expected["losses"]):
                mine = step_losses[data_rank * ACCUM : (data_rank + 1) * ACCUM]
                assert result["losses"][step] == pytest.approx(mine, abs=TOL), (case, rank, step)
            for name, value in expected["state"].items():
                diff = (result["state"][name] - value).abs().max().item()
                assert diff <= TOL, f"{case}, rank {rank}: {name} differs by {diff}"
            assert result["all_to_all"] > 0, case
            assert (result["int8_units"] > 0) == bool(case.get("zero", {}).get("zero_quantized_nontrainable_weights"))
            assert bool(result["nvme"]) == ("nvme" in str(case.get("zero"))), (case, result["nvme"])
            assert result["replicas"] == (2 if "shard_group_size" in case.get("zero", {}) else 1)
        if case.get("zero", {}).get("zero_quantized_nontrainable_weights"):  # the base the engine trains on is int8's
            assert not torch.equal(results[0]["first"]["model.embed_tokens.weight"],
                                   sequence_llama().state_dict()["model.embed_tokens.weight"])


def refusals(rank: int, world_size: int) -> dict[str, str]:
    torch.set_num_threads(1)
    found = {}
    base = engine_config(0, micro=1, lr=1e-3)
    for name, model, k in (
        ("heads", sequence_llama(heads=3, kv_heads=1), 2),
        ("world", sequence_llama(), 3),
    ):
        try:
            zero_engine.initialize(model, {**base, "sequence_parallel_size": k})
        except (NotImplementedError, zero_engine.ConfigError) as err:
            found[name] = str(err)
    # a config that asks for windows on a model whose attention calls name none (Llama's): the
    # first split forward raises, on every rank, rather than train full causal attention
    engine = zero_engine.initialize(sequence_llama(sliding_window=8), {**base, "sequence_parallel_size": 2})
    try:
        engine(input_ids=torch.randint(0, 97, (1, 8)), labels=torch.randint(0, 97, (1, 8)))
    except NotImplementedError as err:
        found["window"] = str(err)
    engine.close()
    model = sequence_llama()
    engine = zero_engine.initialize(model, {**base, "sequence_parallel_size": 2})
    found["routed"] = model.config._attn_implementation
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    engine.eval()
    with torch.no_grad():  # evaluation split as training is: the loss whole, the logits the rank's slice
        out = engine(input_ids=ids, labels=prompt_labels(ids))
        found["eval"] = {"tokens": out.logits.shape[1], "loss": out.loss.item(),
                         "logits": engine.sequence_gather(out.logits)}
        found["generated"] = engine.module.generate(ids[:, :4], max_new_tokens=3, do_sample=False)  # whole
    engine.close()
    found["closed"] = model.config._attn_implementation  # close() puts the model's own back
    engine = zero_engine.initialize(sequence_llama(), {**base, "sequence_parallel_size": 2, "sequence_parallel_eval": False})
    engine.eval()
    with torch.no_grad():  # opted out: evaluation sees the whole sequence, on every rank
        found["eval_whole_tokens"] = engine(input_ids=ids).logits.shape[1]
    engine.close()
    return found


def two_rank_checks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The refusals, the activation shares and the resume, in one spawn of 2 ranks."""
    return {"refusals": refusals(rank, world_size), "peaks": activation_peaks(rank, world_size, [1024]),
            "resident": resident_growth(rank, world_size),
            "resumes": resumes(rank, world_size, root), "bf16_loss": bf16_loss(rank, world_size),
            "diverged": one_rank_saves(rank, world_size, root)}


def one_rank_saves(rank: int, world_size: int, root: str) -> str:
    """Rank 0 starts a training forward (which exchanges over the sequence group) while rank 1
    saves a checkpoint: their call rows meet, and both raise at once, long before the timeout."""
    import time

    config = {**engine_config(0, micro=MICRO, lr=1e-3), "sequence_parallel_size": 2, "comm": {"timeout_s": 120}}
    engine = zero_engine.initialize(sequence_llama(), config)
    ids = torch.randint(0, 97, (MICRO, 16))
    start = time.monotonic()
    try:
        if rank == 0:
            engine(input_ids=ids, labels=ids)
        else:
            engine.save_checkpoint(f"{root}/diverged")
    except zero_engine.DivergedRanksError as err:
        return f"{time.monotonic() - start:.1f} s: {err}"
    finally:
        engine.close()
    return "no error"


def _bf16_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 97, (MICRO, 15), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": prompt_labels(ids)}


def bf16_loss(rank: int, world_size: int) -> float:
    """The first micro-batch's loss of a bf16 engine at k = 2 (compute in bf16, fp32 masters)."""
    config = engine_config(3, micro=MICRO, lr=1e-3, dtype="bf16")
    config["sequence_parallel_size"] = 2
    engine = zero_engine.initialize(sequence_llama(), config)
    loss = engine(**_bf16_batch()).loss
    engine.backward(loss)
    engine.step()
    engine.close()
    return loss.item()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("sequence_checkpoints")
    return run_on_ranks(2, two_rank_checks, str(root), allow_numpy=True, timeout=400)


def test_what_sequence_parallelism_cannot_split_is_refused_by_name(two_ranks: list[dict[str, Any]]) -> None:
    for found in (result["refusals"] for result in two_ranks):
        assert "asks for sliding windows (sliding_window = 8), but its attention calls name no" in found["window"]
        assert "has 3 attention heads, which do not split over 2 ranks" in found["heads"]
        assert "sequence_parallel_size = 3 does not divide the world size 2" in found["world"]
        assert found["routed"].startswith("zero_engine_ulysses_sdpa_") and found["closed"] == "sdpa"
        assert found["eval_whole_tokens"] == 9


def test_evaluation_is_split_as_training_is_and_generation_stays_whole(two_ranks: list[dict[str, Any]]) -> None:
    """Issue 82: a sequence that trains split evaluated whole (out of memory at the first
    evaluation at k = 8). A forward without gradients is split by default: its loss is one
    process's on every rank, its logits the rank's slice, gathered whole by
    ``engine.sequence_gather``; ``generate`` runs whole, as one process's."""
    model = sequence_llama().eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=prompt_labels(ids))
        generated = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    for found in (result["refusals"] for result in two_ranks):
        assert found["eval"]["tokens"] == 5  # 9 tokens padded to 10, 5 a rank
        assert found["eval"]["loss"] == pytest.approx(expected.loss.item(), abs=1e-5)
        assert (found["eval"]["logits"] - expected.logits).abs().max().item() <= 1e-5
        assert torch.equal(found["generated"], generated)


def activation_peaks(rank: int, world_size: int, lengths: list[int]) -> dict[tuple[int, int], int]:
    """The most bytes torch allocated at once in a forward and backward (after warm-up steps),
    the same global sequence split over k = 1 and 2 ranks."""
    from zero_engine.testing.process_memory import step_allocations

    torch.set_num_threads(1)
    peaks = {}
    for length in lengths:
        ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(0))
        for k in (1, 2):
            config = engine_config(0, micro=1, lr=1e-3)
            config["sequence_parallel_size"] = k
            engine = zero_engine.initialize(sequence_llama(heads=8, kv_heads=8), config)
            peaks[length, k] = step_allocations(engine, ids)[1]
            engine.close()
    return peaks


def test_each_rank_holds_its_share_of_the_activations(two_ranks: list[dict[str, Any]]) -> None:
    """At a fixed global length, a rank of a 2-rank sequence group allocates at most 1.25/2 of
    what a rank holding the whole sequence does in a step (activations, the attention's
    exchanges and the logits: the model states are allocated before)."""
    for peaks in (result["peaks"] for result in two_ranks):
        assert peaks[1024, 2] <= 1.25 / 2 * peaks[1024, 1], peaks


def resident_growth(rank: int, world_size: int) -> dict[int, int]:
    """How far a training step raises each rank's resident high-water mark, the same 2048-token
    sequence whole (k = 1) and split over 2 ranks; the issue's model (a 4-layer Llama of hidden
    256, vocabulary 2048), stage 0, every large allocation its own mapping."""
    from repo_scripts import load_script
    from zero_engine.testing.process_memory import map_large_allocations, step_resident_growth

    llama = load_script("sequence_memory").llama

    torch.set_num_threads(1)
    map_large_allocations(65536)
    ids = torch.randint(0, 2048, (1, 2048), generator=torch.Generator().manual_seed(0))
    growth = {}
    for k in (1, 2):
        config = {**engine_config(0, micro=1, lr=1e-3), "sequence_parallel_size": k}
        engine = zero_engine.initialize(llama(256, 4, 8, 2048, 2048), config)
        growth[k] = step_resident_growth(engine, ids)
        engine.close()
    return growth


def test_each_rank_holds_its_share_as_the_process_holds_it(two_ranks: list[dict[str, Any]]) -> None:
    """Issue 82: each rank of a 2-rank group raises its resident high-water over a training step
    by at most 1.25/2 of what a rank holding the whole sequence does (measured 0.52; 0.26 at
    k = 4, docs/benchmarks.md), as the process holds it: activations, exchange buffers, masks,
    the loss's inputs and gloo's buffers all counted, whatever the engine believes."""
    for growth in (result["resident"] for result in two_ranks):
        assert growth[2] <= 1.25 / 2 * growth[1], growth
        assert growth[1] > 100e6, growth  # the step is measured: a whole sequence's activations


def resumes(rank: int, world_size: int, root: str) -> dict[str, bool]:
    """Saved at k = 2 (one sequence group), loaded at k = 1 (two data-parallel ranks) and back:
    the same values and optimizer state; the manifest records the layout that wrote it."""
    import json
    from pathlib import Path

    torch.set_num_threads(1)
    ids = torch.randint(0, 97, (MICRO, 16), generator=torch.Generator().manual_seed(rank // 2))
    out = {}
    engines = {}
    for k in (2, 1):
        config = engine_config(3, micro=MICRO, lr=1e-3)
        config["sequence_parallel_size"] = k
        engines[k] = zero_engine.initialize(sequence_llama(), config)
    engine = engines[2]
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(root, tag="k2")
    engines[1].load_checkpoint(root, tag="k2")
    saved, loaded = engine.full_state_dict(), engines[1].full_state_dict()
    out["values"] = all(torch.equal(saved[name], loaded[name]) for name in saved)
    out["step"] = engines[1].global_step == 2
    manifest = json.loads((Path(root) / "k2" / "manifest.json").read_text())
    out["mesh"] = manifest["mesh"] == {"replicate": 1, "shard": 2, "sequence": 2}
    engines[1].backward(engines[1](input_ids=ids, labels=ids).loss)  # trains on at the new shape
    engines[1].step()
    for e in engines.values():
        e.close()
    return out


def test_a_checkpoint_resumes_at_another_sequence_shape(two_ranks: list[dict[str, Any]]) -> None:
    for found in (result["resumes"] for result in two_ranks):
        assert found == {"values": True, "step": True, "mesh": True}


def test_validate_counts_data_parallel_ranks_and_estimate_shards_over_every_rank(capsys) -> None:
    """train_batch_size = micro x accumulation x (world / k), as initialize resolves it; the
    model states are still sharded over every rank, sequence ranks included."""
    from zero_engine import ConfigError, load_config
    from zero_engine.memory import estimate_from_config
    from zero_engine.validation import check_config

    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                          "sequence_parallel_size": 2, "zero_optimization": {"stage": 3},
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert check_config(config, ranks=8).batch.train_batch_size == 2 * 3 * 4
    with pytest.raises(ConfigError, match="sequence_parallel_size = 2 does not divide the world size 3"):
        check_config(config, ranks=3)
    assert estimate_from_config(config, 8_000, 8).optimizer_states == 8_000 * 8 // 8
    from zero_engine.cli import main

    shipped = str(Path(__file__).resolve().parent.parent / "configs" / "zero3_long_sequences.yaml")
    assert main(["validate", shipped]) == 0  # one sequence group by default
    said = capsys.readouterr().err
    assert "x 1 data-parallel rank(s) (4 ranks, sequences split over 4) = 8 samples" in said
    assert "evaluation split too, units recomputed" in said
    assert main(["validate", shipped, "--world-size", "6"]) == 1
    assert "sequence_parallel_size = 4 does not divide the world size 6" in capsys.readouterr().err


def test_estimate_counts_each_ranks_slice_of_the_activations(tmp_path, capsys) -> None:
    import json

    from zero_engine.activations import DecoderShape, activation_bytes
    from zero_engine.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4,
                                "zero_optimization": {"stage": 3}}))
    model = tmp_path / "config.json"
    model.write_text(sequence_llama().config.to_json_string())
    assert main(["estimate", str(path), "--model-config", str(model), "--seq-len", "1001", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "1 x 1001 tokens, 251 of them on each rank (sequence_parallel_size 4)" in out
    kept = activation_bytes(DecoderShape.from_file(model), 1, 251, 4, recompute=False).kept
    assert f"kept for backward {kept / 2**30:8.3f} GiB" in out


def test_a_bf16_loss_is_one_process_s_in_bf16(two_ranks: list[dict[str, Any]]) -> None:
    """The loss in bf16, split over 2 ranks, against the same model cast to bf16 in one process
    (its fp32 loss of bf16 logits: within 1e-3, 4e-6 measured)."""
    expected = sequence_llama().to(torch.bfloat16)(**_bf16_batch()).loss.item()
    for result in two_ranks:
        assert result["bf16_loss"] == pytest.approx(expected, abs=1e-3)  # 4e-6 measured


def test_a_call_on_one_rank_meets_a_split_forward_and_every_rank_raises(two_ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(two_ranks):
        seconds, message = result["diverged"].split(" s: ", 1)
        assert float(seconds) < 30, (rank, result["diverged"])
        assert "training" in message and "save_checkpoint()" in message, (rank, message)


def test_the_exchange_frees_its_buffers_when_it_returns_whoever_still_holds_them() -> None:
    """gloo's work object keeps the tensors of a finished all-to-all until its own thread lets
    go: freed there, they stayed allocated for a while after the exchange (and the profiler,
    which sees the calling thread, counted a peak that changed run to run). The exchange frees
    its send and receive buffers itself once the collective is done."""
    from zero_engine.comm.handles import DONE
    from zero_engine.transforms.ulysses import exchange

    class HoldingGroup:  # one rank of two, whose "collective" keeps its tensors, as gloo's work does
        world_size, rank = 2, 0

        def all_to_all(self, send: torch.Tensor, received: torch.Tensor, kind: Any) -> Any:
            received.copy_(send)
            self.held = (send, received)
            return DONE

    group = HoldingGroup()
    tensor = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).view(2, 4, 6, 3)  # (batch, heads, tokens, dim)
    out = exchange(group, tensor, 1, 2)  # type: ignore[arg-type]
    assert out.shape == (2, 2, 12, 3)  # heads halved, tokens doubled (this rank's copy of both halves)
    assert [t.untyped_storage().nbytes() for t in group.held] == [0, 0]
