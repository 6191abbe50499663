"""Defects only CUDA/NCCL would show, caught on the CPU: which GPU a rank takes, NCCL's
record-streams setting, when the hybrid second phase starts on NCCL, host tensors under
``torch.set_default_device``, a buffer left on another device, and meta-device values that
differ between ranks (as random numbers do between GPU models)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

import zero_engine
from configs import engine_config
from harness import run_on_ranks
from models import TrapModel, make_model, micro_batch
from zero_engine import devices
from zero_engine.comm import connecting as comm_connect, groups as comm_groups, handles as comm_handles
from zero_engine.comm import Comm, GroupComm, Pending, TwoPhase
from zero_engine.comm.handles import SecondPhaseThread
from zero_engine.testing.device_guard import DeviceGuard


@pytest.mark.parametrize("visible, local_rank, expected", [(8, 3, 3), (1, 3, 0), (2, 3, 1), (0, 3, 3)])
def test_a_rank_takes_its_gpu_among_those_it_sees(
    monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: int, expected: int
) -> None:
    """``cuda:LOCAL_RANK`` is an invalid ordinal where each process sees only its own GPU."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert devices.local_cuda_device() == torch.device("cuda", expected)


@pytest.mark.parametrize("version, preset, expected", [((2, 7), None, "1"), ((2, 7), "0", "0"), ((2, 8), None, None)])
def test_nccl_record_streams_are_avoided_before_torch_2_8(
    monkeypatch: pytest.MonkeyPatch, version: tuple[int, int], preset: str | None, expected: str | None
) -> None:
    monkeypatch.setattr(comm_connect, "_torch_version", lambda: version)
    # A copy of the environment for the call: a variable it sets where none was is not undone by
    # monkeypatch, and left set it sent every later rank of the suite to a fresh interpreter
    monkeypatch.setattr(os, "environ", os.environ.copy())
    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_AVOID_RECORD_STREAMS", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", preset)
    comm_connect.avoid_nccl_record_streams()
    assert os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS") == expected


class _NotDone:
    """An async work that is never complete when polled (NCCL: the host runs ahead of the GPU);
    says where its ``wait`` was called (the stream it would order)."""

    def __init__(self, where: list[str], stream: list[str]) -> None:
        self.where, self.stream = where, stream

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self.where.append(self.stream[-1])


def test_on_nccl_the_second_phase_starts_at_once_on_the_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On NCCL the hybrid second phase launches at once, and its wait for the first phase
    orders the side stream, never the compute stream (GPU review N1: a compute-stream wait
    serialized backward and, at stage 3, closed a cycle with the gathers; the multi-rank check
    is tests/test_nccl_model.py)."""
    stream = ["compute"]

    @contextlib.contextmanager
    def side(device: torch.device | None = None) -> Iterator[None]:
        stream.append("side")
        yield
        stream.pop()

    monkeypatch.setattr(comm_handles, "second_phase_stream", side)
    waits: list[str] = []
    started: list[str] = []
    nccl = Comm.of_groups(*(GroupComm(0, 1, "nccl") for _ in range(3)))
    gloo = Comm.of_groups(*(GroupComm(0, 1, "gloo") for _ in range(3)))
    assert nccl.orders_on_device and not gloo.orders_on_device
    assert isinstance(gloo.second_phases, SecondPhaseThread)  # gloo: tests/test_hybrid.py
    second = _NotDone(waits, stream)
    at_once = TwoPhase(Pending((_NotDone(waits, stream),)), lambda: started.append(stream[-1]) or Pending((second,)),
                       nccl.second_phases)
    assert started == ["side"] and waits == ["side"]  # NCCL: launched now, the first phase waited on the side
    at_once.wait()
    assert waits == ["side", "compute"]  # the compute stream waits for the second phase's collective only


def test_the_side_stream_is_the_tensors_devices_not_the_threads_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU review Q7: a training step run on a worker thread whose current device is GPU 0, the
    tensors on GPU 3: the second phase's side stream is GPU 3's, and it waits for GPU 3's
    current stream, under GPU 3 made current for the block (torch.cuda mocked: no GPU here)."""
    seen: list[tuple[str, object]] = []
    current_device = [0]

    class FakeStream:
        def __init__(self, device: object = None) -> None:
            index = current_device[0] if device is None else device if isinstance(device, int) else device.index
            self.device = torch.device("cuda", index)
            seen.append(("made", index))

        def wait_stream(self, other: FakeStream) -> None:
            seen.append(("waits for", other.device.index))

    @contextlib.contextmanager
    def on_device(device: torch.device) -> Iterator[None]:
        previous, current_device[0] = current_device[0], device.index
        try:
            yield
        finally:
            current_device[0] = previous

    @contextlib.contextmanager
    def on_stream(stream: FakeStream) -> Iterator[None]:
        seen.append(("runs on", stream.device.index))
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(comm_handles, "_SIDE_STREAMS", {})
    with comm_handles.second_phase_stream(torch.device("cuda", 3)):
        seen.append(("inside, current device", current_device[0]))
    assert seen == [("made", 3), ("made", 3), ("waits for", 3), ("runs on", 3), ("inside, current device", 3)]
    with comm_handles.second_phase_stream(torch.device("cpu")):  # nothing to order off CUDA
        seen.append(("cpu",))
    assert seen[-1] == ("cpu",) and len(seen) == 6


