"""Run a function on N ranks in real processes, with gloo over a file rendezvous (or, with
``backend=None``, torchrun's environment, from which the engine makes its own group).

Starting the processes is the slow part (each imports torch), so tests pass a whole grid of
cases to one call, and ranks are forked from a server that imported torch once
(`_rank_context`; a fresh interpreter per rank where that server would not fit). Rank processes
cannot import numpy, which the engine must not need (unless a test of a library that needs it,
such as transformers, says ``allow_numpy=True``: those ranks fork from a second server, which
imported numpy, transformers and peft too). A rank that raises is reported with its
traceback and the others are killed at once; ranks that do not finish within the timeout fail
the test instead of hanging it. Either way the failure shows where every other rank was
(`_stacks_of`): what a hang waits for is in the ranks that did not raise.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    allow_numpy: bool = False,
    backend: str | None = "gloo",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the ranks' results in rank order.

    ``fn`` must be importable (a module-level function) and return something picklable.
    ``backend=None`` initializes no process group: each rank gets torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), so `initialize` connects as under torchrun.
    """
    context, server = _rank_context(allow_numpy)
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        outbox = context.Queue()
        rendezvous = os.path.join(tmp, "rendezvous") if backend else f"127.0.0.1:{_free_port()}"
        procs = [
            context.Process(
                target=_worker, args=(rank, world_size, backend, rendezvous, fn, args, outbox, tmp), daemon=True
            )
            for rank in range(world_size)
        ]
        os.environ[_RANK_PROCESS] = "numpy" if allow_numpy else "no-numpy"  # inherited by the children only
        try:
            with _forked_by(server):
                for proc in procs:
                    proc.start()
        finally:
            del os.environ[_RANK_PROCESS]
        deadline = time.monotonic() + timeout
        failed = -1
        try:
            while len(results) < world_size:
                try:
                    rank, ok, payload = outbox.get(timeout=0.5)
                except queue.Empty:
                    _check_alive(procs, results, deadline, timeout)
                    continue
                if not ok:
                    failed = rank  # its own traceback says where it was
                    raise RankFailure(f"rank {rank} of {world_size} raised:\n{payload}")
                results[rank] = pickle.loads(payload)
        except RankFailure as failure:
            raise RankFailure(f"{failure}{_stacks_of(procs, {*results, failed}, tmp)}") from None
        finally:
            for proc in procs:
                proc.join(timeout=10 if len(results) == world_size else 0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [results[rank] for rank in range(world_size)]


# The modules the second fork server imports for the ranks that may import numpy (those of
# Hugging Face's libraries most such tests build on: a fresh interpreter takes ~5 s for them).
NUMPY_PRELOAD = ("numpy", "zero_engine", "transformers", "transformers.models.llama.modeling_llama",
                 "transformers.models.gpt2.modeling_gpt2", "transformers.trainer", "peft")
# Variables no rank reads differently: pytest's name of the running test, and the cache
# directory inductor sets to its own default on its first in-process compile (which, counted,
# turned every later call of the suite into fresh interpreters).
_ENVIRONMENT_IGNORED = ("PYTEST_", "TORCHINDUCTOR_CACHE_DIR")
_SERVERS: dict[bool, tuple[Any, dict[str, str]]] = {}  # allow_numpy -> (server, the environment it started in)


def _rank_context(allow_numpy: bool) -> tuple[Any, Any]:
    """Where rank processes come from: a multiprocessing context, and the fork server to start
    them from (None: the context's own). A fork server (Linux) imports this module once, with
    numpy kept out and torch imported, and forks each rank from it: a rank starts in a fraction
    of the second or two a fresh interpreter takes to import torch, which over the suite's few
    hundred calls is minutes. Ranks that may import numpy fork from a second server of their
    own, which imported numpy and `NUMPY_PRELOAD` (torch binds numpy at import for good, so one
    server cannot serve both). Forked ranks get their server's environment, so a call whose
    environment differs (a test that set a variable: the allocator's, say) gets fresh
    interpreters, as every call did before."""
    environment = {key: value for key, value in os.environ.items()
                   if key != _RANK_PROCESS and not key.startswith(_ENVIRONMENT_IGNORED)}
    if not sys.platform.startswith("linux"):
        return multiprocessing.get_context("spawn"), None
    if allow_numpy not in _SERVERS:
        # A server imports this module by name before it knows the caller's sys.path (Python
        # 3.11 applies it only afterwards), so this directory goes on PYTHONPATH, for good: the
        # environment compared below stays the same.
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
            environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
        server = multiprocessing.forkserver.ForkServer()  # started at its first rank, with that rank's _RANK_PROCESS
        server.set_forkserver_preload([__name__, *(NUMPY_PRELOAD if allow_numpy else ())])
        _SERVERS[allow_numpy] = server, environment
    server, started_in = _SERVERS[allow_numpy]
    if environment != started_in:
        return multiprocessing.get_context("spawn"), None
    return multiprocessing.get_context("forkserver"), server


@contextmanager
def _forked_by(server: Any) -> Iterator[None]:
    """Processes of the forkserver context started inside fork from ``server`` (None: the
    context's own): multiprocessing asks its one module-level server for each new process."""
    if server is None:
        yield
        return
    original = multiprocessing.forkserver.connect_to_new_process
    multiprocessing.forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        multiprocessing.forkserver.connect_to_new_process = original


def _check_alive(procs: list[Any], results: dict[int, Any], deadline: float, timeout: float) -> None:
    for rank, proc in enumerate(procs):
        if rank not in results and not proc.is_alive():
            raise RankFailure(f"rank {rank} died with exit code {proc.exitcode} before reporting")
    if time.monotonic() > deadline:
        missing = [rank for rank in range(len(procs)) if rank not in results]
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)")


