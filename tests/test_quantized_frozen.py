"""int8 frozen weights at stage 3 (``zero_quantized_nontrainable_weights``).

On a model of odd-sized frozen linears beside a trainable one, 2 and 3 ranks (shards that cut
blocks, a block spanning two weights): every decoded element is within half a scale step of the
exact value, the scale being that of its block in its rank's shard; every rank computes with the
same values, its own shard decoded too; vectors (biases) and trainable weights stay exact; what a
rank keeps is the encoded shard; training equals torch in one process on the decoded base (so
nothing trainable is quantized, in storage or in transit); no frozen weight is encoded again
after ``initialize``; exports hold the decoded values and a checkpoint reloads them bit for bit;
a write by ``gathered(modifier_rank=0)`` is encoded alike on every rank; a model built on the
meta device encodes the values loaded by ``weights=``; a pattern of
``zero_quantized_nontrainable_exact`` that names nothing is refused on every rank. With
``offload_param`` (3 ranks) and under hybrid sharding (4 ranks, groups of 2) too; a load of
exact values reads back encoded before any forward, and a checkpoint restores a replicated unit
into a model built with another base.

On a pretrained (briefly, here) Hugging Face Llama with PEFT's LoRA, bf16 base, 2 ranks: the
frozen bytes a rank holds and the bytes its gathers move are at most 0.51x the exact bf16
base's, the adapters train to a held-out loss within 1% of the exact base's, and a reference
engine's logits stay within a stated bound of the exact model's.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import tiny
import zero_engine
from configs import engine_config
from harness import recorded_collectives, run_on_ranks
from zero_engine.quantize import BLOCK, BlockQuantizer
from zero_engine.testing.process_memory import live_tensor_bytes

IN, MID, OUT, BATCH, STEPS, LR = 61, 37, 135, 4, 3, 1e-2
TOL = 2e-5


class FrozenPair(nn.Module):
    """Two frozen linears (2257 and 4995 weights: one frozen int8 unit of 7252 elements, whose
    shards cut blocks at 2 and 3 ranks) around a trainable one; rows of very different
    magnitudes, so blocks get different scales. A frozen vector of two blocks' length (a norm's
    gains) is sharded beside them and stays exact."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, MID)
        self.adapt = nn.Linear(IN, MID)
        self.b = nn.Linear(MID, OUT)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 2 * BLOCK), requires_grad=False)
        with torch.no_grad():
            self.a.weight.mul_(torch.logspace(-2, 1, MID)[:, None])
            self.b.weight.mul_(torch.logspace(1, -3, OUT)[:, None])
        self.a.requires_grad_(False)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.tanh(self.a(x) + self.adapt(x))) * self.gain[:OUT]).pow(2).mean()


def pair_model() -> FrozenPair:
    torch.manual_seed(0)
    return FrozenPair()


def perturbed_pair_model() -> FrozenPair:
    """Another base: what a checkpoint restores must not be what the model was built with."""
    model = pair_model()
    with torch.no_grad():
        model.a.weight.mul_(1.5)
        model.b.weight.add_(0.25)
    return model


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randn(BATCH * world, IN, generator=torch.Generator().manual_seed(step))
    return rows[rank * BATCH : (rank + 1) * BATCH]


def pair_config(**zero) -> dict:
    zero = {key: value for key, value in zero.items() if value is not None}
    return engine_config(
        3, micro=BATCH, lr=LR, stage3_param_persistence_threshold=200, zero_quantized_nontrainable_weights=True, **zero
    )


def gathered_values(engine) -> dict[str, torch.Tensor]:
    with engine.gathered():
        return {name: param.detach().clone() for name, param in engine.module.named_parameters()}


