"""Run a function on N ranks in real processes, with gloo over a file rendezvous.

Spawning is the slow part (each process imports torch), so tests pass a whole grid of cases
to one call. Rank processes cannot import numpy, which the engine must not need (unless a test
of a library that needs it, such as transformers, says ``allow_numpy=True``). A rank that
raises is reported with its traceback and the others are killed at once; ranks that do not
finish within the timeout fail the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_RANK_PROCESS = "ZERO_ENGINE_TEST_RANK_PROCESS"
if os.environ.get(_RANK_PROCESS) == "no-numpy":
    # Rank processes run without numpy, as on a machine with only the engine's dependencies
    # (torch does not require numpy; torch.distributed's *_object collectives do). This runs
    # before the child imports torch, which would otherwise bind numpy for good.
    sys.modules.setdefault("numpy", None)  # type: ignore[arg-type]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out."""


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 180.0, allow_numpy: bool = False
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the ranks' results in rank order.

    ``fn`` must be importable (a module-level function) and return something picklable.
    """
    context = multiprocessing.get_context("spawn")
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        outbox = context.Queue()
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [
            context.Process(target=_worker, args=(rank, world_size, rendezvous, fn, args, outbox), daemon=True)
            for rank in range(world_size)
        ]
        os.environ[_RANK_PROCESS] = "numpy" if allow_numpy else "no-numpy"  # inherited by the children only
        try:
            for proc in procs:
                proc.start()
        finally:
            del os.environ[_RANK_PROCESS]
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                try:
                    rank, ok, payload = outbox.get(timeout=0.5)
                except queue.Empty:
                    _check_alive(procs, results, deadline, timeout)
                    continue
                if not ok:
                    raise RankFailure(f"rank {rank} of {world_size} raised:\n{payload}")
                results[rank] = pickle.loads(payload)
        finally:
            for proc in procs:
                proc.join(timeout=10 if len(results) == world_size else 0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [results[rank] for rank in range(world_size)]


def _check_alive(procs: list[Any], results: dict[int, Any], deadline: float, timeout: float) -> None:
    for rank, proc in enumerate(procs):
        if rank not in results and not proc.is_alive():
            raise RankFailure(f"rank {rank} died with exit code {proc.exitcode} before reporting")
    if time.monotonic() > deadline:
        missing = [rank for rank in range(len(procs)) if rank not in results]
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)")


def _worker(rank: int, world_size: int, rendezvous: str, fn: Callable[..., Any], args: tuple, outbox: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world_size, *args)
        outbox.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        outbox.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
