"""The engine in one process (world size 1, no torch.distributed): surface and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_engine
from models import decay_groups, make_model, micro_batch

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def _with(**sections) -> dict:
    return {**BASE, **sections}


def test_runs_without_a_process_group() -> None:
    assert not torch.distributed.is_initialized()
    model = make_model()
    engine = zero_engine.initialize(model, _with(gradient_accumulation_steps=2, zero_optimization={"stage": 1}))
    assert engine.module is model and engine.comm.world_size == 1
    boundaries, norms = [], []
    for micro in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*micro_batch(0, micro % 2, 0, 1, 2, 2)))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    assert boundaries == [False, True] * 3
    assert engine.global_step == 3
    assert engine.get_lr() == [0.01]
    reference = make_model()  # the first window's gradient, in one process without the engine
    for micro in range(2):
        (reference(*micro_batch(0, micro, 0, 1, 2, 2)) / 2).backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert norms[:2] == [None, pytest.approx(expected, rel=1e-6)]
    assert engine.eval() is engine and not model.training
    assert engine.train() is engine and model.training
    assert not torch.distributed.is_initialized()


def test_backward_divides_by_accumulation_steps() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, _with(gradient_accumulation_steps=4))
    batch = micro_batch(0, 0, 0, 1, 2, 1)
    engine.backward(engine(*batch))
    reference = make_model()
    reference(*batch).backward()
    torch.testing.assert_close(model.fc1.weight.grad, reference.fc1.weight.grad / 4)


def test_full_state_dict_has_every_key_on_cpu_fp32() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, _with(zero_optimization={"stage": 1}))
    state = engine.full_state_dict()
    assert state.keys() == model.state_dict().keys()
    assert "head.weight" in state and "embed.weight" in state
    assert all(t.device.type == "cpu" for t in state.values())
    state["fc1.weight"].add_(1.0)
    assert not torch.equal(state["fc1.weight"], model.fc1.weight), "full_state_dict must return copies"


@pytest.mark.parametrize(
    "sections, fragment",
    [
        ({"optimizer": {"type": "Adafactor", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 1}},
         "Adafactor is neither elementwise nor a whole-matrix optimizer"),
        ({"optimizer": {"type": "LBFGS", "params": {"lr": 0.01}}}, "LBFGS needs a closure"),
    ],
)
def test_unbuilt_features_are_refused_at_initialize(sections: dict, fragment: str) -> None:
    with pytest.raises(NotImplementedError) as info:
        zero_engine.initialize(make_model(), _with(**sections))
    assert fragment in str(info.value)


def test_off_switches_are_accepted() -> None:
    """Settings that mean "off" build nothing: no loss scaling, no clipping (0 does not clip to
    norm 0), no offload. A step is then plain AdamW's (DeepSpeed's: no weight decay unless given)."""
    config = _with(gradient_clipping=0, fp16={"enabled": False}, zero_optimization={"offload_optimizer": {"device": "none"}})
    model, reference = make_model(), make_model()
    engine = zero_engine.initialize(model, config)
    assert engine.loss_scaler is None and engine.loss_scale == 1.0
    tokens, targets = micro_batch(0, 0, 0, 1, 2, 1)
    engine.backward(engine(tokens, targets))
    engine.step()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
    reference(tokens, targets).backward()
    optimizer.step()
    state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(state["fc1.weight"], make_model().state_dict()["fc1.weight"]), "the step changed nothing"


def test_non_elementwise_optimizer_runs_at_stage_0() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, _with(optimizer={"type": "Adafactor", "params": {"lr": 0.01}}))
    before = model.fc1.weight.detach().clone()
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 2, 1)))
    engine.step()
    assert not torch.equal(before, model.fc1.weight)


def test_bad_param_groups_name_the_problem() -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: a tensor of shape \(3,\) is not a parameter"):
        zero_engine.initialize(model, BASE, param_groups=[{"params": [nn.Parameter(torch.zeros(3))]}])
    with pytest.raises(ValueError, match=r"param_groups\[1\]: parameter 'fc1.weight' is already in param_groups\[0\]"):
        zero_engine.initialize(model, BASE, param_groups=[{"params": [model.fc1.weight]}, {"params": [model.fc1.weight]}])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decy'\]: AdamW has no option"):
        zero_engine.initialize(model, BASE, param_groups=[{"params": list(model.parameters()), "weight_decy": 0.1}])


def test_batch_arithmetic_is_checked_at_initialize() -> None:
    with pytest.raises(zero_engine.ConfigError, match="train_batch_size = 10 but"):
        zero_engine.initialize(make_model(), {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                                              "gradient_accumulation_steps": 1})


def test_low_precision_parameters_are_refused_with_their_name() -> None:
    model = make_model().to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="parameter 'unused' is torch.bfloat16"):
        zero_engine.initialize(model, BASE)


def test_per_group_options_are_kept() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, _with(zero_optimization={"stage": 1}), param_groups=decay_groups(model))
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.01, 0.01]


def test_user_zero_grad_does_not_break_the_flat_gradients() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, BASE)
    model.zero_grad(set_to_none=True)
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 2, 1)))
    reference = make_model()
    reference(*micro_batch(0, 0, 0, 1, 2, 1)).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    in_units = {name: unit.grad_view(index) for unit in engine.units for index, name in enumerate(unit.names)}
    assert in_units.keys() >= expected.keys()
    for name, grad in expected.items():  # the flat buffers hold the gradients, not stray tensors
        torch.testing.assert_close(in_units[name].view(grad.shape), grad, msg=name)


STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_wrap_modules": ["Linear"]}


def test_stage3_wrap_class_missing_from_the_model_is_named_at_initialize() -> None:
    with pytest.raises(ValueError) as info:
        zero_engine.initialize(make_model(), _with(zero_optimization={**STAGE3, "stage3_wrap_modules": ["Block"]}))
    message = str(info.value)
    assert "stage3_wrap_modules" in message and "'Block'" in message and "'Linear'" in message


def test_stage3_sets_no_attributes_on_parameters_and_empties_them_between_uses() -> None:
    model = make_model()
    engine = zero_engine.initialize(model, _with(zero_optimization=STAGE3))
    assert all(vars(param) == {} for param in model.parameters()), "the engine set attributes on a Parameter"
    assert model.fc1.weight.shape == (0,) and model.frozen.weight.shape == (0,)  # frozen: sharded too
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 2, 1)))
    engine.step()
    assert model.fc1.weight.shape == (0,), "a unit stayed gathered after the step"
    assert model.frozen.weight.shape == (0,), "a frozen unit stayed gathered after the backward"
    assert engine.full_state_dict()["fc1.weight"].shape == (11, 7)
    engine.close()
    assert not model._forward_hooks and not model.fc1._forward_pre_hooks, "close() left module hooks"


def test_stage3_memory_is_the_formula_at_world_size_one() -> None:
    model = make_model()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    engine = zero_engine.initialize(model, _with(zero_optimization=STAGE3))
    # Gradients exist from the backward to the step, as with FSDP2's zero_grad(set_to_none=True).
    report = engine.memory_report()
    assert report["frozen_parameters"] == frozen  # one rank: its shard is the whole of it
    assert report["parameters"] - frozen == 4 * psi and report["gradients"] == 0
    engine.backward(engine(*micro_batch(0, 0, 0, 1, 2, 1)))
    assert engine.memory_report()["gradients"] == 4 * psi
    engine.step()
    assert engine.memory_report()["gradients"] == 0