def test_agreements_stay_on_the_host_under_a_default_device() -> None:
    with torch.device("meta"):
        agreement = GroupComm(0, 1, "none").each_rank(3)
    assert agreement.slots.device == torch.device("cpu") and agreement.values() == [3]


def test_a_buffer_on_another_device_is_named_at_initialize() -> None:
    with DeviceGuard() as guard:
        model = make_model()
        guard.adopt(model)  # the model as if on the GPU
        model.register_buffer("host_cache", torch.zeros(3))  # left on the host
        with pytest.raises(ValueError, match=r"'host_cache' on cpu\b"):
            zero_engine.initialize(model, engine_config(0, micro=2, lr=0.1))


def rank_dependent_init(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """A model on the meta device whose every rank draws different values (as GPUs of different
    models do), trained one step at each stage."""

    def init(module: torch.nn.Module) -> None:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.normal_().add_(rank)

    out = []
    for case in cases:
        with torch.device("meta"):
            model = TrapModel()
        config = engine_config(
            case["stage"], micro=2, lr=0.1, dtype=case["dtype"], shard_group_size=case.get("group"),
            reduce_bucket_size=40, stage3_param_persistence_threshold=0 if case.get("group") else None,
        )
        engine = zero_engine.initialize(model, config, param_init_fn=init)
        initial = engine.full_state_dict()
        engine.backward(engine(*micro_batch(0, 0, rank, world_size, 2, 1)))
        engine.step()
        out.append({"initial": initial, "trained": engine.full_state_dict()})
        engine.close()
    return out


INIT_CASES = [
    {"stage": 0, "dtype": "fp32"}, {"stage": 1, "dtype": "fp32"}, {"stage": 2, "dtype": "fp32"},
    {"stage": 1, "dtype": "bf16"}, {"stage": 3, "dtype": "fp32"},
]
HYBRID_INIT_CASES = [{"stage": 3, "dtype": "bf16", "group": 2}]


@pytest.mark.parametrize(  # the fast run: 2 ranks; hybrid groups' start in the slow run (and in test_hybrid's runs)
    "world_size, cases", [(2, INIT_CASES), pytest.param(4, HYBRID_INIT_CASES, marks=pytest.mark.slow)]
)
def test_ranks_that_draw_different_values_start_and_stay_equal(world_size: int, cases: list[dict]) -> None:
    """What every rank keeps whole (the model below stage 3; buffers, frozen and small
    parameters at stage 3) takes rank 0's meta-device values, and a shard its copy's in the
    first shard group (hybrid replicas): the ranks agree on one model."""
    per_rank = run_on_ranks(world_size, rank_dependent_init, cases)
    for index, case in enumerate(cases):
        first = per_rank[0][index]
        for other in per_rank[1:]:
            for key in ("initial", "trained"):
                for name, value in first[key].items():
                    assert torch.equal(other[index][key][name], value), (case, key, name)


def forced_collectives(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """One rank with a process group of its own (as torchrun --nproc_per_node=1): each case
    trained with and without ``comm.force_collectives``, counting the torch.distributed calls."""
    import torch.distributed as dist

    calls: list[str] = []
    names = ("all_reduce", "reduce", "broadcast", "batch_isend_irecv")
    for name in names:
        function = getattr(dist, name)
        setattr(dist, name, lambda *a, function=function, name=name, **k: calls.append(name) or function(*a, **k))
    for name in ("_reduce_scatter_tensor", "_all_gather_into_tensor"):
        function = getattr(comm_groups, name)
        setattr(comm_groups, name, lambda *a, function=function, name=name, **k: calls.append(name) or function(*a, **k))
    out = []
    for case in cases:
        per_setting = {}
        for force in (False, True):
            config = engine_config(case["stage"], micro=2, lr=0.1, dtype=case["dtype"], primitives="native",
                                   stage3_param_persistence_threshold=0, reduce_bucket_size=40)
            config["comm"]["force_collectives"] = force
            calls.clear()
            engine = zero_engine.initialize(make_model(), config)
            for step in range(2):
                engine.backward(engine(*micro_batch(step, 0, rank, world_size, 2, 1)))
                engine.step()
            per_setting[force] = {"state": engine.full_state_dict(rank0_only=True), "calls": sorted(set(calls))}
            engine.close()
        out.append(per_setting)
    assert dist.get_world_size() == 1
    return out


FORCED_CASES = [{"stage": 1, "dtype": "fp32"}, {"stage": 3, "dtype": "bf16"}]


def test_one_rank_can_issue_every_collective_for_a_gpu_check() -> None:
    """``comm.force_collectives``: a single GPU runs the real NCCL path (native reduce-scatter
    and all-gather, the all-reduce of the norm), and the training is the same as without. The
    rank-0 export gather is point to point: on one rank it has no peer, so nothing is issued."""
    for case, result in zip(FORCED_CASES, run_on_ranks(1, forced_collectives, FORCED_CASES, backend=None)[0]):
        assert result[False]["calls"] == [], case  # world size 1 skips them by default
        expected = {"_reduce_scatter_tensor", "_all_gather_into_tensor", "all_reduce"}
        assert "batch_isend_irecv" not in result[True]["calls"], case
        assert expected <= set(result[True]["calls"]), (case, result[True]["calls"])
        for name, value in result[False]["state"].items():
            assert torch.equal(result[True]["state"][name], value), (case, name)


class _Group:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def abort(self) -> None:
        self.log.append(self.name)


def test_on_nccl_a_divergence_aborts_each_data_group_once_and_forgets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU review N10: the engine's data, shard, replica and reduce groups are aborted (each
    once: a group may stand in several roles) and dropped from the cache, so a later engine
    makes new ones; on gloo nothing is aborted."""
    log: list[str] = []
    data, shards, reduces = _Group(log, "data"), _Group(log, "shards"), _Group(log, "reduces")
    monkeypatch.setattr(comm_groups, "_OWN_GROUPS", {(0, 1.0, "data", None): data, (0, 1.0, "other", None): _Group(log, "x")})
    nccl = Comm.of_groups(GroupComm(0, 4, "nccl", data), GroupComm(0, 2, "nccl", shards),
                          GroupComm(0, 2, "nccl", data), GroupComm(0, 2, "nccl", reduces))
    assert nccl.abort_data_groups() == comm_groups.ABORTED
    assert sorted(log) == ["data", "reduces", "shards"]
    assert list(comm_groups._OWN_GROUPS) == [(0, 1.0, "other", None)]
    gloo = Comm.of_groups(GroupComm(0, 4, "gloo", _Group(log, "gloo")),
                          *(GroupComm(0, 2, "gloo") for _ in range(2)))
    assert gloo.abort_data_groups() == "" and "gloo" not in log


def test_a_torch_that_cannot_abort_says_the_job_must_be_killed() -> None:
    """GPU review P7: on torch 2.4-2.5 (no ``ProcessGroup.abort``) the divergence message must
    not claim the communicators were aborted."""
    old = Comm.of_groups(*(GroupComm(0, 2, "nccl", object()) for _ in range(3)))
    note = old.abort_data_groups()
    assert note == comm_groups.NOT_ABORTED and "Kill the job" in note and "were aborted" not in note


@pytest.mark.parametrize(
    "made_with, device, expected",
    [("cuda:nccl,cpu:gloo", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("nccl", "cuda", "nccl"),
     (None, "cuda", "nccl"), ("gloo", "cuda", "gloo")],
)
def test_the_nccl_paths_follow_the_devices_backend_not_the_groups_string(
    monkeypatch: pytest.MonkeyPatch, made_with: str | None, device: str, expected: str
) -> None:
    """GPU review P1: ``init_process_group("cuda:nccl,cpu:gloo")`` reports that string from
    ``dist.get_backend``, and a plain ``init_process_group()`` reports "undefined": compared with
    "nccl", both turned the NCCL paths off (stream-ordered second phases, N6's launches, the
    abort). The group's configuration, as torch records it for each, names NCCL for CUDA."""
    import torch.distributed as dist

    configs = {"cuda:nccl,cpu:gloo": "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl",
               "nccl": "cuda:nccl", None: "cpu:gloo,cuda:nccl", "gloo": "cpu:gloo,cuda:gloo"}
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: configs[made_with])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: made_with or "undefined")
    backend = comm_connect.device_backend(torch.device(device))
    assert backend == expected
    comm = Comm.of_groups(*(GroupComm(0, 2, backend) for _ in range(3)))
    assert comm.orders_on_device is (expected == "nccl")