class EncodeCounter:
    """Counts the block encoder's calls while installed (every encode goes through encode_rows)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = BlockQuantizer.encode_rows

    def __enter__(self) -> EncodeCounter:
        def counted(quantizer, *args, **kwargs):
            self.calls += 1
            return self._original(quantizer, *args, **kwargs)

        BlockQuantizer.encode_rows = counted
        return self

    def __exit__(self, *exc) -> None:
        BlockQuantizer.encode_rows = self._original


def run_pair(rank: int, world: int, folder: str, extra: dict) -> dict:
    torch.set_num_threads(1)
    original = dict(pair_model().named_parameters())
    engine = zero_engine.initialize(pair_model(), pair_config(**extra))
    # a.weight and b.weight in int8, the gain exact beside them (the biases stay whole: under the persistence
    # threshold); replicated, the gain is whole as every exact frozen parameter
    exact_units = [] if extra.get("frozen_weights") == "replicate" else [["gain"]]
    assert [unit.names for unit in engine.frozen_units if not unit.quantized] == exact_units
    (unit,) = [unit for unit in engine.frozen_units if unit.quantized]
    kept = unit.param_shard
    decoded = gathered_values(engine)
    with EncodeCounter() as encodes:
        losses = []
        for step in range(STEPS):
            loss = engine(batch(step, rank, world))
            engine.backward(loss)
            frozen_received = engine.comm_report().get("all_gather_frozen", {}).get("received", 0)
            engine.step()
            losses.append(loss.item())
        after = gathered_values(engine)
    exported = engine.full_state_dict()
    streamed = dict(engine.named_full_parameters())
    engine.save_checkpoint(folder, tag="t")
    reloaded = zero_engine.initialize(perturbed_pair_model(), pair_config(**extra))  # a unit left out comes back wrong
    reloaded.load_checkpoint(folder, tag="t")
    after_load = gathered_values(reloaded)
    # A write by rank 0 inside gathered() (the others write garbage) is encoded into every shard.
    with reloaded.gathered([reloaded.module.a.weight], modifier_rank=0):
        written = reloaded.module.a.weight.detach() * 0.5
        reloaded.module.a.weight.data.copy_(written if rank == 0 else torch.full_like(written, 7.0))
    after_write = gathered_values(reloaded)["a.weight"]
    # Built on the meta device and loaded from weights=: the loaded values are what is encoded.
    with torch.device("meta"):
        meta_model = FrozenPair()
    meta_engine = zero_engine.initialize(meta_model, pair_config(**extra), weights=pair_model().state_dict())
    read_before_a_forward = meta_engine.full_state_dict()  # the exact values loaded, read back as encoded (D13)
    from_meta = gathered_values(meta_engine)
    try:
        zero_engine.initialize(pair_model(), pair_config(zero_quantized_nontrainable_exact=["a.weight", "*head*"]))
        refused = None
    except zero_engine.ConfigError as error:
        refused = str(error)
    return {
        "original": {name: param.detach() for name, param in original.items()},
        "names": unit.names, "numels": list(unit.layout.param_numels), "shard_numel": unit.layout.shard_numel,
        "kept": (kept.dtype, kept.numel(), kept.untyped_storage().nbytes()),
        "decoded": decoded, "after": after, "after_load": after_load, "losses": losses,
        "encodes": encodes.calls, "refused": refused, "frozen_received": frozen_received,
        "exported": exported, "streamed": streamed,
        "written": written if rank == 0 else None, "after_write": after_write, "from_meta": from_meta,
        "read_before_a_forward": read_before_a_forward,
    }


def one_process_on_decoded(decoded: dict[str, torch.Tensor], world: int) -> tuple[list[float], dict]:
    """Torch alone, AdamW over the trainable parameters, the base set to the decoded values."""
    model = pair_model()
    model.load_state_dict(decoded)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)  # the engine's default
    losses = []
    for step in range(STEPS):
        rows = torch.cat([batch(step, rank, world) for rank in range(world)])
        loss = model(rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach() for name, param in model.named_parameters()}


PAIR_CASES = {  # world size, more zero_optimization keys
    "2 ranks": (2, {}),
    "2 ranks, replicate": (2, {"frozen_weights": "replicate"}),
    "3 ranks, offload_param": (3, {"offload_param": {"device": "cpu"}}),
    "4 ranks, hybrid (groups of 2)": (4, {"shard_group_size": 2}),
}


@pytest.mark.parametrize(  # hybrid too: a shard's place is its shard rank's (N04); plain 2 ranks in the slow run
    "case", [pytest.param(name, marks=pytest.mark.slow) if name == "2 ranks" else name for name in PAIR_CASES]
)
def test_int8_frozen_weights_round_trip_per_block_and_train_as_torch_on_the_decoded_base(case: str, tmp_path) -> None:
    world, extra = PAIR_CASES[case]
    results = run_on_ranks(world, run_pair, str(tmp_path), extra)
    shards = 1 if "frozen_weights" in extra else extra.get("shard_group_size", world)  # ranks a unit is sharded over
    first = results[0]
    names, numels, shard_numel = first["names"], first["numels"], first["shard_numel"]
    assert names == ["a.weight", "b.weight"]
    flat_original = torch.cat([first["original"][name].reshape(-1) for name in names])
    flat_decoded = torch.cat([first["decoded"][name].reshape(-1) for name in names])
    padded = torch.zeros(shard_numel * shards)
    padded[: flat_original.numel()] = flat_original
    error = torch.zeros_like(padded)
    error[: flat_original.numel()] = (flat_decoded - flat_original).abs()
    # Blocks start at each rank's shard: the bound is half the scale of the element's own block.
    for rank in range(shards):
        shard = padded[rank * shard_numel : (rank + 1) * shard_numel]
        shard_error = error[rank * shard_numel : (rank + 1) * shard_numel]
        for start in range(0, shard_numel, BLOCK):
            scale = shard[start : start + BLOCK].abs().max() / 127
            worst = shard_error[start : start + BLOCK].max()
            assert worst <= scale / 2 * (1 + 1e-5), f"rank {rank}'s block at {start}: error {worst} > half of {scale}"
    assert error.max() > 0, "the frozen weights were not quantized"
    assert shard_numel % BLOCK and numels == [MID * IN, OUT * MID]
    # What each rank keeps: its shard encoded (the whole, replicated), a quarter of its fp32
    # bytes and the scales; gathered in int8, or never (replicated).
    gain_shard = -(-2 * BLOCK // shards) * 4  # the exact gain's unit, sharded beside (fp32)
    for result in results:  # the root's units: gathered once a step, kept from forward into backward
        assert result["frozen_received"] == (BlockQuantizer(8).encoded_bytes(shard_numel) + gain_shard) * (shards - 1)
        assert result["kept"] == (torch.uint8, BlockQuantizer(8).encoded_bytes(shard_numel),
                                  BlockQuantizer(8).encoded_bytes(shard_numel))
    for rank, result in enumerate(results):
        for name, value in result["decoded"].items():
            assert torch.equal(value, first["decoded"][name]), f"rank {rank} decodes {name} otherwise"
            if name not in names:  # biases and the trainable linear: exact
                assert torch.equal(value, first["original"][name]), f"{name} is not exact"
        assert result["encodes"] == 0, f"rank {rank} encoded {result['encodes']} times while training"
        for name in names:  # the frozen values never move, and a checkpoint brings back the same
            assert torch.equal(result["after"][name], first["decoded"][name]), name
        for name, value in result["after_load"].items():
            assert torch.equal(value, first["after"][name]), f"rank {rank}: {name} after loading the checkpoint"
        refusal = "zero_optimization.zero_quantized_nontrainable_exact[1] = '*head*' matches no frozen"
        assert refusal in result["refused"]
        for name, value in result["after"].items():  # exports hold the decoded values
            assert torch.equal(result["exported"][name], value) and torch.equal(result["streamed"][name], value), name
        assert torch.equal(result["after_write"], first["after_write"]), f"rank {rank} after the write"
        for name in names:
            assert torch.equal(result["from_meta"][name], first["decoded"][name]), f"rank {rank}: {name} from meta"
            assert torch.equal(result["read_before_a_forward"][name], first["decoded"][name]), f"rank {rank}: {name}"
    written = first["written"]  # a block a.weight shares with b.weight takes b's scale: the unit's largest bounds
    largest = max(written.abs().max(), first["after"]["b.weight"].abs().max())
    assert 0 < (first["after_write"] - written).abs().max() <= largest / 254 * (1 + 1e-5)  # halves of odd steps: ties
    losses, trained = one_process_on_decoded(first["decoded"], world)
    mean_losses = [sum(values) / world for values in zip(*(result["losses"] for result in results))]
    assert all(math.isclose(a, b, rel_tol=0, abs_tol=TOL) for a, b in zip(mean_losses, losses)), (mean_losses, losses)
    for rank, result in enumerate(results):
        for name in ("adapt.weight", "adapt.bias"):
            assert torch.allclose(result["after"][name], trained[name], rtol=0, atol=TOL), name


# -- a pretrained Llama under PEFT's LoRA, bf16 base ----------------------------------------------

VOCAB, SEQ, SUCCESSORS, PRETRAIN_STEPS, TUNE_STEPS, MICRO = 128, 32, 4, 150, 8, 4
# Matrices of at least 1000 elements are sharded (every base weight); the adapters (256 elements
# each) and the norms stay whole, so every gather of a step is a frozen weight's.
PERSIST = 1000


def successors() -> torch.Tensor:
    """A Markov chain over the vocabulary: each token is followed by one of 4 others (the best
    loss is ln 4 = 1.39; an untrained model's is ln 128 = 4.85)."""
    generator = torch.Generator().manual_seed(0)
    return torch.stack([torch.randperm(VOCAB, generator=generator)[:SUCCESSORS] for _ in range(VOCAB)])


def chain_tokens(rows: int, seed: int) -> torch.Tensor:
    table, generator = successors(), torch.Generator().manual_seed(seed)
    ids = torch.empty(rows, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=generator)
    for t in range(1, SEQ):
        ids[:, t] = table[ids[:, t - 1], torch.randint(0, SUCCESSORS, (rows,), generator=generator)]
    return ids


def llama(state: dict | None = None):
    model = tiny.llama(vocab=VOCAB, hidden=64, ffn=128, positions=SEQ)
    if state is not None:
        model.load_state_dict(state)
    return model


def pretrained_base() -> dict[str, torch.Tensor]:
    """The base's weights after a short pretraining on the chain (fp32, one process), in bf16."""
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(PRETRAIN_STEPS):
        ids = chain_tokens(16, 1000 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.to(torch.bfloat16) for name, value in model.state_dict().items()}


def lora(state: dict):
    return tiny.with_lora(llama(state).to(torch.bfloat16), random_init=False)


def llama_config(quantized: bool) -> dict:
    return engine_config(
        3, micro=MICRO, lr=5e-3, dtype="bf16", stage3_param_persistence_threshold=PERSIST,
        zero_quantized_nontrainable_weights=quantized,
    )


def gathered_bytes(calls: list) -> int:
    """Bytes of the all-gathers recorded (gloo runs each as one broadcast per shard)."""
    return sum(
        nbytes for method, function, _, nbytes in calls
        if method == "all_gather" or (method, function) == ("_shard_by_shard", "broadcast")
    )


def settled_live_tensor_bytes() -> int:
    """The lesser of two readings a moment apart: a tensor alive for an instant elsewhere (once,
    8 KiB more in one reading of ~90 KiB, failing a bound here) is not what the engine holds."""
    first = live_tensor_bytes()
    time.sleep(0.05)
    return min(first, live_tensor_bytes())


def run_llama(rank: int, world: int, state: dict) -> dict:
    torch.set_num_threads(1)
    held_out = chain_tokens(8, 7)
    results: dict = {}
    with torch.no_grad():
        results["exact_logits"] = llama(state).to(torch.bfloat16)(input_ids=held_out).logits.float()
    for quantized in (False, True):
        found: dict = {}
        # A reference engine (every weight frozen): its growth is the frozen weights it keeps.
        before = live_tensor_bytes()
        reference = zero_engine.initialize(
            llama(state).to(torch.bfloat16).requires_grad_(False), llama_config(quantized)
        )
        found["reference_growth"] = settled_live_tensor_bytes() - before
        with torch.no_grad():
            found["logits"] = reference(input_ids=held_out).logits.float()
        reference.close()
        del reference
        before = live_tensor_bytes()
        engine = zero_engine.initialize(lora(state), llama_config(quantized))
        found["lora_growth"] = settled_live_tensor_bytes() - before
        found["report"] = engine.memory_report()["frozen_parameters"]
        losses = []
        for step in range(TUNE_STEPS):
            ids = chain_tokens(MICRO * world, step)[rank * MICRO : (rank + 1) * MICRO]
            calls: list = []
            with recorded_collectives(calls):  # the step's gathers of frozen weights: forward and backward
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            engine.step()  # (then gathers the adapters' updated values, the same in both runs)
            losses.append(loss.item())
            found.setdefault("step_gather_bytes", gathered_bytes(calls))
        engine.eval()
        with torch.no_grad():
            found["held_out"] = engine(input_ids=held_out, labels=held_out).loss.item()
        found["losses"] = losses
        engine.close()
        del engine
        results[quantized] = found
    return results


def test_lora_on_an_int8_bf16_base_halves_what_frozen_weights_hold_and_move_and_trains_as_the_exact_base() -> None:
    pytest.importorskip("peft", reason="the [test] extra installs peft")
    results = run_on_ranks(2, run_llama, pretrained_base(), allow_numpy=True)
    for rank, result in enumerate(results):
        exact, int8 = result[False], result[True]
        where = f"rank {rank}"
        # Frozen weights held, as the process holds them: a reference engine's growth is its frozen
        # weights; the LoRA engines differ from each other by their frozen weights alone.
        assert int8["reference_growth"] <= 0.51 * exact["reference_growth"], where
        held = exact["reference_growth"] - (exact["lora_growth"] - int8["lora_growth"])
        assert held <= 0.51 * exact["reference_growth"], (where, held, exact["reference_growth"])
        assert int8["report"] <= 0.51 * exact["report"], where  # the engine's figure agrees
        assert 0 < int8["step_gather_bytes"] <= 0.51 * exact["step_gather_bytes"], where
        # The adapters train as on the exact base (a base that learnt the chain: a loss far below
        # an untrained model's ln 128 = 4.85, so a damaged base would show).
        assert exact["held_out"] < 2.0, where
        assert abs(int8["held_out"] - exact["held_out"]) <= 0.01 * exact["held_out"], where
        # A reference engine's logits: the exact one's equal the model's; int8 within a tenth of
        # their spread (measured: 0.089 against a standard deviation of 1.94, 4.6%).
        spread = result["exact_logits"].std()
        assert torch.equal(exact["logits"], result["exact_logits"]), where
        assert (int8["logits"] - result["exact_logits"]).abs().max() <= 0.1 * spread, where


def test_estimate_counts_int8_frozen_weights_at_stage3_and_initialize_names_the_stages_without_them() -> None:
    from zero_engine.config import no_effect_settings
    from zero_engine.memory import estimate_from_config

    def config(stage: int, frozen_weights: str = "shard", quantized: bool = True):
        return zero_engine.load_config({
            "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": stage, "frozen_weights": frozen_weights, "zero_quantized_nontrainable_weights": quantized,
            },
        })

    def frozen(c) -> int:
        return estimate_from_config(c, 10**6, 4, frozen_params=7 * 10**9).frozen_parameters

    assert frozen(config(3)) == int(7 * 10**9 * (1 + 4 / BLOCK)) // 4  # a byte and its share of a block's scale
    assert frozen(config(3, quantized=False)) == 7 * 10**9 * 2 // 4
    assert frozen(config(3, "replicate")) == int(7 * 10**9 * (1 + 4 / BLOCK))  # whole, in int8
    assert frozen(config(3, "replicate", False)) == frozen(config(2)) == 7 * 10**9 * 2
    said = [message for c in (config(2), config(3, "replicate"), config(3)) for message in no_effect_settings(c)]
    assert [m.split(":")[0] for m in said if "nontrainable" in m] == [
        "zero_optimization.zero_quantized_nontrainable_weights = True has no effect at stage 2",
    ]