def _stacks_of(procs: list[Any], reported: set[int], tmp: str) -> str:
    """Where every rank that has not reported is now: each dumps its threads' Python stacks
    (`faulthandler`, registered by `_worker` on SIGUSR1) into a file of its own, read here."""
    waiting = [rank for rank, proc in enumerate(procs) if rank not in reported and proc.is_alive()]
    if not waiting or not hasattr(signal, "SIGUSR1"):
        return ""
    for rank in waiting:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)  # the dumps are written from the ranks' signal handlers
    stacks = []
    for rank in waiting:
        path = os.path.join(tmp, f"stacks{rank}.txt")
        text = open(path).read().strip() if os.path.exists(path) else ""
        stacks.append(f"rank {rank}:\n{text or '(no stack written)'}")
    return "\n\nwhere the other ranks were:\n" + "\n".join(stacks)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker(
    rank: int, world_size: int, backend: str | None, rendezvous: str, fn: Callable[..., Any], args: tuple, outbox: Any,
    tmp: str,
) -> None:
    torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):  # `_stacks_of`: the file stays open for the process's life
        faulthandler.register(signal.SIGUSR1, file=open(os.path.join(tmp, f"stacks{rank}.txt"), "w"), all_threads=True)
    try:
        if backend is None:
            address, port = rendezvous.split(":")
            os.environ.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR=address, MASTER_PORT=port,
            )
        else:
            dist.init_process_group(
                backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=120),
            )
        result = fn(rank, world_size, *args)
        outbox.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        outbox.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the collectives a rank issues, recorded at torch.distributed -------------------------------

# The torch.distributed functions the engine's groups call, and the flat collectives looked up
# in `zero_engine.comm.groups` (names differ between torch versions).
WRAPPED = ("all_reduce", "reduce", "broadcast", "all_gather", "batch_isend_irecv", "barrier", "all_to_all_single")
NATIVE = ("_reduce_scatter_tensor", "_all_gather_into_tensor")


@contextmanager
def recorded_collectives(calls: list) -> Iterator[None]:
    """While inside, every collective the engine's groups issue is appended to ``calls`` as
    ``(GroupComm method, torch function, group, bytes of its largest tensor)`` (`recording`)."""
    from zero_engine.comm import groups

    originals = {name: getattr(dist, name) for name in WRAPPED}
    natives = {name: getattr(groups, name) for name in NATIVE}
    try:
        for name, function in originals.items():
            setattr(dist, name, recording(calls, name, function))
        for name, function in natives.items():
            setattr(groups, name, recording(calls, name, function))
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        for name, function in natives.items():
            setattr(groups, name, function)


def recording(calls: list, name: str, function: Callable) -> Callable:
    """``function``, recording the `GroupComm` method that called it, the group it was given and
    the bytes of its largest tensor argument (the whole flat buffer of a native collective, one
    shard of a per-shard one; an all-to-all's received and sent buffers together); point-to-point
    batches as one call per send or receive."""
    from zero_engine.comm.groups import GroupComm

    def record(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame.f_code.co_name.startswith("<") or not isinstance(frame.f_locals.get("self"), GroupComm):
            frame = frame.f_back
        if name == "batch_isend_irecv":
            for op in args[0]:
                calls.append((frame.f_code.co_name, op.op.__name__, op.group, op.tensor.numel() * op.tensor.element_size()))
            return function(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        nbytes = max((a.numel() * a.element_size() for a in tensors), default=0)
        if name == "all_to_all_single":  # pieces of any sizes: what this rank receives and sends
            nbytes = sum(a.numel() * a.element_size() for a in tensors)
        calls.append((frame.f_code.co_name, name, kwargs.get("group"), nbytes))
        return function(*args, **kwargs)

    return record
