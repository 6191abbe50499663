"""Frozen parameters: sharded at stage 3 in frozen units (never reduced, no fp32 copy, released
after their backward by the post-backward signal), replicated with ``frozen_weights:
replicate`` and below stage 3, against one process.

The model mixes what fine-tuning brings: a frozen tower before any trainable parameter (its
output needs no gradient), blocks each holding a frozen base linear beside a trainable
low-rank adapter in one module (one unit module, a trainable and a frozen unit), a frozen
layer called twice in one forward (once under ``no_grad``), and trainable layers after it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_engine
from configs import engine_config
from harness import run_on_ranks

DIM, RANK, DEPTH, MICRO, STEPS, LR = 12, 2, 3, 2, 3, 0.05
TOL = 2e-5


class Adapted(nn.Module):
    """A frozen base linear and a trainable low-rank adapter beside it (LoRA's shape); it returns
    two tensors, both used (a unit module's outputs each get a backward hook: its frozen unit
    must still be held once per call, N25)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.base.requires_grad_(False)
        self.down = nn.Linear(DIM, RANK, bias=False)
        self.up = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.base(x) + self.up(self.down(x))
        return torch.tanh(y), torch.tanh(0.5 * y)


class FrozenMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.tower.requires_grad_(False)
        self.blocks = nn.ModuleList(Adapted() for _ in range(DEPTH))
        self.shared = nn.Linear(DIM, DIM)
        self.shared.requires_grad_(False)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)
        self.probe = None  # called where each block's input gradient is ready (tests of release)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tower(x)
        for block in self.blocks:
            if self.probe is not None and h.requires_grad:
                h.register_hook(lambda grad, probe=self.probe: probe())
            h, bent = block(h)
            h = h + 0.5 * bent
        with torch.no_grad():
            context = self.shared(h)
        h = self.shared(h) + context
        out = self.head(torch.tanh(self.mid(h)))
        return out if y is None else F.mse_loss(out, y)


def make_mix(dtype: torch.dtype = torch.float32) -> FrozenMix:
    torch.manual_seed(0)
    model = FrozenMix()
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(dtype)
    return model


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(MICRO * world, DIM, generator=generator)
    y = torch.randn(MICRO * world, 1, generator=generator)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    return x[rows], y[rows]


def reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_mix()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)  # the engine's default
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, 0, 0, 1) if world == 1 else _global(step, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: value.clone() for name, value in model.state_dict().items()}


def _global(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, 0, rank, world) for rank in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def mix_config(stage: int, **zero: object) -> dict:
    zero.setdefault("stage3_param_persistence_threshold", 0)
    return engine_config(stage, micro=MICRO, lr=LR, **zero)


CASES = {
    "stage0": mix_config(0),
    "stage1": mix_config(1),
    "stage2": mix_config(2, reduce_bucket_size=50),
    "stage3": mix_config(3, stage3_wrap_modules=["Adapted", "Sequential"]),
    "stage3_by_size": mix_config(3, reduce_bucket_size=100),
    "stage3_recompute": mix_config(3, stage3_wrap_modules=["Adapted", "Sequential"], recompute_units=True),
    "stage3_replicate": mix_config(3, stage3_wrap_modules=["Adapted", "Sequential"], frozen_weights="replicate"),
}