def test_stage_3_on_nccl_warns_about_a_single_hardware_queue(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """GPU review N5's mitigation: the two stage 3 communicators' orders differ between ranks;
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` serializes them, and the user is told at initialize."""
    from zero_engine import entry
    from zero_engine.stage import stage_for

    nccl = Comm.of_groups(*(GroupComm(0, 1, "nccl") for _ in range(3)))
    gloo = Comm.of_groups(*(GroupComm(0, 1, "gloo") for _ in range(3)))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with caplog.at_level("WARNING", logger="zero_engine"):
        entry._warn_if_one_hardware_queue(stage_for(2), nccl)
        entry._warn_if_one_hardware_queue(stage_for(3), gloo)
        assert not caplog.records
        entry._warn_if_one_hardware_queue(stage_for(3), nccl)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 with stage 3 on NCCL may hang" in caplog.text
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    caplog.clear()
    entry._warn_if_one_hardware_queue(stage_for(3), nccl)
    assert not caplog.records


def test_initialize_makes_the_models_gpu_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU review N13: where the caller made the process group without ``set_device``, tensors
    made without a device and every CUDA context would land on GPU 0 from every rank."""
    from zero_engine import entry

    made_current: list[torch.device] = []
    monkeypatch.setattr(entry, "_set_cuda_device", made_current.append)
    entry._make_current(torch.device("cpu"))
    assert made_current == []
    entry._make_current(torch.device("cuda", 3))
    assert made_current == [torch.device("cuda", 3)]
    zero_engine.initialize(make_model(), engine_config(0, micro=2, lr=0.1)).close()  # a CPU model: no CUDA call
    assert made_current == [torch.device("cuda", 3)]


def export_through_host(rank: int, world_size: int, stages: list[int]) -> list[dict | None]:
    """Per stage: rank 0's export gathered point to point as gloo does with device tensors
    (each shard through a host copy), against the same training's all-gathered state."""
    out = []
    for stage in stages:
        engine = zero_engine.initialize(
            make_model(), engine_config(stage, micro=2, lr=0.1, dtype="bf16", stage3_param_persistence_threshold=0)
        )
        for step in range(2):
            engine.backward(engine(*micro_batch(step, 0, rank, world_size, 2, 1)))
            engine.step()
        everywhere = engine.full_state_dict()
        real, sent = comm_groups.p2p_through_host, []
        comm_groups.p2p_through_host = lambda backend, tensor: sent.append(tensor.device.type) or True
        try:
            rank0 = engine.full_state_dict(rank0_only=True)
        finally:
            comm_groups.p2p_through_host = real
        engine.close()
        out.append({"equal": all(torch.equal(rank0[k], v) for k, v in everywhere.items()), "staged": bool(sent)}
                   if rank == 0 else {"empty": rank0 == {}, "staged": bool(sent)})
    return out


def test_an_export_gather_through_host_copies_is_the_same_state() -> None:
    """On the H200 (torch 2.11), gloo's point-to-point wrote a CUDA tensor's pointer as host
    memory and killed the rank ("writev: Bad address"): ranks sharing one GPU over gloo export
    through host copies. Forced on here at 3 ranks, the gathered state must be exactly the
    all-gathered one."""
    for rank, results in enumerate(run_on_ranks(3, export_through_host, [1, 3])):
        for result in results:
            assert result["staged"] and result.get("equal", result.get("empty")), (rank, result)
