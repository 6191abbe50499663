"""Expert parallelism (``expert_parallel_size``): Hugging Face MoE models (Qwen3-MoE, Mixtral,
fused experts) train as one process trains them on the same global batches, at every stage,
with each rank holding only its own experts, and bad input refused on every rank."""

from __future__ import annotations

import pytest
import torch

from harness import run_on_ranks
from tiny import moe

STEPS, SEQ, VOCAB, LR = 10, 5, 64, 1e-2
TOL = 2e-5


def _batches(world: int, micro: int, accum: int, seed: int = 0) -> torch.Tensor:
    """``[step, micro-step, rank, micro-batch, seq]`` token ids: the global batches."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (STEPS, accum, world, micro, SEQ), generator=generator)


def _config(case: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": case["micro"], "gradient_accumulation_steps": case["accum"],
        "gradient_clipping": case["clip"], "expert_parallel_size": case["experts"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": case["stage"], "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**6,
    }


def train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case trained ``STEPS`` steps on this rank's share of the global batches: its losses,
    the global gradient norms, the whole model at the end (rank 0), what it holds of the
    experts, and how many tokens each of its experts received per micro-step (some none)."""
    import zero_engine

    torch.set_num_threads(1)
    found = []
    for case in cases:
        model = moe(case["family"])
        engine = zero_engine.initialize(model, _config(case))
        routed: list[list[int]] = []

        def count(module, args, output, routed=routed):  # the router's choices for this rank's tokens
            routed.append(torch.bincount(output[2].reshape(-1), minlength=8).tolist())

        hooks = [m.register_forward_hook(count) for n, m in engine.module.named_modules() if n.endswith("mlp.gate")]
        batches = _batches(world, case["micro"], case["accum"])
        losses, norms = [], []
        for step in range(STEPS):
            for micro_step in range(case["accum"]):
                ids = batches[step, micro_step, rank]
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            norms.append(engine.get_global_grad_norm())
        for hook in hooks:
            hook.remove()
        state = engine.full_state_dict()
        held = {name: tuple(shape) for unit in engine.units for name, shape in zip(unit.names, unit.shapes)
                if "experts" in name}  # the parameters as this rank's units hold them (whole or its box)
        found.append({"losses": losses, "norms": norms, "state": state if rank == 0 else None, "held": held,
                      "routed": routed})
        engine.close()
    return found


def one_process(case: dict, world: int) -> dict:
    """The same model trained in one process on the same global batches: each step the mean of
    every rank's micro-batch means, AdamW, clipping as torch clips."""
    model = moe(case["family"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batches = _batches(world, case["micro"], case["accum"])
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        per_rank = [[] for _ in range(world)]
        for micro_step in range(case["accum"]):
            for rank in range(world):
                ids = batches[step, micro_step, rank]
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (world * case["accum"])).backward()
                per_rank[rank].append(loss.item())
        losses.append(per_rank)
        params = [p for p in model.parameters() if p.grad is not None]
        if case["clip"]:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, case["clip"])))
        else:
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        optimizer.step()
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _check(case: dict, world: int, results: list[dict]) -> None:
    expected = one_process(case, world)
    accum, experts = case["accum"], case["experts"]
    for rank, got in enumerate(results):
        for step in range(STEPS):
            for micro_step in range(accum):
                assert abs(got["losses"][step * accum + micro_step] - expected["losses"][step][rank][micro_step]) < TOL, (
                    case, rank, step)
        assert max(abs(a - b) for a, b in zip(got["norms"], expected["norms"])) < TOL, (case, rank)
        for name, shape in got["held"].items():  # this rank's experts only
            assert shape[0] == expected["state"][name].shape[0] // experts, (name, shape)
    state = results[0]["state"]
    assert state.keys() == expected["state"].keys()
    for name, tensor in expected["state"].items():
        assert state[name].shape == tensor.shape, name
        assert (state[name] - tensor).abs().max() < TOL, (case, name, (state[name] - tensor).abs().max())
    # some expert received no token on some rank in some micro-step, and every expert some token somewhere
    routed = [counts for got in results for counts in got["routed"]]
    assert any(0 in counts for counts in routed)
    assert all(sum(column) > 0 for column in zip(*routed))


def _case(family: str, stage: int, experts: int, accum: int = 1, clip: float = 0.0, micro: int = 1) -> dict:
    return {"family": family, "stage": stage, "experts": experts, "accum": accum, "clip": clip, "micro": micro}


FAST = {
    2: [_case("qwen3_moe", stage, 2, accum=2, clip=0.05) for stage in (0, 1, 2, 3)] + [_case("mixtral", 3, 2)],
    4: [_case("qwen3_moe", 3, 4, clip=0.05), _case("mixtral", 1, 2, accum=2, clip=0.05)],
}
SLOW = {
    2: [_case("mixtral", stage, 2, accum=2, clip=0.05) for stage in (0, 1, 2)],
    4: [_case(family, stage, experts, accum=2, clip=0.05) for family in ("qwen3_moe", "mixtral")
        for stage in (0, 1, 2, 3) for experts in (2, 4)],
}


@pytest.mark.parametrize("world", sorted(FAST))
def test_experts_owned_per_rank_train_as_one_process(world: int) -> None:
    cases = FAST[world]
    results = run_on_ranks(world, train_cases, cases, timeout=600, allow_numpy=True)
    for index, case in enumerate(cases):
        _check(case, world, [results[rank][index] for rank in range(world)])


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW))
def test_experts_owned_per_rank_whole_grid(world: int) -> None:
    cases = SLOW[world]
    results = run_on_ranks(world, train_cases, cases, timeout=1800, allow_numpy=True)
    for index, case in enumerate(cases):
        _check(case, world, [results[rank][index] for rank in range(world)])
