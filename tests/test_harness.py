"""The multi-process harness itself: failures name the rank, hangs end in a timeout."""

from __future__ import annotations

import re
import time

import pytest
import torch.distributed as dist

from harness import RankFailure, run_on_ranks


def rank_and_size(rank: int, world_size: int) -> tuple[int, int, int]:
    return rank, world_size, dist.get_world_size()


def fails_on_rank_one(rank: int, world_size: int) -> None:
    dist.barrier()  # every rank past its group's setup (under load one was still in it when rank 1 raised)
    if rank == 1:
        raise RuntimeError("deliberate failure on rank one")
    dist.barrier()  # rank 0 would wait forever for rank 1


def hangs_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_results_come_back_in_rank_order() -> None:
    assert run_on_ranks(3, rank_and_size) == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 2 raised:(.|\n)*deliberate failure on rank one"):
        run_on_ranks(2, fails_on_rank_one, timeout=60)
    assert time.monotonic() - started < 50, "the harness waited for the blocked rank instead of failing fast"


def test_a_hanging_rank_times_out() -> None:
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 4s") as failure:
        run_on_ranks(2, hangs_on_rank_zero, timeout=4)
    # where the hanging rank was: its stack, not only that it hung
    assert re.search(r"where the other ranks were:\nrank 0:\n(.|\n)*in hangs_on_rank_zero", str(failure.value))


def test_a_failure_shows_where_the_other_ranks_wait() -> None:
    """A hang ends in one rank's timeout; what it waited for is in the others' stacks (the
    hybrid hang of the MoE test needed every rank's to be understood)."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(3, fails_on_rank_one, timeout=60)
    message = str(failure.value)
    assert "deliberate failure on rank one" in message
    for rank in (0, 2):
        assert re.search(rf"\nrank {rank}:\n(.|\n)*barrier(.|\n)*in fails_on_rank_one", message), message
    assert "\nrank 1:\n" not in message  # its own traceback is there already


def numpy_available(rank: int, world_size: int) -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def test_ranks_run_without_numpy() -> None:
    """The engine's dependencies do not include numpy, so rank processes must not rely on it."""
    assert run_on_ranks(2, numpy_available) == [False, False]


def engine_connects_itself(rank: int, world_size: int) -> tuple[bool, str, int, int]:
    import torch

    import zero_engine

    before = dist.is_initialized()
    engine = zero_engine.initialize(
        torch.nn.Linear(2, 2), {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    )
    return before, dist.get_backend(), dist.get_rank(), engine.comm.world_size


def test_without_a_backend_ranks_get_torchruns_variables_and_the_engine_connects() -> None:
    """``backend=None`` (the CUDA tests' NCCL path): no group before `initialize`, which makes
    the default group from the environment as under torchrun."""
    assert run_on_ranks(2, engine_connects_itself, backend=None) == [(False, "gloo", 0, 2), (False, "gloo", 1, 2)]
