"""The shape of RL and preference fine-tuning on sharded models: a policy engine (a PEFT LoRA
Llama, stage 3) beside a reference engine (a frozen copy of the base, stage 3, no optimizer) in
one process group, trained with the DPO loss for 10 steps on 2 ranks, equals one process; the
same with the reference as the policy with its adapters disabled (PEFT's ``disable_adapter()``,
what TRL does when no reference model is given)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from tiny import llama, with_lora

pytest.importorskip("peft", reason="the [test] extra installs peft")

VOCAB, SEQ, STEPS, LR, BETA = 64, 8, 10, 5e-3, 0.1
TOL = 2e-5


def base_llama():
    return llama(vocab=VOCAB, positions=SEQ)


def policy_and_reference():

    base = base_llama()
    reference = copy.deepcopy(base).requires_grad_(False).eval()
    return with_lora(base), reference


def pair(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s preference pair of this step: a chosen and a rejected sequence."""
    rows = torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(step))
    return rows[2 * rank : 2 * rank + 2]


def sequence_logps(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """Pairs are (chosen, rejected) rows, one after the other."""
    margin = (policy_logps[0::2] - reference_logps[0::2]) - (policy_logps[1::2] - reference_logps[1::2])
    return -F.logsigmoid(BETA * margin).mean()


def reference_logps(reference, policy, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if reference is not None:
            return sequence_logps(reference, ids)
        with policy.disable_adapter():
            return sequence_logps(policy, ids)


def run_dpo(rank: int, world: int, separate_reference: bool) -> list[float]:
    torch.set_num_threads(1)
    policy, reference = policy_and_reference()
    config = engine_config(3, micro=1, lr=LR, stage3_param_persistence_threshold=0)
    engine = zero_engine.initialize(policy, config)
    reference_engine = zero_engine.initialize(reference, config) if separate_reference else None
    if reference_engine is not None:
        assert reference_engine.optimizer is None and reference_engine.frozen_units  # sharded, nothing to train
    losses = []
    for step in range(STEPS):
        ids = pair(step, rank, world)
        ref = reference_logps(reference_engine.module if reference_engine else None, engine.module, ids)
        loss = dpo_loss(sequence_logps(engine.module, ids), ref)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def one_process(world: int, separate_reference: bool) -> list[float]:
    policy, reference = policy_and_reference()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = torch.cat([pair(step, rank, world) for rank in range(world)])
        ref = reference_logps(reference if separate_reference else None, policy, ids)
        loss = dpo_loss(sequence_logps(policy, ids), ref)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_both(rank: int, world: int) -> dict[bool, list[float]]:
    return {separate: run_dpo(rank, world, separate) for separate in (True, False)}


def test_dpo_policy_and_reference_at_stage3() -> None:
    world = 2
    results = run_on_ranks(world, run_both, allow_numpy=True)  # one spawn: importing transformers costs seconds
    for separate_reference in (True, False):
        mean = [sum(result[separate_reference][step] for result in results) / world for step in range(STEPS)]
        expected = one_process(world, separate_reference)
        assert mean == pytest.approx(expected, abs=TOL), separate_reference
        assert expected[-1] < expected[0]  # the policy learned its preferences
