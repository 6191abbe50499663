"""Hybrid sharding (``zero_optimization.shard_group_size``): states sharded inside groups of
ranks and replicated across groups, against one process, in real processes.

4 ranks as 2 groups of 2, 6 ranks as 3 groups of 2 and as 2 groups of 3: every stage, with
accumulation, on the model with the tied weight, plain SGD and clipped AdamW. Each case also
reports its traffic by scope and its memory, checked against the ring formulas and the ZeRO
formula with the group size G in place of the world size N. In the same processes: mixed
precision against the policy reference, two backwards in one micro-step, meta-device init,
weights loading, and fp16 overflow on a rank of the second group. Then a resume from 2x2 to 3
plain ranks and back, and two torchrun "nodes" on this machine.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import TrapModel, decay_groups, init_trap_model, make_model, train_engine, train_reference
from backward_cases import check_backwards_add_up, two_backwards_per_micro_step
from meta_cases import meta_trap_model, reference_init
from precision_cases import check_precision, check_skipped_everywhere, overflow_on_one_rank, precision_grid
from zero_engine.comm import DONE, Pending, TwoPhase, connect
from zero_engine.comm.handles import SecondPhaseThread
from zero_engine.memory import formula_bytes
from zero_engine.stage import stage_for

ROOT = Path(__file__).resolve().parent.parent
STEPS, MICRO, LR, TOL = 3, 2, 0.05, 2e-5

CASES = [
    {"stage": stage, "accum": 3, "optimizer": "SGD"} for stage in (0, 1, 2, 3)
] + [
    {"stage": stage, "accum": 1, "optimizer": "AdamW", "clip": 0.05} for stage in (0, 1, 2, 3)
] + [
    {"stage": 2, "accum": 2, "optimizer": "AdamW", "each_micro_step": False},
]


def _distinct_weights() -> dict[str, torch.Tensor]:
    """Weights to load: every element different, so a range read from the wrong place shows."""
    generator = torch.Generator().manual_seed(11)
    weights = {name: torch.randn(value.shape, generator=generator) for name, value in make_model().state_dict().items()}
    weights["head.weight"] = weights["embed.weight"]  # tied, as the model's own state dict has it
    return weights


def _config(case: dict, group: int) -> dict:
    return engine_config(
        case["stage"], micro=MICRO, lr=LR, accum=case["accum"], optimizer=case["optimizer"], clip=case.get("clip", 0.0),
        shard_group_size=group, reduce_bucket_size=40,
        reduce_scatter_each_micro_step=case.get("each_micro_step", True), stage3_param_persistence_threshold=0,
    )


# Mixed precision against the single-process policy reference (tolerances of test_precision).
PRECISION_CASES = [
    {"stage": 1, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 2, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 3, "dtype": "bf16", "accum": 4, "clip": 1.0},
    {"stage": 2, "dtype": "fp16", "accum": 1, "clip": 1.0},
]


# Two backwards in one micro-step (stages 2-3 allow it on the boundary): (stage, accumulation).
SPLIT_CASES = [(2, 1), (2, 2), (3, 1), (3, 2)]


def hybrid_grid(rank: int, world_size: int, groups: list[int], overflow_stages: list[int]) -> dict:
    out: dict = {"cases": {}, "overflow": {}}
    if overflow_stages:  # one G suffices
        cases = [dict(case, shard_group_size=groups[0]) for case in PRECISION_CASES]
        out["precision"] = precision_grid(rank, world_size, cases)
        splits = [(stage, accum, groups[0]) for stage, accum in SPLIT_CASES]
        out["split"] = two_backwards_per_micro_step(rank, world_size, splits)
    for group in groups:
        for index, case in enumerate(CASES):
            model = make_model()
            engine = zero_engine.initialize(model, _config(case, group), param_groups=decay_groups(model))
            losses, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"])
            comm = engine.comm
            out["cases"][group, index] = {
                "losses": losses,
                "norms": norms,
                "comm": engine.comm_report(),  # of the last step
                "memory": engine.memory_report(),
                "optimizer_tensors": len(engine.optimizer.state),
                "shard_numels": [unit.layout.shard_numel for unit in engine.units],
                "groups": (comm.shard_group_ranks, comm.replica_group_ranks),
                "mesh": (comm.mesh.size("replicate"), comm.mesh.size("zero"), comm.mesh.batch, comm.mesh.grad_divisor),
                "process_groups": [
                    dist.get_process_group_ranks(g) if g is not None else None
                    for g in (comm.shard_group.group, comm.replica_group.group)
                ],
                "state": engine.full_state_dict(),
            }
            if case["stage"] == 3:  # onto rank 0 alone: only the first group gathers
                engine.comm.reset_report()
                out["cases"][group, index]["rank0_state"] = engine.full_state_dict(rank0_only=True)
                out["cases"][group, index]["rank0_gather_bytes"] = engine.comm_report()["gather"]["sent"]
            engine.close()
    # Built on the meta device, or from weights: each group materializes or reads its shards.
    # Units of 91, 88, 84 and 19 elements: padded at G = 2 and 3, so a shifted read shows.
    zero = {
        "stage": 3, "shard_group_size": groups[0], "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40,
    }
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero}
    engine = zero_engine.initialize(meta_trap_model(), config, param_init_fn=init_trap_model)
    out["meta_init"] = engine.full_state_dict()
    engine.close()
    engine = zero_engine.initialize(meta_trap_model(), config, weights=_distinct_weights())
    out["weights"] = engine.full_state_dict()
    out["weights_padding"] = [unit.layout.padding_numel for unit in engine.units]
    engine.close()
    for stage in overflow_stages:  # the poisoned element reaches rank 0 across groups
        out["overflow"][stage] = overflow_on_one_rank(
            rank, world_size, stage, poisoner=world_size - 1, zero={"shard_group_size": groups[0]}
        )
    return out


def _check_case(case: dict, world_size: int, group: int, results: list[dict]) -> None:
    label = f"{case} at {world_size} ranks in groups of {group}"
    replicas, accum, stage = world_size // group, case["accum"], case["stage"]
    ref_losses, ref_state, ref_norms = train_reference(
        STEPS, MICRO * accum * world_size, case["optimizer"], LR, case.get("clip", 0.0)
    )
    for step in range(STEPS):
        window = [loss for result in results for loss in result["losses"][step]]
        assert sum(window) / len(window) == pytest.approx(ref_losses[step], abs=TOL), (label, step)
    for rank, result in enumerate(results):
        if stage == 3:
            if rank == 0:
                assert all(torch.equal(result["rank0_state"][k], v) for k, v in result["state"].items()), label
            else:
                assert result["rank0_state"] == {}, label
            assert (result["rank0_gather_bytes"] > 0) == (rank < group), f"{label}: rank {rank} gathered"
        assert result["norms"] == pytest.approx(ref_norms, abs=1e-4), (label, rank)
        for name, ref in ref_state.items():
            diff = (result["state"][name] - ref).abs().max().item()
            assert diff <= TOL, f"{label}, rank {rank}: {name} differs by {diff}"

        # Groups: G consecutive ranks shard; the ranks at the same place in each group replicate.
        first = rank - rank % group
        shard_ranks, replica_ranks = list(range(first, first + group)), list(range(rank % group, world_size, group))
        assert result["groups"] == (shard_ranks, replica_ranks), label
        # One mesh of world / G groups of G: every rank reads samples and divides by all of them.
        assert result["mesh"] == (world_size // group, group, world_size, world_size), label
        for made, expected in zip(result["process_groups"], (shard_ranks, replica_ranks)):
            assert made == expected, (label, made, expected)

        # Traffic of the last step, per rank, ring volumes: only the shard crosses groups, once a step.
        comm, shard_bytes = result["comm"], 4 * sum(result["shard_numels"])
        padded_bytes, inside, across = shard_bytes * group, (group - 1) / group, (replicas - 1) / replicas
        small = 2 * 8 * 64  # the used-mask-and-norm agreement: one float64 per parameter (< 64)
        if stage == 0:
            assert comm["intra_group"]["sent"] == comm["inter_group"]["sent"] == 0, label
            assert comm["all_ranks"]["sent"] >= 2 * padded_bytes * (world_size - 1) / world_size, label
            continue
        assert abs(comm["inter_group"]["sent"] - 2 * shard_bytes * across) <= len(result["shard_numels"]), label
        assert comm["all_ranks"]["sent"] < small, label
        scatters = accum if case.get("each_micro_step", True) and stage >= 2 else 1
        assert abs(comm["reduce_scatter"]["sent"] - scatters * padded_bytes * inside) <= 4 * len(result["shard_numels"])
        if stage < 3:  # updated shards, once; stage 3 gathers each unit at each use (compared across G below)
            assert abs(comm["all_gather"]["sent"] - padded_bytes * inside) <= 4 * len(result["shard_numels"]), label
        gathers = comm["all_gather"]["sent"] + comm["all_gather_frozen"]["sent"]  # the frozen layer's, at stage 3
        assert comm["intra_group"]["sent"] == comm["reduce_scatter"]["sent"] + gathers, label

        # Memory: the ZeRO formula with G in place of N. The engine's count is enough here: the
        # same counting is held to the storages the process holds in test_distributed.py and
        # test_stage3.py, and hybrid memory to the resident set in test_stage3_memory.py.
        memory, formula = result["memory"], formula_bytes(sum(result["shard_numels"]) * group, stage_for(stage), group)
        if stage >= 2 and case.get("each_micro_step", True):  # stage 3 releases them after the step
            assert memory["gradients"] == (0 if stage == 3 else shard_bytes), label
        if stage == 3:
            assert memory["parameters"] - memory["frozen_parameters"] == formula.parameters == shard_bytes, label
            assert 0 < memory["frozen_parameters"] <= 4 * (7 * 7 + 7) / group + 4 * 2 * group, label  # sharded over G
    if stage >= 1 and case["optimizer"] == "AdamW":  # each shard's state once per group, R copies in all
        states = sum(r["memory"]["optimizer_states"] - 4 * r["optimizer_tensors"] for r in results)
        stepped = sum(p.numel() for p in make_model().parameters() if p.requires_grad) - 5  # less `unused`
        assert states == 8 * stepped * replicas, label


def _check_grid(world_size: int, groups: list[int], per_rank: list[dict]) -> None:
    for group in groups:
        for index, case in enumerate(CASES):
            _check_case(case, world_size, group, [r["cases"][group, index] for r in per_rank])
    # Stage 3 gathers: the same volume per rank as plain ZeRO over G ranks, (G - 1)/G of the
    # payload, whatever the world size and G (up to padding).
    for index, case in enumerate(CASES):
        if case["stage"] == 3:
            gathered = [per_rank[0]["cases"][group, index]["comm"]["all_gather"]["sent"] for group in groups]
            payloads = [sent * group / (group - 1) for sent, group in zip(gathered, groups)]
            assert max(payloads) - min(payloads) <= 4 * 6 * 8 * case["accum"], payloads
    for result in per_rank if "split" in per_rank[0] else []:
        check_backwards_add_up(SPLIT_CASES, result["split"])
    for index, case in enumerate(PRECISION_CASES if "precision" in per_rank[0] else []):
        check_precision(case, world_size, [r["precision"][index] for r in per_rank])
    initial = reference_init(TrapModel, init_trap_model)
    for rank, result in enumerate(per_rank):
        for name, value in initial.items():
            assert torch.equal(result["meta_init"][name], value), f"rank {rank}: meta-initialized {name} differs"
            assert torch.equal(result["weights"][name], _distinct_weights()[name]), f"rank {rank}: loaded {name}"
        assert max(result["weights_padding"]) > 0, result["weights_padding"]
        for overflow in result["overflow"].values():
            check_skipped_everywhere(rank, overflow)


@pytest.mark.slow  # the fast run trains 2 groups of 2 in test_resume_from_hybrid_to_plain_and_back and the quantized hop
def test_hybrid_2x2_matches_single_process() -> None:
    _check_grid(4, [2], run_on_ranks(4, hybrid_grid, [2], [1, 3], timeout=300))


@pytest.mark.slow  # 6 ranks
def test_hybrid_3x2_and_2x3_match_single_process() -> None:
    _check_grid(6, [2, 3], run_on_ranks(6, hybrid_grid, [2, 3], [2], timeout=400))


class _Work:
    """A torch work object whose completion a test sets (from any thread)."""

    def __init__(self) -> None:
        self.completed = threading.Event()

    def is_completed(self) -> bool:
        return self.completed.is_set()

    def wait(self) -> None:
        self.completed.wait()


def _eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_on_gloo_second_phases_start_without_the_host_in_launch_order() -> None:
    """On gloo a thread launches each second phase once its first phase completes, the host
    doing nothing meanwhile, and never ahead of an earlier reduction's: every rank launches the
    across-group all-reduces in the same order."""
    starter = SecondPhaseThread()
    started: list[int] = []
    works = [_Work() for _ in range(3)]
    reductions = [
        TwoPhase(Pending((work,)), lambda i=i: started.append(i) or DONE, starter) for i, work in enumerate(works)
    ]
    works[1].completed.set()
    time.sleep(0.2)
    assert started == [], "the second is ready but must wait for the first"
    works[0].completed.set()
    assert _eventually(lambda: started == [0, 1])
    works[2].completed.set()
    assert _eventually(lambda: started == [0, 1, 2])
    for reduction in reductions:
        reduction.wait()
        assert reduction.done()


class _FailedWork(_Work):
    def wait(self) -> None:
        raise RuntimeError("Timed out waiting 60000ms for recv operation to complete")


def test_a_first_phase_that_fails_on_the_thread_raises_where_the_reduction_is_waited_for() -> None:
    second: list[int] = []
    failed = TwoPhase(Pending((_FailedWork(),)), lambda: second.append(1) or DONE, SecondPhaseThread())
    with pytest.raises(RuntimeError, match="Timed out"):
        failed.wait()
    assert second == [] and not failed.done()


def _hosts_blocked_elsewhere(rank: int, world_size: int) -> dict:
    """Four ranks in two shard groups, each with a hybrid reduction every rank launched. Ranks
    1 and 2 wait for it (so for the second phase of their replica 3 or 0) before they launch a
    gather inside their group; ranks 0 and 3 block on that gather first. The cycle the MoE test
    hit at stage 3 under load (1 in 22 runs: a gloo timeout): it closes unless second phases
    are launched by something other than the blocked hosts."""
    config = zero_engine.load_config({
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "shard_group_size": 2},
        "comm": {"timeout_s": 20},
    })
    comm = connect(config, torch.device("cpu"))
    flat = torch.full((4,), float(rank + 1))
    reduction = comm.reduce_scatter_sum(flat)
    gathered = torch.zeros(4)
    comm.shard_group.own_shard(gathered).fill_(10.0 * (comm.shard_rank + 1))

    def gather() -> None:
        comm.all_gather(gathered).wait()

    if rank in (1, 2):
        reduction.wait()
        gather()
    else:
        gather()
        reduction.wait()
    return {"reduced": comm.shard_group.own_shard(flat).tolist(), "gathered": gathered.tolist()}


def test_a_reduction_every_rank_launched_completes_while_hosts_block_on_gathers() -> None:
    results = run_on_ranks(4, _hosts_blocked_elsewhere, timeout=120)
    total = float(sum(range(1, 5)))
    assert all(result == {"reduced": [total, total], "gathered": [10.0, 10.0, 20.0, 20.0]} for result in results)


# -- resume: 2 groups of 2 -> 3 plain ranks -> 2 groups of 2 -------------------------------------

GLOBAL_BATCH, LEG = 12, 2
SETUPS = {3: (2, 2), 4: (3, 1)}  # world size: (micro-batch, accumulation), global batch 12


def resume_leg(rank: int, world_size: int, leg: int, stage: int, group: int | None, load: str, save: str) -> dict:
    micro, accum = SETUPS[world_size]
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 0.0,  # the reference does not clip
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": stage, "shard_group_size": group, "reduce_bucket_size": 50,
            "stage3_param_persistence_threshold": 0,
        },
    }
    model = make_model(seed=leg)  # a resumed model starts elsewhere
    engine = zero_engine.initialize(model, config, param_groups=decay_groups(model))
    if load:
        engine.load_checkpoint(load)
    losses, _ = train_engine(engine, rank, world_size, range(leg * LEG, (leg + 1) * LEG), micro, accum)
    path = engine.save_checkpoint(save)
    files = sorted(p.name for p in path.iterdir() if p.name.startswith("rank"))
    pieces = {name: len(torch.load(path / name, weights_only=True)["pieces"]) for name in files}
    result = {"losses": losses, "state": engine.full_state_dict(), "pieces": pieces}
    engine.close()
    return result


# (world size, stage, shard group size) of each leg: the fast run goes from hybrid to plain, the
# slow run back to hybrid too.
HYBRID_LEGS = [(4, 2, 2), (3, 3, None), (4, 1, 2)]


@pytest.mark.parametrize("count", [2, pytest.param(3, marks=pytest.mark.slow)], ids=["to-plain", "and-back"])
def test_resume_from_hybrid_to_plain_and_back(tmp_path: Path, count: int) -> None:
    legs = HYBRID_LEGS[:count]
    outcome = []
    for leg, (world_size, stage, group) in enumerate(legs):
        load = str(tmp_path / f"leg{leg - 1}") if leg else ""
        outcome.append(run_on_ranks(world_size, resume_leg, leg, stage, group, load, str(tmp_path / f"leg{leg}")))
    ref_losses, ref_state, _ = train_reference(LEG * len(legs), GLOBAL_BATCH, lr=LR)
    means = []
    for per_rank in outcome:
        for step in range(LEG):
            window = [loss for result in per_rank for loss in result["losses"][step]]
            means.append(sum(window) / len(window))
    assert means == pytest.approx(ref_losses, abs=2e-5)
    for rank, result in enumerate(outcome[-1]):
        for name, ref in ref_state.items():
            diff = (result["state"][name] - ref).abs().max().item()
            assert diff <= 2e-5, f"rank {rank}: {name} differs by {diff} after legs {legs}"
    # One copy per shard: the second group's ranks write no pieces, only their RNG state.
    hybrid_pieces = outcome[0][0]["pieces"]
    assert hybrid_pieces["rank00002.pt"] == hybrid_pieces["rank00003.pt"] == 0
    assert hybrid_pieces["rank00000.pt"] > 0 and hybrid_pieces["rank00001.pt"] > 0
    assert all(count > 0 for count in outcome[1][0]["pieces"].values())


# -- two torchrun "nodes" on this machine ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: str, launcher: list[str], steps: int = 10) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "scripts" / "train.py"),
        "--config", str(ROOT / "configs" / config), "--steps", str(steps), "--eval-batches", "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


@pytest.mark.parametrize(  # the fast run: the groups after one step; the slow run: ten, against plain stage 3
    "steps", [1, pytest.param(10, marks=pytest.mark.slow)], ids=["groups", "against-plain"]
)
def test_two_nodes_shard_inside_each_node_and_train_as_one(steps: int) -> None:
    """The main job on two torchrun "nodes" (c10d rendezvous on localhost, 2 ranks each) with
    ``shard_group_size: auto``: every rank's shard group is its own node's ranks (which ranks a
    node has is read from which launcher printed them), its replica group one rank per node; and
    (ten steps) the run prints the same figures as plain stage 3 over the 4 ranks on one node."""
    port = _free_port()
    nodes = [
        _launch("zero3_hybrid.yaml", [
            "--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=zero-engine-hybrid-test",
        ], steps)
        for node in (0, 1)
    ]
    outputs = [_finish(node) for node in nodes]
    line = re.compile(r"^rank (\d+) on node \d+: shard group \[([\d, ]+)\], replica group \[([\d, ]+)\]$", re.M)
    node_ranks = [{int(rank) for rank, *_ in line.findall(output)} for output in outputs]
    assert sorted(map(len, node_ranks)) == [2, 2] and not node_ranks[0] & node_ranks[1], outputs
    for output, ranks in zip(outputs, node_ranks):
        for rank, shard, replica in line.findall(output):
            assert {int(r) for r in shard.split(", ")} == ranks, f"rank {rank} shards outside its node: {output}"
            replicas = [int(r) for r in replica.split(", ")]
            assert len(replicas) == 2 and sum(r in ranks for r in replicas) == 1, output
    if steps == 1:
        return
    plain = _finish(_launch("zero3.yaml", ["--standalone", "--nproc_per_node=4"]))
    assert "rank 0 on node" not in plain, "one node: no replicas"
    # the engine's progress line at step 10 (the script's own lines give memory alone since 37c7317)
    step_loss = r"\[zero_engine\] step 10 \| loss (\d+\.\d+)"
    for pattern in (step_loss, r"grad norm (\d+\.\d+)", r"held-out loss (\d+\.\d+)"):
        hybrid, single = re.findall(pattern, "".join(outputs)), re.findall(pattern, plain)
        assert len(hybrid) == len(single) == 1, (pattern, outputs, plain)
        assert float(hybrid[0]) == pytest.approx(float(single[0]), abs=2e-3), (pattern, outputs, plain)