def train_cases(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    torch.set_num_threads(1)
    results = {}
    for name in names:
        model = make_mix()
        engine = zero_engine.initialize(model, CASES[name])
        frozen_units = engine.frozen_units
        gathered_at_block_inputs: list[list[str]] = []
        model.probe = lambda: gathered_at_block_inputs.append([u.label for u in frozen_units if u.has_full_storage])
        losses = []
        for step in range(STEPS):
            loss = engine(*batch(step, 0, rank, world))
            engine.backward(loss)
            if step == 0:
                sent = engine.comm_report()
            engine.step()
            losses.append(loss.item())
        results[name] = {
            "losses": losses,
            "state": engine.full_state_dict(),
            "frozen_units": [unit.label for unit in frozen_units],
            "frozen_gathered": gathered_at_block_inputs,
            "comm": sent,
            "memory": engine.memory_report(),
            "sharded_frozen": [p.numel() for p in model.parameters() if not p.requires_grad],
        }
        engine.close()
    return results


def _check_against_reference(results: list[dict], world: int, name: str) -> None:
    ref_losses, ref_state = reference(world)
    initial = make_mix().state_dict()
    for rank_results in results:
        result = rank_results[name]
        window = [sum(r[name]["losses"][step] for r in results) / world for step in range(STEPS)]
        assert window == pytest.approx(ref_losses, abs=TOL), name
        for key, ref in ref_state.items():
            assert (result["state"][key] - ref).abs().max().item() <= TOL, f"{name}: {key}"
        for key in ("tower.0.weight", "blocks.1.base.weight", "shared.weight", "shared.bias"):
            assert torch.equal(result["state"][key], initial[key]), f"{name}: frozen {key} changed"


FAST = ["stage0", "stage2", "stage3", "stage3_recompute", "stage3_replicate"]
SLOW = ["stage1", "stage3_by_size"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_frozen_weights_train_as_one_process(world: int) -> None:
    names = FAST if world == 2 else ["stage3", "stage3_replicate"]
    results = run_on_ranks(world, train_cases, names)
    for name in names:
        _check_against_reference(results, world, name)
    _check_sharding(results, world, names)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_weights_train_as_one_process_more_cases(world: int) -> None:
    results = run_on_ranks(world, train_cases, SLOW + (FAST if world == 3 else []))
    for name in SLOW:
        _check_against_reference(results, world, name)


def _trainable_numel() -> int:
    return sum(p.numel() for p in make_mix().parameters() if p.requires_grad)


def _check_sharding(results: list[dict], world: int, names: list[str]) -> None:
    frozen_numel = sum(p.numel() for p in make_mix().parameters() if not p.requires_grad)
    for name in names:
        result = results[0][name]
        memory = result["memory"]
        comm = result["comm"]
        if name == "stage3":
            # The tower, each block's base and the root's shared layer: frozen units, sharded 1/N,
            # in fp32 (no mixed precision), the parameters empty between uses.
            assert result["frozen_units"] == ["<root> [frozen]", "tower [frozen]"] + [
                f"blocks.{i} [frozen]" for i in range(DEPTH)
            ]
            assert set(result["sharded_frozen"]) == {0}
            assert memory["frozen_parameters"] <= 4 * (frozen_numel // world + 5 * world)
            assert comm["all_gather_frozen"]["received"] > 0
            # Released after each block's backward, not at the backward's end: where the input
            # gradient of block k is ready (blocks 2, then 1: block 0's input needs none), the frozen
            # units of blocks k.. are free again (the block before is gathered, and the one before
            # it prefetched; the root's stays to the end, as its trainable units do).
            seen = result["frozen_gathered"]
            assert len(seen) == 2 * STEPS, seen
            for step in range(STEPS):
                at_block2, at_block1 = seen[2 * step], seen[2 * step + 1]
                assert "blocks.2 [frozen]" not in at_block2 and "blocks.1 [frozen]" in at_block2, seen
                assert not {"blocks.1 [frozen]", "blocks.2 [frozen]"} & set(at_block1), seen
        if name.startswith("stage3"):
            # The reduce-scatter moves trainable elements only: one bucket per unit, never a frozen one.
            trainable = _trainable_numel()
            assert 4 * trainable * (world - 1) // world - 4 * world <= comm["reduce_scatter"]["sent"]
            assert comm["reduce_scatter"]["sent"] <= 4 * (trainable + 8 * world * world) * (world - 1) // world
        if name in ("stage0", "stage2", "stage3_replicate"):
            assert memory["frozen_parameters"] == 4 * frozen_numel  # whole on every rank
            assert comm["all_gather_frozen"]["received"] == 0
            assert result["frozen_units"] == []


# -- engines without an optimizer: a reference model beside a policy -----------------------------


def make_reference_model() -> FrozenMix:
    """Every weight frozen (TRL's reference model), values other than the policy's."""
    torch.manual_seed(1)
    model = FrozenMix()
    model.requires_grad_(False)
    return model


def preference_loss(policy_out: torch.Tensor, reference_out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A DPO-shaped loss: the policy's margin over the frozen reference's."""
    margin = (policy_out - y).pow(2) - (reference_out - y).pow(2)
    return -F.logsigmoid(-margin).mean()


def policy_and_reference(rank: int, world: int, stage: int) -> dict:
    torch.set_num_threads(1)
    config = mix_config(stage, stage3_wrap_modules=["Adapted", "Sequential"])
    policy = zero_engine.initialize(make_mix(), config)
    reference_engine = zero_engine.initialize(make_reference_model(), config)  # the policy's config, as TRL passes it
    reference_engine.eval()
    errors = {}
    for call in ("backward", "step"):
        try:
            reference_engine.backward(torch.ones((), requires_grad=True)) if call == "backward" else reference_engine.step()
        except RuntimeError as error:
            errors[call] = str(error)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 0, rank, world)
        with torch.no_grad():
            reference_out = reference_engine(x)
        loss = preference_loss(policy(x), reference_out, y)
        policy.backward(loss)
        policy.step()
        losses.append(loss.item())
    with torch.no_grad():
        logits = reference_engine(batch(0, 0, 0, 1)[0])
    result = {
        "losses": losses,
        "policy": policy.full_state_dict(),
        "logits": logits,
        "errors": errors,
        "optimizer": reference_engine.optimizer,
        "memory": reference_engine.memory_report(),
        "lr": reference_engine.get_lr(),
    }
    reference_engine.close()
    policy.close()
    return result


def _reference_preference_run(world: int) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    policy, reference_model = make_mix(), make_reference_model()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        x, y = _global(step, world)
        with torch.no_grad():
            reference_out = reference_model(x)
        loss = preference_loss(policy(x), reference_out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        logits = reference_model(batch(0, 0, 0, 1)[0])
    return losses, policy.state_dict(), logits


@pytest.mark.parametrize("stage", [3, pytest.param(0, marks=pytest.mark.slow)])
def test_a_frozen_reference_engine_serves_forwards_beside_a_policy_in_one_process_group(stage: int) -> None:
    world = 3 if stage == 3 else 2
    results = run_on_ranks(world, policy_and_reference, stage)
    ref_losses, ref_policy, ref_logits = _reference_preference_run(world)
    frozen_bytes = 4 * sum(p.numel() for p in make_reference_model().parameters())
    for result in results:
        window = [sum(r["losses"][step] for r in results) / world for step in range(STEPS)]
        assert window == pytest.approx(ref_losses, abs=TOL)
        for key, ref in ref_policy.items():
            assert (result["policy"][key] - ref).abs().max().item() <= TOL, key
        assert (result["logits"] - ref_logits).abs().max().item() <= 1e-6
        # No optimizer, whatever the config's section says; nothing trained, nothing held for it.
        assert result["optimizer"] is None and result["lr"] == []
        memory = result["memory"]
        assert memory["optimizer_states"] == memory["master_parameters"] == memory["gradients"] == 0
        if stage == 3:  # every weight sharded 1/N (the persistence threshold is 0 here)
            assert memory["frozen_parameters"] <= frozen_bytes / world + 4 * 8 * world
        else:
            assert memory["frozen_parameters"] == frozen_bytes
        for call in ("backward", "step"):
            assert "nothing to train" in result["errors"][call] and f"engine.{call}()" in result["errors"][call]


# -- requires_grad changed after initialize --------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 3])
def test_requires_grad_changed_after_initialize_is_named_at_the_next_backward(stage: int) -> None:
    model = make_mix()
    engine = zero_engine.initialize(model, mix_config(stage, stage3_wrap_modules=["Adapted", "Sequential"]))
    engine.backward(engine(*batch(0, 0, 0, 1)))
    engine.step()
    model.blocks[1].down.weight.requires_grad_(False)  # as PEFT's set_adapter would
    model.shared.weight.requires_grad_(True)
    with pytest.raises(RuntimeError) as info:
        engine.backward(engine(*batch(1, 0, 0, 1)))
    message = str(info.value)
    assert "'blocks.1.down.weight' (frozen after initialize)" in message
    assert "'shared.weight' (unfrozen after initialize)" in message and "initialize" in message
    engine.close()


# -- checkpoints: frozen shards written by their owners, resumed at any stage and world size --------


def _perturbed_frozen() -> dict[str, torch.Tensor]:
    """The model's values with every frozen one moved, so a resume that kept the model's own
    frozen values (instead of the checkpoint's) fails."""
    state = make_mix().state_dict()
    frozen = {name for name, param in make_mix().named_parameters() if not param.requires_grad}
    return {name: value + 1.0 if name in frozen else value for name, value in state.items()}


def save_checkpoints(rank: int, world: int, directory: str) -> dict[str, dict]:
    torch.set_num_threads(1)
    saved = {}
    for stage in (3, 0):
        engine = zero_engine.initialize(
            make_mix(), mix_config(stage, stage3_wrap_modules=["Adapted", "Sequential"]), weights=_perturbed_frozen()
        )
        engine.backward(engine(*batch(0, 0, rank, world)))
        engine.step()
        engine.save_checkpoint(f"{directory}/stage{stage}", tag="t")
        engine.save_checkpoint(f"{directory}/stage{stage}_trainable", tag="t", exclude_frozen_parameters=True)
        saved[f"stage{stage}"] = engine.full_state_dict()
        engine.close()
    return saved


def resume(rank: int, world: int, directory: str, stage: int, source: str, frozen_weights: str) -> dict:
    torch.set_num_threads(1)
    config = mix_config(stage, stage3_wrap_modules=["Adapted", "Sequential"], frozen_weights=frozen_weights)
    engine = zero_engine.initialize(make_mix(), config)
    engine.load_checkpoint(f"{directory}/{source}", tag="t")
    state = engine.full_state_dict()
    engine.close()
    engine = zero_engine.initialize(make_mix(), config)  # the base as built: unperturbed
    engine.load_checkpoint(f"{directory}/{source}_trainable", tag="t")
    trainable_only = engine.full_state_dict()
    engine.close()
    return {"state": state, "trainable_only": trainable_only}


def test_checkpoints_hold_frozen_shards_and_resume_at_any_stage_and_world_size(tmp_path) -> None:
    saved = run_on_ranks(2, save_checkpoints, str(tmp_path))[0]
    initial = make_mix().state_dict()
    frozen = {name for name, param in make_mix().named_parameters() if not param.requires_grad}
    # Each rank wrote its own frozen shard: both rank files hold pieces of a frozen weight.
    from zero_engine.state.storage import rank_file, read_file
    pieces = [read_file(tmp_path / "stage3" / "t" / rank_file(rank))["pieces"] for rank in (0, 1)]
    assert all(any(piece["name"] == "blocks.0.base.weight" for piece in rank_pieces) for rank_pieces in pieces)
    trainable_pieces = read_file(tmp_path / "stage3_trainable" / "t" / rank_file(0))["pieces"]
    assert not {piece["name"] for piece in trainable_pieces} & frozen
    for world, stage, source, frozen_weights in ((3, 3, "stage0", "shard"), (1, 0, "stage3", "replicate")):
        results = run_on_ranks(world, resume, str(tmp_path), stage, source, frozen_weights)
        for result in results:
            for name, value in saved[source].items():
                assert torch.equal(result["state"][name], value), (world, stage, source, name)
                # Without the frozen weights saved, the model as built gives them.
                expected = initial[name] if name in frozen else value
                assert torch.equal(result["trainable_only"][name], expected), (world, stage, source, name)


def test_exports_write_a_bf16_base_as_bf16_at_every_stage_and_from_a_checkpoint(tmp_path) -> None:
    """save_pretrained writes trainable weights as their fp32 masters and frozen ones as stored:
    the same file at stages 0 and 3, and the CLI's export of a stage 3 checkpoint agrees."""
    from safetensors.torch import load_file

    from zero_engine.state.export import export_checkpoint

    written = {}
    for stage in (0, 3):
        engine = zero_engine.initialize(
            make_mix(torch.bfloat16), {**mix_config(stage, stage3_wrap_modules=["Adapted", "Sequential"]),
                                       "bf16": {"enabled": True}},
        )
        engine.backward(engine(*batch(0, 0, 0, 1)))
        engine.step()
        engine.save_pretrained(tmp_path / f"stage{stage}")
        written[stage] = load_file(str(tmp_path / f"stage{stage}" / "model.safetensors"))
        if stage == 3:
            engine.save_checkpoint(tmp_path / "checkpoint", tag="t")
        engine.close()
    export_checkpoint(tmp_path / "checkpoint", tmp_path / "from_checkpoint", tag="t")
    written["checkpoint"] = load_file(str(tmp_path / "from_checkpoint" / "model.safetensors"))
    frozen = {name for name, param in make_mix().named_parameters() if not param.requires_grad}
    for source, state in written.items():
        assert {name for name, value in state.items() if value.dtype == torch.bfloat16} == frozen, source
        for name, value in state.items():
            assert torch.equal(value, written[0][name]), (source, name)
