"""NVMe offload of the optimizer side (``offload_optimizer.device: nvme``): bit for bit what CPU
offload computes, its swap files per rank, the bytes it moves, the page cache it leaves, bad
paths refused at `initialize`, and checkpoints that do not care where the state waited.

Swap directories are made on a disk (`tests/disk.py`: /var/tmp here; /tmp may be tmpfs elsewhere, which
`check_swap_directory` refuses, as it refuses /dev/shm below)."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zero_engine
from disk import DISK
from harness import run_on_ranks
from muon_cases import train_engine as train
from nvme_cases import config, param_config
from tiny import make_gpt
from zero_engine.sharding.tiers.nvme import shard_swap_space, swap_space


def _in_memory() -> str:
    """A directory on tmpfs (/dev/shm on most machines), from the mount table."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[2] == "tmpfs"]
    return next(point for point in ["/dev/shm", *points] if point in points and os.path.isdir(point))
STEPS = 20


def cached_pages(path: Path) -> int:
    """Pages of the file in the page cache (``mincore`` on a private mapping of it: a probe that
    reads nothing, so it starts no read-ahead of its own)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        memory = (ctypes.c_char * size).from_buffer(mapping)
        pages = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(memory)), ctypes.c_size_t(size), pages) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        del memory
        return sum(page & 1 for page in pages)
    finally:
        mapping.close()


def against_cpu(rank: int, world: int, directory: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case trained with CPU offload and with NVMe offload; the NVMe run also reports its
    files, the bytes its swap moved in the last step (and the process's disk I/O), the state's
    bytes, and whether the page cache holds any of its file."""
    from zero_engine.sharding.tiers.swap import SwapFile
    from zero_engine.testing.process_memory import live_tensor_bytes

    results = []
    fast_write = SwapFile.write
    for case in cases:
        if case.get("slow_disk"):  # every write late: the next step's read of its shard must wait for it
            def slow_write(self: Any, regions: Any) -> None:
                time.sleep(0.02)
                fast_write(self, regions)

            SwapFile.write = slow_write
        states, report, live = [], {}, {}
        for device in ("cpu", "nvme"):
            options = {key: case[key] for key in ("dtype", "accum", "offload_param", "optimizer", "shard_group_size")
                       if key in case}
            engine = zero_engine.initialize(make_gpt(), config(case["stage"], device, directory, **options))
            train(engine, rank, world, range(STEPS - 1), case.get("accum", 2))
            if device == "nvme":
                swap_space(engine.units).drain()  # the last step's writes behind it done
                io_before = _process_io()
                train(engine, rank, world, range(STEPS - 1, STEPS), case.get("accum", 2))
                swap_space(engine.units).drain()  # the writes behind the step done
                io_after = _process_io()
                swap = swap_space(engine.units).file.path
                report = {
                    "nvme": engine.comm_report()["nvme"],
                    "disk": {key: io_after[key] - io_before[key] for key in io_before},
                    "state_bytes": sum(unit.optimizer_shard.owned_range[1] - unit.optimizer_shard.owned_range[0]
                                       for unit in engine.units) * 4 * 3,  # master, exp_avg, exp_avg_sq
                    "grad_bytes": sum(unit.optimizer_shard.grad.nvme_bytes for unit in engine.units),  # fp32
                    "grad_pages": sum(-(-unit.optimizer_shard.grad.nvme_bytes // 4096) * 4096 for unit in engine.units),
                    "grad_buffers": swap_space(engine.units).grad_buffers.nbytes,  # host buffers gradients cross in
                    "read_buffers": swap_space(engine.units).shard_buffers.nbytes,  # and those kept for the next reads
                    "largest_grad": max(unit.optimizer_shard.grad.nvme_bytes for unit in engine.units),
                    "buffer_count": swap_space(engine.units).buffer_count,
                    "grad_norms": 4 * len(engine.units),  # each gradient's fp32 norm, kept from its write
                    "memory": engine.memory_report(),
                    "file": swap.name, "cached": cached_pages(swap), "regions": swap_space(engine.units).file.end,
                }
            else:
                train(engine, rank, world, range(STEPS - 1, STEPS), case.get("accum", 2))
                host_grads = sum(unit.optimizer_shard.grad.nbytes for unit in engine.units)  # fp32 (+ staging)
            # the storages the process holds, the engine alive (less the last run's state dict)
            kept = sum(t.untyped_storage().nbytes() for state in states for t in state.values())
            live[device] = live_tensor_bytes() - kept
            states.append(engine.full_state_dict())
            engine.close()
            if device == "nvme":
                report["left"] = swap.exists()
        SwapFile.write = fast_write
        results.append({"equal": all(torch.equal(states[0][k], states[1][k]) for k in states[0]),
                        "live_saved": live["cpu"] - live["nvme"], "cpu_grad_bytes": host_grads, **report})
    return results


def _process_io() -> dict[str, int]:
    with open("/proc/self/io") as io:
        fields = dict(line.split(": ") for line in io.read().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


FAST = [  # stage 3 with the optimizer side on NVMe: the parameter shards' test below (and the slow grid here)
    {"stage": 1},
    {"stage": 2, "dtype": "bf16"},
    {"stage": 1, "accum": 1, "slow_disk": True},
    # 2 groups of 1: a window crosses once, on its boundary, read back from the file while a write is late
    {"stage": 2, "shard_group_size": 1, "accum": 3, "slow_disk": True},
]
SLOW = [
    {"stage": stage, "dtype": dtype, "offload_param": stage == 3}
    for stage in (1, 2, 3) for dtype in ("fp32", "bf16")
]
SLOW.append({"stage": 2, "optimizer": "Muon", "accum": 1})  # its matrices' state swapped beside AdamW's


@pytest.mark.parametrize("world, grid", [(2, FAST), pytest.param(3, SLOW, marks=pytest.mark.slow)])
def test_bit_for_bit_cpu_offload_files_per_rank_bytes_and_no_page_cache(world: int, grid: list) -> None:
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        per_rank = run_on_ranks(world, against_cpu, directory, grid)
        assert os.listdir(directory) == []  # every file removed on close
    for index, case in enumerate(grid):
        results = [r[index] for r in per_rank]
        assert all(r["equal"] for r in results), f"{case}: NVMe offload differs from CPU offload"
        assert len({r["file"] for r in results}) == world  # a file of its own per rank
        assert not any(r["left"] for r in results)
        for r in results:
            assert r["cached"] == 0, f"{case}: the page cache holds {r['cached']} pages of the swap file"
            if case.get("optimizer", "AdamW") == "AdamW":
                # each step reads and writes the state once; the gradient is written by every
                # reduction (stage 1: one a window; stages 2-3: one a micro-step), read back to add
                # each later one, and read once by the step
                reductions = 1 if case["stage"] == 1 else case.get("accum", 2)
                moved = r["state_bytes"] + reductions * r["grad_bytes"]
                assert r["nvme"]["read"] == r["nvme"]["written"] == moved, (case, r)
                # memory_report between steps: masters, state and gradient are in the file, not in memory
                memory = r["memory"]
                assert (memory["nvme"], memory["master_parameters"]) == (r["state_bytes"] + r["grad_bytes"], 0), \
                    (case, memory)
                assert memory["optimizer_states"] <= 8 * 64, (case, memory)  # AdamW's step counters alone
                # and as the process holds it (live storages): exactly the state and CPU offload's host
                # gradient less, the few buffers gradients cross in and are read into (and their norms) more
                saved = r["state_bytes"] + r["cpu_grad_bytes"] - r["grad_buffers"] - r["read_buffers"] - r["grad_norms"]
                # the pool read into (R3): buffer_count and one of the largest gradient's bytes
                assert 0 < r["read_buffers"] <= (r["buffer_count"] + 1) * r["largest_grad"], (case, r["read_buffers"])
                assert r["live_saved"] == saved, (case, r["live_saved"], saved)
                # what the process asked of the disk (/proc/self/io): every region once each way, and the
                # gradient's once more per later reduction, in whole pages (on this tiny model a page's
                # rounding is a tenth of a region)
                disk = r["regions"] + (reductions - 1) * r["grad_pages"]
                assert abs(r["disk"]["write_bytes"] - disk) <= 0.01 * disk, (case, r)
                assert abs(r["disk"]["read_bytes"] - disk) <= 0.01 * disk, (case, r)


# -- bad paths: refused at initialize, naming the key, nothing written ------------------------------

@pytest.mark.parametrize(
    "path, fragment",
    [
        ("/var/tmp/zero_engine-no-such-directory", "no such directory"),
        (_in_memory(), "is on tmpfs, which is memory, not a disk"),
    ],
)
@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_a_bad_swap_directory_is_refused(path: str, fragment: str, section: str) -> None:
    before = set(os.listdir(path)) if os.path.isdir(path) else set()
    settings = config(1, "nvme", path)
    if section == "offload_param":  # parameter shards on NVMe, the optimizer side on the host
        settings = param_config(config(3, "cpu", DISK), "nvme", "cpu", path)
    with pytest.raises(zero_engine.ConfigError) as info:
        zero_engine.initialize(make_gpt(), settings)
    assert f"zero_optimization.{section}.nvme_path" in str(info.value) and fragment in str(info.value)
    assert (set(os.listdir(path)) if os.path.isdir(path) else set()) == before


def test_a_swap_directory_too_small_or_a_file_is_refused(tmp_path: Path) -> None:
    from zero_engine.sharding.tiers.nvme import check_swap_directory

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        with pytest.raises(zero_engine.ConfigError, match="GiB free, what this node.s ranks offload there needs"):
            check_swap_directory(directory, 1 << 62)
        check_swap_directory(directory, 1 << 20)
        a_file = Path(directory) / "file"
        a_file.write_text("")
        with pytest.raises(zero_engine.ConfigError, match="is a file, not a directory"):
            check_swap_directory(str(a_file), 1)
        with pytest.raises(zero_engine.ConfigError, match="no such directory"):
            check_swap_directory(str(Path(directory) / "missing"), 1)
        with pytest.raises(zero_engine.ConfigError, match="'~' is not expanded here"):
            check_swap_directory("~", 1)


def test_the_room_asked_is_every_local_ranks_and_both_offloads_in_one_directory() -> None:
    """Reliability review N19: what each rank offloads to a directory counts once per rank of the
    node, and both offloads' where they share one; sizes below a GiB are said in MiB."""
    from types import SimpleNamespace

    from zero_engine.offload import Placed, Tier
    from zero_engine.sharding.tiers.nvme import check_swap_directories, readable_size

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        stats = os.statvfs(directory)
        free = stats.f_bavail * stats.f_frsize
        both = SimpleNamespace(state=Placed(Tier.NVME, directory), param_shards=Placed(Tier.NVME, directory))
        alone = SimpleNamespace(state=Placed(Tier.NVME, directory), param_shards=Placed(Tier.HOST))
        share = int(0.6 * free)
        check_swap_directories(alone, share, 0, local_ranks=1)  # one rank: 60% of the disk fits
        with pytest.raises(zero_engine.ConfigError, match="what this node's ranks offload there needs"):
            check_swap_directories(alone, share, 0, local_ranks=2)  # two ranks of the node: 120%
        with pytest.raises(zero_engine.ConfigError, match="offload_optimizer.nvme_path .* and .*offload_param"):
            check_swap_directories(both, share, share, local_ranks=1)  # both offloads in one directory
    assert readable_size(3 * 2**20) == "3.0 MiB" and readable_size(3 * 2**30) == "3.00 GiB"


def test_nvme_needs_a_path() -> None:
    with pytest.raises(zero_engine.ConfigError, match="device = 'nvme' needs nvme_path"):
        zero_engine.load_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})


# -- a disk that fails on one rank: every rank raises at the same step --------------------------

def a_disk_that_fails(rank: int, world: int, root: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two steps, then rank 1's disk fails: every write from step 2 on (``write``: the first is a
    gradient's, in the backward), every read inside step 2's update (``read``), or every read of
    a parameter shard from step 2 on (``gather``: the first is a forward's), or every read from
    step 2 on in hybrid sharding (``carry``: the window's gradient carried across groups in the
    backward is read back); ``optimizer: Muon``: the update's matrix exchanges, which the failing
    rank still takes part in; the outcome on each rank."""
    import errno

    found = []
    for case in cases:
        settings = config(case["stage"], "nvme", root, accum=case["accum"], shard_group_size=case.get("groups", 0),
                          optimizer=case.get("optimizer", "AdamW"))
        if case["fails"] == "gather":  # the parameter shards on NVMe, the optimizer side on the host
            settings = param_config(config(3, "cpu", root, accum=case["accum"]), "nvme", "cpu", root)
        settings["comm"] = {"timeout_s": 60}
        engine = zero_engine.initialize(make_gpt(), settings)
        train(engine, rank, world, range(2), case["accum"])
        pwrite, preadv, update = os.pwrite, os.preadv, engine.optimizer_step._update

        def full(*args: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def failing(*args: Any) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def update_reading_nothing(*args: Any) -> None:
            os.preadv = failing
            update(*args)

        if rank == 1 and case["fails"] == "write":
            os.pwrite = full
        if rank == 1 and case["fails"] in ("gather", "carry"):
            os.preadv = failing
        if rank == 1 and case["fails"] == "read":
            engine.optimizer_step._update = update_reading_nothing
        start = time.monotonic()
        try:
            train(engine, rank, world, range(2, 4), case["accum"])
            outcome = {"error": "", "message": ""}
        except Exception as err:  # noqa: BLE001 (what each rank raised)
            outcome = {"error": type(err).__name__, "message": str(err)}
        outcome["seconds"] = time.monotonic() - start
        os.pwrite, os.preadv = pwrite, preadv
        engine.close()
        found.append(outcome)
    return found


FAILING = [
    {"stage": 2, "accum": 2, "fails": "write", "when": "at step 2, before its update: nothing of it was applied",
     "error": "No space left on device"},
    {"stage": 1, "accum": 1, "fails": "read", "when": "at step 2, in its update", "error": "Input/output error"},
    {"stage": 3, "accum": 2, "fails": "gather", "when": "a swap file's read or write failed on rank 1 (a read for a gather",
     "error": "Input/output error"},
    {"stage": 2, "accum": 3, "groups": 1, "fails": "carry", "when": "at step 2, before its update",
     "error": "Input/output error"},
    {"stage": 1, "accum": 1, "optimizer": "Muon", "fails": "read", "when": "at step 2, in its update",
     "error": "Input/output error"},
]


def test_a_disk_failing_on_one_rank_raises_on_every_rank_at_that_step() -> None:
    """Not one rank raising while the others wait in a collective until the timeout (60 s here)."""
    with tempfile.TemporaryDirectory(dir=DISK) as root:
        per_rank = run_on_ranks(2, a_disk_that_fails, root, FAILING, timeout=300)
        assert os.listdir(root) == []  # close() removed every rank's files, failed or not
    for case, outcomes in zip(FAILING, zip(*per_rank)):
        for rank, outcome in enumerate(outcomes):
            assert outcome["error"] == "SwapError" and outcome["seconds"] < 20, (case, rank, outcome)
            assert case["when"] in outcome["message"], (case, rank, outcome)
            assert (case["error"] if rank == 1 else "went through") in outcome["message"], (case, rank, outcome)
            if case["fails"] != "gather":
                assert "failed on 1 of 2 ranks" in outcome["message"], (case, rank, outcome)


# -- checkpoints: the same as CPU offload's, and either resumes into the other ---------------------

def layout_config(layout: str, device: str, root: str) -> dict[str, Any]:
    """``optimizer``: stage 2, the optimizer side on ``device``; ``params``: stage 3, bf16, the
    parameter shards and the optimizer side on ``device``."""
    if layout == "optimizer":
        return config(2, device, root)
    return param_config(config(3, "cpu", root, dtype="bf16"), device, device, root)


def save_and_cross_resume(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    saved = {}
    for device in ("cpu", "nvme"):
        engine = zero_engine.initialize(make_gpt(), layout_config(layout, device, root))
        train(engine, rank, world, range(3), 2)
        engine.save_checkpoint(os.path.join(root, device), tag="t")
        train(engine, rank, world, range(3, 5), 2)
        saved[device] = engine.full_state_dict()
        engine.close()
    resumed = {}
    for device, source in (("nvme", "cpu"), ("cpu", "nvme")):
        engine = zero_engine.initialize(make_gpt(), layout_config(layout, device, root))
        engine.load_checkpoint(os.path.join(root, source), tag="t")
        train(engine, rank, world, range(3, 5), 2)
        resumed[device] = engine.full_state_dict()
        engine.close()
    return {"saved": saved, "resumed": resumed}


@pytest.mark.parametrize("layout", ["optimizer", "params"])
def test_checkpoints_match_cpu_offload_and_resume_across(layout: str) -> None:
    """Saved from NVMe offload, the same checkpoint as CPU offload's; either resumes into the
    other: the optimizer side on NVMe at stage 2, and at stage 3 the parameter shards too (a
    resume into NVMe writes every shard's file anew)."""
    from zero_engine.state.payload import PieceIndex
    from zero_engine.state.storage import open_checkpoint

    with tempfile.TemporaryDirectory(dir=DISK) as root:
        result = run_on_ranks(2, save_and_cross_resume, root, layout)[0]
        indexes = {device: PieceIndex.read(open_checkpoint(os.path.join(root, device), "t")) for device in ("cpu", "nvme")}
        for name, param in make_gpt().named_parameters():
            for key in (None, "exp_avg", "exp_avg_sq"):
                values = [indexes[d].assemble(name, 0, param.numel(), key) for d in ("cpu", "nvme")]
                assert torch.equal(values[0], values[1]), (name, key)
    for name, value in result["saved"]["cpu"].items():
        assert torch.equal(value, result["saved"]["nvme"][name]), name
        assert torch.equal(value, result["resumed"]["nvme"][name]), f"{name}: CPU checkpoint resumed into NVMe"
        assert torch.equal(value, result["resumed"]["cpu"][name]), f"{name}: NVMe checkpoint resumed into CPU"


# -- a rank killed mid-step: the last checkpoint resumes, and the dead run's swap files go --------

def killed_after_saving(rank: int, world: int, root: str, layout: str) -> None:
    """Save at step 3, then rank 1 is killed (SIGKILL) inside the next step's write."""
    import signal

    from zero_engine.sharding.tiers.swap import SwapFile

    engine = zero_engine.initialize(make_gpt(), layout_config(layout, "nvme", root))
    train(engine, rank, world, range(3), 2)
    engine.save_checkpoint(os.path.join(root, "checkpoints"), tag="saved")
    if rank == 1:
        SwapFile.write = lambda self, regions: os.kill(os.getpid(), signal.SIGKILL)
    train(engine, rank, world, range(3, 5), 2)


def resumed_after_the_kill(rank: int, world: int, root: str, layout: str) -> dict[str, Any]:
    """Resume into NVMe offload; then the run that was not killed (CPU offload, bit for bit the same)."""
    engine = zero_engine.initialize(make_gpt(), layout_config(layout, "nvme", root))
    swap_files = sorted(name for name in os.listdir(root) if name.endswith(".swap"))
    engine.load_checkpoint(os.path.join(root, "checkpoints"), tag="saved")
    train(engine, rank, world, range(3, 5), 2)
    state = engine.full_state_dict()
    engine.close()
    engine = zero_engine.initialize(make_gpt(), layout_config(layout, "cpu", root))
    train(engine, rank, world, range(5), 2)
    uninterrupted = engine.full_state_dict()
    engine.close()
    return {"state": state, "swap_files": swap_files, "uninterrupted": uninterrupted}


@pytest.mark.parametrize("layout", ["optimizer", pytest.param("params", marks=pytest.mark.slow)])
def test_a_rank_killed_mid_step_resumes_from_the_last_checkpoint(layout: str) -> None:
    """The optimizer side on NVMe at stage 2; in the slow run, at stage 3 the parameter shards too
    (the kill then lands in a shard's or a master's write, whichever comes first)."""
    from harness import RankFailure

    with tempfile.TemporaryDirectory(dir=DISK) as root:
        with pytest.raises(RankFailure):  # rank 1 killed; rank 0 fails in its next collective
            run_on_ranks(2, killed_after_saving, root, layout, timeout=60)
        left = [name for name in os.listdir(root) if name.endswith(".swap")]
        assert len(left) >= 1  # a killed process cannot remove its file
        resumed = run_on_ranks(2, resumed_after_the_kill, root, layout)
        expected = resumed[0]["uninterrupted"]
        for result in resumed:  # the dead run's files removed at initialize, this run's own made
            assert result["swap_files"] and not set(left) & set(result["swap_files"])
        assert [name for name in os.listdir(root) if name.endswith(".swap")] == []
    for name, value in expected.items():
        assert torch.equal(resumed[0]["state"][name], value), name


# -- parameter shards on NVMe (offload_param.device: nvme), frozen ones included -------------------

def lora_case(int8: bool) -> tuple[Any, dict[str, Any], Any]:
    """A PEFT LoRA Llama whose bf16 base is frozen (kept in int8 with ``int8``), its config and
    its training step."""
    import peft_cases

    zero = {"zero_quantized_nontrainable_weights": True} if int8 else {}
    model = peft_cases.lora_llama(torch.bfloat16)
    config = peft_cases.config(3, "bf16", **zero)

    def train_lora(engine: Any, rank: int, world: int, steps: range) -> list[float]:
        losses = []
        for step in steps:
            ids = peft_cases.tokens(step, rank, world)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    return model, config, train_lora


def params_against_cpu(rank: int, world: int, directory: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case trained with parameter shards (and the optimizer side: ``optimizer``) in host
    memory, then on NVMe: the states, the losses, the swap file's traffic in the last step
    against the shards' bytes, the page cache it leaves, the live storages it saves, and how
    many gathers found their shard read ahead."""
    from zero_engine.sharding.tiers.nvme import NvmeShard
    from zero_engine.sharding.tiers.swap import SwapFile
    from zero_engine.testing.process_memory import live_tensor_bytes

    taken = NvmeShard._take
    served: list[bool] = []

    def counting_take(self: NvmeShard) -> torch.Tensor:
        served.append(self.buffer is not None)
        return taken(self)

    NvmeShard._take = counting_take
    fast_write = SwapFile.write
    results = []
    for case in cases:
        if case.get("slow_disk"):
            def slow_write(self: Any, regions: Any) -> None:
                time.sleep(0.02)
                fast_write(self, regions)

            SwapFile.write = slow_write
        runs = {}
        for params in ("cpu", "nvme"):
            if case.get("lora"):
                model, base, step_fn = lora_case(case.get("int8", False))
                run = lambda engine, steps: step_fn(engine, rank, world, steps)  # noqa: E731
            else:
                model, base = make_gpt(), config(3, "cpu", directory, dtype=case.get("dtype", "fp32"))
                run = lambda engine, steps: train(engine, rank, world, steps, 2)  # noqa: E731
            optimizer = case.get("optimizer", "cpu") if params == "nvme" else "cpu"
            settings = param_config(base, params, optimizer, directory)
            settings["zero_optimization"]["offload_param"]["buffer_count"] = case.get("buffer_count", 5)
            engine = zero_engine.initialize(model, settings)
            losses = run(engine, range(STEPS - 1))
            served.clear()
            result: dict[str, Any] = {}
            if params == "nvme":
                for swap in engine.held:
                    swap.drain()
                io_before = _process_io()
                result["file"] = shard_swap_space([*engine.units, *engine.frozen_units]).file.path
                result["regions"] = 4 * sum(  # no local keeps the units alive into the next case's live count
                    1 for unit in [*engine.units, *engine.frozen_units] if unit.shard.nvme_bytes
                )
                result["regions"] += sum(  # the optimizer side's regions, when on NVMe: the master's and its
                    # state's, and the gradient's (moved twice each way: a micro-step's read back to add the next)
                    3 + len(getattr(unit.optimizer_shard.master_kind, "state_regions", [None])) for unit in engine.units
                ) if optimizer == "nvme" else 0
                result["grad_bytes"] = sum(unit.optimizer_shard.grad.nvme_bytes for unit in engine.units)
                result["shard_bytes"] = sum(unit.shard.nvme_bytes for unit in [*engine.units, *engine.frozen_units])
                result["trained"] = sum(unit.shard.nvme_bytes for unit in engine.units)
                result["largest"] = max(unit.shard.nvme_bytes for unit in [*engine.units, *engine.frozen_units])
            losses += run(engine, range(STEPS - 1, STEPS))
            if params == "nvme":
                for swap in engine.held:
                    swap.drain()
                io_after = _process_io()
                result.update(
                    disk={key: io_after[key] - io_before[key] for key in io_before},
                    report=engine.comm_report()["nvme"], memory=engine.memory_report(), served=list(served),
                    kept=sum(swap.shard_buffers.nbytes for swap in engine.held),  # read buffers kept for reuse
                    cached=cached_pages(result["file"]),
                )
            others = sum(t.untyped_storage().nbytes() for run in runs.values() for t in run["state"].values())
            result.update(live=live_tensor_bytes() - others, host=engine.memory_report()["host"])
            result.update(losses=losses, state=engine.full_state_dict())
            engine.close()
            result["left"] = result["file"].exists() if "file" in result else False
            runs[params] = result
        cpu, nvme = runs["cpu"], runs.pop("nvme")
        nvme["equal"] = nvme["losses"] == cpu["losses"] and all(
            torch.equal(cpu["state"][key], nvme["state"][key]) for key in cpu["state"]
        )
        nvme["live_saved"] = cpu["live"] - nvme["live"]
        nvme["host_saved"] = cpu["host"] - nvme["memory"]["host"]
        nvme["file"] = nvme["file"].name
        del nvme["state"], nvme["losses"]
        results.append(nvme)
        SwapFile.write = fast_write
    NvmeShard._take = taken
    return results


PARAM_FAST = [
    {"dtype": "fp32", "slow_disk": True, "buffer_count": 2},  # each write late: a read must wait for it
    {"dtype": "bf16", "optimizer": "nvme"},
    {"lora": True, "int8": True},  # its base's exact vectors and int8 matrices (EncodedShard over NvmeShard)
]
PARAM_SLOW = [{"dtype": dtype, "optimizer": optimizer} for dtype in ("fp32", "bf16") for optimizer in ("cpu", "nvme")]
PARAM_SLOW.append({"lora": True})


@pytest.mark.parametrize("world, grid", [(2, PARAM_FAST), pytest.param(3, PARAM_SLOW, marks=pytest.mark.slow)])
def test_parameter_shards_on_nvme_bit_for_bit_read_ahead_and_out_of_memory(world: int, grid: list) -> None:
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        per_rank = run_on_ranks(world, params_against_cpu, directory, grid, allow_numpy=True)  # transformers needs it
        assert os.listdir(directory) == []  # every file removed on close
    for index, case in enumerate(grid):
        results = [r[index] for r in per_rank]
        assert all(r["equal"] for r in results), f"{case}: parameter shards on NVMe train differently than on the host"
        assert len({r["file"] for r in results}) == world and not any(r["left"] for r in results)
        for r in results:
            shards = r["shard_bytes"]
            optimizer = r["memory"]["nvme"] - shards  # the optimizer side's bytes, when it is on NVMe too
            assert (optimizer == 0) == (case.get("optimizer", "cpu") == "cpu"), (case, r["memory"])
            optimizer += r["grad_bytes"]  # its gradient moves once more each way: 2 micro-steps add into it
            # each gather (forward and backward of each of 2 micro-batches) reads every shard once; the
            # step writes the trained ones once (frozen ones never): the optimizer side's own bytes besides
            trained = r["trained"]  # the trainable units' shards (frozen ones are never written)
            assert r["report"]["written"] - optimizer == trained, (case, r["report"], shards)
            # at most one read a gather (forward and backward of each micro-batch: 2 of the GPT's, 1 of the
            # LoRA model's): the root's units are kept from forward to backward, and what the step
            # publishes into a shard read ahead for the next forward is what that gather takes, unread
            gathers = 2 if case.get("lora") else 4
            assert 0 < r["report"]["read"] - optimizer <= gathers * shards, (case, r["report"], shards)
            # what the process asked of the disk (/proc/self/io): what the report says, in whole pages (a
            # page more at most for each region moved: up to 4 reads of a shard, each optimizer state once)
            for key, moved in (("read_bytes", r["report"]["read"]), ("write_bytes", r["report"]["written"])):
                assert moved <= r["disk"][key] <= moved + 4096 * r["regions"], (case, key, r["disk"], moved)
            assert r["cached"] == 0, f"{case}: the page cache holds {r['cached']} pages of the shards' file"
            # between steps no shard is in memory but those read ahead for the next forward (at most
            # buffer_count, 5 unless the case says): here the whole tiny model is one window
            read_ahead = case.get("buffer_count", 5) * r["largest"]
            assert r["memory"]["parameters"] <= min(shards, read_ahead), (case, r["memory"], r["largest"])
            # as the process holds it (live storages): what moved out of host memory, as the reports say:
            # the shards less those read ahead; in fp32 with the optimizer side on the host less a master
            # too (CPU offload keeps one tensor as shard and master), so there NVMe saves no memory; with
            # the optimizer side on NVMe too, its masters and state besides
            assert r["live_saved"] == r["host_saved"], (case, r["live_saved"], r["host_saved"])
            held = r["memory"]["parameters"] + r["kept"]  # read ahead, and read buffers kept for the next reads
            # the pool of read buffers: buffer_count and one of the largest shard's bytes (R3), and
            # with the optimizer side on NVMe as many of the largest step gradient's besides
            kept = (case.get("buffer_count", 5) + 1) * r["largest"]
            kept += kept * 2 if case.get("optimizer") == "nvme" else 0  # an fp32 gradient's bytes: 2 bf16 shards'
            assert r["kept"] <= kept, (case, r["kept"])
            if case.get("optimizer", "cpu") == "cpu":
                shared_master = shards if case.get("dtype") == "fp32" else 0
                assert r["host_saved"] == shards - held - shared_master, (case, r["host_saved"], shards, held)
            else:
                assert r["host_saved"] > shards - held, (case, r["host_saved"], shards, held)
            # the prefetch window reads ahead: all but the first gathers of a pass find their shard in
            assert sum(r["served"]) >= len(r["served"]) / 2, (case, sum(r["served"]), len(r["served"]))


WIDE = 384  # a block of 12 x 384^2 parameters: its state is twice what a unit costs besides (hooks, graph)


class WideBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDE)
        self.attn = torch.nn.Linear(WIDE, 4 * WIDE)
        self.up = torch.nn.Linear(WIDE, 4 * WIDE)
        self.down = torch.nn.Linear(4 * WIDE, WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) + self.attn(x)[..., :WIDE]


def host_high_water(rank: int, world: int, directory: str, blocks: int, device: str) -> dict[str, int]:
    """A model of ``blocks`` wide blocks, built on the meta device, trained 2 steps of 2 micro-steps
    at stage 3 with both offloads on ``device``: the process's resident high-water above its
    resident set before `initialize`, and the largest shard's state (master and Adam, 12 bytes
    an element)."""
    from zero_engine.testing.process_memory import (
        map_large_allocations,
        peak_resident_bytes,
        reset_peak_resident,
        resident_bytes,
    )

    # On a CPU the "device" is host memory too: its gathered units, gradients and buckets are
    # allocated and freed every pass. Allocations of a megabyte and more are mapped and unmapped,
    # so the resident set is what is alive, not what glibc's heap kept of the device's buffers.
    map_large_allocations(1 << 20)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(WideBlock() for _ in range(blocks)))
    settings = config(3, device, directory, accum=2)
    settings["zero_optimization"].update(
        offload_param={"device": device, "nvme_path": directory}, stage3_wrap_modules=["WideBlock"]
    )
    settings["train_micro_batch_size_per_gpu"] = 1
    start = resident_bytes()
    reset_peak_resident()  # the high-water mark starts from here
    engine = zero_engine.initialize(model, settings)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2 * 2):
        engine.backward(engine(torch.randn(1, 4, WIDE, generator=generator)).square().mean())
        engine.step()
    high = peak_resident_bytes()
    largest = max(unit.optimizer_shard.owned_range[1] - unit.optimizer_shard.owned_range[0] for unit in engine.units)
    engine.close()
    return {"high": high - start, "shard_state": 12 * largest}


@pytest.mark.parametrize("contrast", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["nvme", "and-cpu"])
def test_host_memory_stays_flat_as_the_model_grows_4x_to_16x(contrast: bool) -> None:
    """Issue 69's bound, as the process holds memory (resident high-water, the page cache being
    dropped: the tests above): from 4 to 16 blocks (four times the parameters) each rank's host
    high-water grows by less than one shard's state with everything on NVMe. The slow run shows
    the same measure seeing host memory: with CPU offload it grows by 12 such shards at least."""
    devices = ("nvme", "cpu") if contrast else ("nvme",)
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        runs = {
            (device, blocks): run_on_ranks(2, host_high_water, directory, blocks, device)
            for device in devices for blocks in (4, 16)
        }
    for rank in range(2):
        shard = runs["nvme", 4][rank]["shard_state"]
        nvme = runs["nvme", 16][rank]["high"] - runs["nvme", 4][rank]["high"]
        print(f"rank {rank}: 4 -> 16 blocks, the high-water +{nvme / 2**20:.2f} MiB on NVMe; a shard's state "
              f"{shard / 2**20:.2f} MiB")
        assert nvme < shard, (rank, nvme, shard)
        if contrast:
            cpu = runs["cpu", 16][rank]["high"] - runs["cpu", 4][rank]["high"]
            assert cpu > 12 * shard, (rank, cpu, shard)  # the same measure sees what host memory holds


def test_estimate_counts_parameter_shards_on_nvme_and_their_traffic(tmp_path: Path, capsys: Any) -> None:
    """Stage 3, bf16, AdamW, 1e9 trainable and 1e8 frozen parameters over 4 ranks, everything on
    NVMe: the swap files hold the masters, Adam state and fp32 step gradient (16 bytes / 4) and the
    bf16 shards, frozen too (2 bytes / 4); a micro-batch reads the shards twice (forward,
    backward), a step writes the optimizer side and the trainable shards (never the frozen ones),
    and each further micro-step's reduction moves the gradient once more each way; nothing of the
    model's size is left on the host."""
    from zero_engine.cli import main as cli_main

    config = tmp_path / "c.yaml"
    config.write_text(
        "bf16: {enabled: true}\nzero_optimization: {stage: 3, offload_optimizer: {device: nvme, nvme_path: /d}, "
        "offload_param: {device: nvme, nvme_path: /d}}\n"
    )
    assert cli_main(["estimate", str(config), "--params", "1e9", "--frozen-params", "1e8", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    gib = 2**30
    optimizer, shards, frozen = 16e9 / 4, 2 * 1.1e9 / 4, 2 * 1e8 / 4
    assert f"masters, optimizer state and step gradient {optimizer / gib:.3f} GiB, parameter shards " \
        f"{shards / gib:.3f} GiB" in out
    assert f"a step reads {optimizer / gib:.3f} GiB + {2 * shards / gib:.3f} GiB a micro-batch" in out
    assert f"writes {(optimizer + shards - frozen) / gib:.3f} GiB" in out
    assert float(out.split("on NVMe")[1].split()[0]) == pytest.approx((optimizer + shards) / gib, abs=1e-3)
    assert f"reads and writes the gradient once more, {4e9 / 4 / gib:.3f} GiB" in out
    assert "on the host" not in out  # no line for host memory: nothing of the model's size is there


def test_a_cleared_step_gradient_waits_for_its_read_ahead_before_its_buffer_serves_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reliability review N17: a step skipped while a gradient's read ahead is still in flight
    (a slow disk) must not give the read's buffer to the next shard before the read landed: the
    late read would overwrite the next shard's values."""
    import time

    from zero_engine.sharding.tiers.nvme_gradient import NvmeGrad
    from zero_engine.sharding.tiers.swap import SwapFile, SwapSpace

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        space = SwapSpace(directory, 0, buffer_count=2)
        grad = NvmeGrad(1024, torch.device("cpu"), space)
        grad.add(torch.ones(1024), 1.0)
        space.drain()
        read = SwapFile.read

        def slow_read(self: SwapFile, region: Any, buffer: torch.Tensor) -> None:
            time.sleep(0.5)
            read(self, region, buffer)

        monkeypatch.setattr(SwapFile, "read", slow_read)
        grad.prefetch()  # the read ahead of a step, slow
        grad.clear()  # the step skipped
        taken, copied = space.shard_buffers.take(1024, torch.float32)  # the next shard's read buffer
        copied()
        taken.fill_(7.0)
        space.drain()
        assert torch.equal(taken, torch.full((1024,), 7.0)), taken.sum()
        space.close()


def test_a_script_that_never_closes_its_engine_leaves_no_swap_file(tmp_path: Path) -> None:
    """Reliability review item 8: the README's loop with NVMe offload, which never calls
    engine.close(), left its swap file (the size of its optimizer state) in nvme_path; it is
    removed when the interpreter exits."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        script = tmp_path / "loop.py"
        script.write_text(
            "import torch, zero_engine, pathlib\n"
            "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))\n"
            "config = {'train_micro_batch_size_per_gpu': 8, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
            "          'zero_optimization': {'stage': 2, 'offload_optimizer': {'device': 'nvme',\n"
            f"                                'nvme_path': {directory!r}}}}}}}\n"
            "engine = zero_engine.initialize(model, config)\n"
            "for step in range(3):\n"
            "    engine.backward(engine(torch.randn(8, 16)).pow(2).mean())\n"
            "    engine.step()\n"
            f"print(len(list(pathlib.Path({directory!r}).iterdir())), 'swap file(s) while running')\n"
        )
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "1 swap file(s) while running" in done.stdout
        assert list(Path(directory).iterdir()) == []


def test_the_swap_threads_start_on_the_ranks_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU review R4: the read and write threads make their first CUDA call (a copy's event) on
    the rank's device, not on GPU 0 (a context there for every rank): each thread sets it first."""
    from zero_engine.sharding.tiers import swap

    made: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(swap, "_set_cuda_device",
                        lambda device: made.append((threading.current_thread().name, device)))
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        space = swap.SwapSpace(directory, 0, 2, torch.device("cuda", 3))
        space.drain()  # a task on each thread: the threads exist, their initializer ran
        space.close()
        cpu = swap.SwapSpace(directory, 0, 2, torch.device("cpu"))
        cpu.drain()
        cpu.close()
    assert [device for _, device in made] == [torch.device("cuda", 3)] * 2  # the CPU space's set nothing
    assert {name.rsplit("_", 1)[0] for name, _ in made} == {"zero_engine-nvme-read", "zero_engine-nvme-write"}
