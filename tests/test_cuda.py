"""The CUDA path on a real GPU: NCCL at world size 1, ranks sharing one GPU over gloo (as one
group, and as two groups of two with hybrid sharding), a save/resume, the CUDA allocator
against `memory_report()`, and host syncs counted by torch's sync debug mode. Skipped where
torch sees no GPU (CPU runs are guarded by `tests/test_device_guard.py` instead).
``scripts/gpu_check.sh`` runs this file and the GPU benchmarks in one go on the first machine
with a GPU.

References are the CPU ones of `tests/precision_cases.py` (same policy, same batches); CUDA
kernels sum in other orders than CPU ones, which the tolerances there already cover (they
are set from the spread across world sizes, which reorders sums the same way).
"""

from __future__ import annotations

import gc
import itertools
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

import zero_engine
from configs import engine_config
from disk import DISK
from harness import run_on_ranks
from models import decay_groups, make_model, micro_batch, train_engine
from precision_cases import MICRO, STEPS, precision_config, precision_grid
from precision_cases import check_precision as _check
from tiny import make_gpt
from tower import BATCH, BLOCK_NUMEL, WIDTH, Tower
from zero_engine.devices import local_cuda_device
from zero_engine.memory import HELD_NOW
from zero_engine.testing.process_memory import cuda_max_allocated_bytes, reset_cuda_peak

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here); scripts/gpu_check.sh runs it"
)

MiB = 2**20
CASES = [
    {"stage": stage, "dtype": dtype, "accum": 2, "clip": 1.0}
    for stage, dtype in itertools.product((0, 1, 2, 3), ("fp32", "bf16"))
]


def _engine(case: dict, device: torch.device) -> zero_engine.Engine:
    model = make_model().to(device)
    config = precision_config(case)
    # One GPU: a one-rank NCCL group that still issues every collective (the asynchronous
    # NCCL path with resize_, native reduce-scatter and all-gather, gather for rank-0 export).
    config["comm"] = {"force_collectives": True}
    return zero_engine.initialize(model, config, param_groups=decay_groups(model))


def cuda_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    device = local_cuda_device()
    results = []
    for case in cases:
        engine = _engine(case, device)
        windows, norms = train_engine(engine, rank, world_size, range(STEPS), MICRO, case["accum"], device=device)
        results.append({
            "backend": engine.comm.backend,
            "device": str(engine.device),
            "losses": [sum(window) / len(window) for window in windows],
            "norms": norms,
            "state": {name: value.cpu() for name, value in engine.full_state_dict().items()},
            "rank0_state": engine.full_state_dict(rank0_only=True),
            "skipped": engine.skipped_steps,
        })
        engine.close()
    return results


def _check_grid(world_size: int, per_rank: list[list[dict]], backend: str) -> None:
    for index, case in enumerate(CASES):
        results = [r[index] for r in per_rank]
        assert {(r["backend"], r["device"]) for r in results} == {(backend, "cuda:0")}, case
        _check(case, world_size, results)


def test_one_gpu_on_nccl_matches_the_one_process_reference() -> None:
    """As under ``torchrun --nproc_per_node=1``: the engine makes an NCCL group bound to cuda:0
    and, with ``comm.force_collectives``, runs every collective through it (bf16 and fp32)."""
    per_rank = run_on_ranks(1, cuda_grid, CASES, backend=None, timeout=600)
    _check_grid(1, per_rank, "nccl")
    for result in per_rank[0]:  # the rank-0 export through dist.gather gives the same state
        for name, value in result["state"].items():
            assert torch.equal(result["rank0_state"][name], value), name


def test_ranks_sharing_one_gpu_over_gloo_match_the_reference() -> None:
    """Two ranks, CUDA tensors, one GPU: gloo moves the data (NCCL needs a GPU per rank)."""
    _check_grid(2, run_on_ranks(2, cuda_grid, CASES, timeout=600), "gloo")


HYBRID_CASES = [dict(case, shard_group_size=2) for case in CASES if case["stage"] > 0]


def test_four_ranks_sharing_one_gpu_as_two_groups_of_two() -> None:
    """Hybrid sharding with CUDA tensors: the two-phase reductions (inside the group, then the
    shard across groups) on the device, gloo moving the data."""
    per_rank = run_on_ranks(4, cuda_grid, HYBRID_CASES, timeout=600)
    for index, case in enumerate(HYBRID_CASES):
        results = [r[index] for r in per_rank]
        assert {(r["backend"], r["device"]) for r in results} == {("gloo", "cuda:0")}, case
        _check(case, 4, results)


QUANTIZED = {"zero_quantized_gradients": True, "zero_quantized_weights": True}
SIDE_STREAM_CASES = [
    dict(case, shard_group_size=2) for case in CASES if case["stage"] in (1, 3)
] + [dict(case, shard_group_size=2, zero=QUANTIZED) for case in CASES if case["stage"] == 3]


def side_stream_grid(rank: int, world_size: int, cases: list[dict], synchronize: bool = False) -> list[dict]:
    """`cuda_grid` with the NCCL ordering forced on (GPU review K5): the second phases start at
    once on the side stream, which waits for the compute stream, and the compute stream waits
    for them; buffers made there are marked with ``record_stream``. One GPU cannot run NCCL
    between ranks, so gloo moves the data while the streams are ordered as on NCCL.

    NCCL's ``wait()`` makes the caller's current stream wait for the collective. gloo's makes the
    stream current in its worker thread (the default stream) wait for its copy back, so the side
    stream would read a first phase's shard before it landed (seen on the H200: stage 3 losses
    off by 1e-2); here a wait also orders the current stream behind the default one, as NCCL's
    does. ``synchronize``: each wait ends with ``torch.cuda.synchronize()`` instead (GPU review
    section 3): if that variant passes under load where the other fails, the stand-in lacks an
    ordering that NCCL has; if both fail, the engine decides something differently under load.

    Each case's result carries counters (`_launch_counters`): gathers launched early by a wait
    for a reduction (N6), gathers launched between a backward's end and the step (Q1: must be
    0), and how the rank process started (a torchrun variable left behind by another test moves
    the harness from its fork server to spawn)."""
    import multiprocessing
    import os

    from zero_engine.comm import Comm, Pending

    Comm.orders_on_device = property(lambda self: True)  # this rank process only
    gloo_wait = Pending.wait

    def wait_as_nccl(self: Pending) -> None:
        gloo_wait(self)
        if synchronize:
            torch.cuda.synchronize()
            return
        current = torch.cuda.current_stream()
        if current != torch.cuda.default_stream():
            current.wait_stream(torch.cuda.default_stream())

    Pending.wait = wait_as_nccl
    counters = _launch_counters()
    results = []
    for case in cases:
        counters.update({"early_by_a_wait": 0, "before_the_step": 0})
        results.extend(cuda_grid(rank, world_size, [case]))
        results[-1]["counters"] = dict(counters, start=multiprocessing.get_start_method(allow_none=True),
                                       torchrun_left=os.environ.get("RANK") is not None)
    return results


def _launch_counters() -> dict:
    """Count, in this rank process, gathers a wait for a reduction launched early (N6's launch
    inside `CollectiveSchedule.launched_everywhere`) and gathers launched between the end of a
    backward and the next step (Q1)."""
    from zero_engine.engine import Engine
    from zero_engine.sharding.gathering.agreement import CollectiveSchedule
    from zero_engine.sharding.gathering.gatherer import ParamGatherer

    counters = {"early_by_a_wait": 0, "before_the_step": 0, "_in_wait": False, "_after_backward": False}
    asking, launching = CollectiveSchedule.launched_everywhere, ParamGatherer._launch_gather
    ending, stepping, calling = Engine._end_backward, Engine.step, Engine.__call__

    def launched_everywhere(self: CollectiveSchedule, reduction: int) -> bool | None:
        counters["_in_wait"] = True
        try:
            return asking(self, reduction)
        finally:
            counters["_in_wait"] = False

    def launch_gather(self: ParamGatherer, index: int, wanted: bool) -> None:
        counters["early_by_a_wait"] += counters["_in_wait"]
        counters["before_the_step"] += counters["_after_backward"]
        launching(self, index, wanted)

    def end_backward(self: Engine) -> None:
        ending(self)
        counters["_after_backward"] = True

    def step(self: Engine) -> None:
        counters["_after_backward"] = False
        stepping(self)

    def call(self: Engine, *args: object, **kwargs: object) -> object:
        counters["_after_backward"] = False
        return calling(self, *args, **kwargs)

    CollectiveSchedule.launched_everywhere, ParamGatherer._launch_gather = launched_everywhere, launch_gather
    Engine._end_backward, Engine.step, Engine.__call__ = end_backward, step, call
    return counters


@pytest.mark.parametrize("synchronize", [False, True], ids=["as-nccl", "synchronized"])
def test_the_hybrid_second_phase_on_a_side_stream_matches_the_reference(synchronize: bool) -> None:
    per_rank = run_on_ranks(4, side_stream_grid, SIDE_STREAM_CASES, synchronize, timeout=600)
    for index, case in enumerate(SIDE_STREAM_CASES):  # printed first: the log says where it went wrong
        results = [r[index] for r in per_rank]
        print(f"{case}: losses per rank {[r['losses'] for r in results]}; "
              f"counters {[{k: v for k, v in r['counters'].items() if not k.startswith('_')} for r in results]}")
    # ZeRO++'s int8 rounding moves a quantized run off the unquantized reference (by 0.2% in the
    # first losses here, the CPU's own figure): its reference is the same quantized run on the CPU
    # (the quantizers on the GPU are the CPU's bit for bit). Checked against the unquantized one
    # with fp32's tolerance, this test failed on the H100 with or without a synchronize after every
    # wait, and on the H200 (its window losses 0.17% off, as here): the side-stream "failure" of
    # the first GPU run, whose printed case was cut before its "zero".
    quantized = [case for case in SIDE_STREAM_CASES if "zero" in case]
    on_cpu = run_on_ranks(4, precision_grid, quantized)
    for index, case in enumerate(SIDE_STREAM_CASES):
        results = [r[index] for r in per_rank]
        assert all(r["counters"]["before_the_step"] == 0 for r in results), case  # Q1
        if case in quantized:
            _check_against_the_cpu(case, results, [r[quantized.index(case)] for r in on_cpu])
        else:
            _check(case, 4, results)


def _check_against_the_cpu(case: dict, on_gpu: list[dict], on_cpu: list[dict]) -> None:
    """Each rank's losses, and the weights, as the CPU's run of the case: near, not bit for bit
    (CUDA's kernels sum in other orders, which can flip a block's int8 rounding, whose effect on
    one weight Adam turns into up to a step of lr)."""
    for rank, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu)):
        loss_tolerance = 1e-5 if case["dtype"] == "fp32" else 2e-2
        assert gpu["losses"] == pytest.approx(cpu["losses"], rel=loss_tolerance), (case, rank)
        distance = sum(((gpu["state"][name].cpu() - value) ** 2).sum() for name, value in cpu["state"].items())
        norm = sum((value**2).sum() for value in cpu["state"].values())
        relative = (distance / norm).sqrt().item()
        print(f"{case}, rank {rank}: weights' distance from the CPU's run, relative to their norm: {relative:.1e}")
        assert relative <= (1e-3 if case["dtype"] == "fp32" else 1e-2), (case, rank, relative)


def backend_as_made(rank: int, world_size: int, made_with: str | None) -> tuple[str, bool]:
    """The engine's backend and NCCL ordering under a default group made as user scripts make it."""
    import torch.distributed as dist

    device = local_cuda_device()
    torch.cuda.set_device(device)
    dist.init_process_group(made_with)
    engine = _engine({"stage": 3, "dtype": "bf16", "accum": 1, "clip": 1.0}, device)
    train_engine(engine, rank, world_size, range(1), MICRO, 1, device=device)
    made = (engine.comm.backend, engine.comm.orders_on_device)
    engine.close()
    return made


def test_a_default_group_made_with_a_compound_backend_takes_the_nccl_paths() -> None:
    """GPU review P1: ``init_process_group("cuda:nccl,cpu:gloo")`` (torchtitan's) and a plain
    ``init_process_group()`` report another string than "nccl"; the engine's data still runs on
    NCCL, and so must its stream ordering, N6's launches and the abort."""
    for made_with in ("cuda:nccl,cpu:gloo", None, "nccl"):
        assert run_on_ranks(1, backend_as_made, made_with, backend=None, timeout=300)[0] == ("nccl", True), made_with


def test_the_block_quantizer_on_the_gpu_is_the_cpus_bit_for_bit() -> None:
    """GPU review K5: the int8 and int4 codecs' kernels on CUDA (odd lengths, a tail shorter than
    a block, bf16 input, an all-zero block) encode the same scales and, decoded, the same values;
    an integer may differ only where the exact quotient is a tie (n + 0.5, which bf16 inputs
    make common), since a division one ulp off rounds a tie the other way."""
    from zero_engine.quantize import BlockQuantizer

    generator = torch.Generator().manual_seed(0)
    report = []
    for bits, numel, dtype in itertools.product((8, 4), (1, 7, 2047, 2048, 4099), (torch.float32, torch.bfloat16)):
        quantizer = BlockQuantizer(bits)
        values = (torch.randn(numel, generator=generator) * 3).to(dtype)
        values[: min(numel, 5)] = 0
        encoded = {}
        run = numel + 3  # a shard shorter than the run: the missing tail counts as zeros
        for device in ("cpu", "cuda"):
            out = torch.empty(quantizer.encoded_bytes(run), dtype=torch.uint8, device=device)
            quantizer.encode(values.to(device), out, numel=run)
            encoded[device] = out.cpu()
        blocks, _, padded = quantizer._sizes(run)
        scales = encoded["cpu"][padded:].view(torch.float32)
        same_scales = torch.equal(encoded["cpu"][padded:], encoded["cuda"][padded:])
        integers = {device: quantizer.decode(encoded[device], run) / scales.repeat_interleave(quantizer.block)[:run]
                    for device in ("cpu", "cuda")}
        differ = (integers["cpu"] != integers["cuda"]).nonzero().view(-1)
        exact = torch.zeros(run, dtype=torch.float64)
        exact[:numel] = values.double()
        quotient = exact / scales.double().repeat_interleave(quantizer.block)[:run]
        ties = ((quotient.abs() - quotient.abs().floor() - 0.5).abs() < 1e-9)[differ]
        steps = (integers["cpu"] - integers["cuda"]).abs().max().item()
        decoded = [quantizer.decode(encoded["cpu"].to(device), run).cpu() for device in ("cpu", "cuda")]
        report.append((bits, numel, str(dtype), same_scales, len(differ), int((~ties).sum()), steps,
                       torch.equal(decoded[0], decoded[1])))
    print("bits, numel, dtype, same scales, integers differing, of them not at a tie, largest step, same decode")
    print("\n".join(map(str, report)))
    assert all(row[3] and row[5] == 0 and row[6] <= 1 and row[7] for row in report), report


def test_the_int8_decode_on_the_gpu_is_the_cpus_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU review K7: int8 frozen weights are decoded on the GPU through a small fp32 buffer; with
    it set to 4096 elements, long rows (a span of blocks at a time) and more short rows than fit
    decode to the CPU's values bit for bit, in fp32 and bf16."""
    import zero_engine.quantize as quantize

    monkeypatch.setattr(quantize, "DECODE_CHUNK_ACCELERATOR", 4096)
    quantizer = quantize.BlockQuantizer(8)
    for rows, numel in ((2, 10_000), (5, 1_000), (3, 3)):
        values = torch.randn(rows, numel, generator=torch.Generator().manual_seed(numel)) * torch.logspace(-3, 2, numel)
        encoded = torch.empty(rows, quantizer.encoded_bytes(numel), dtype=torch.uint8)
        quantizer.encode_rows(values, encoded)
        for dtype in (torch.float32, torch.bfloat16):
            on_cpu = torch.empty(rows, numel, dtype=dtype)
            quantizer.decode_rows_into(encoded, numel, on_cpu)
            on_gpu = torch.empty(rows, numel, dtype=dtype, device="cuda")
            quantizer.decode_rows_into(encoded.cuda(), numel, on_gpu)
            assert torch.equal(on_gpu.cpu(), on_cpu), (rows, numel, dtype)


def _lora_llama(device: torch.device):  # noqa: ANN202
    from tiny import llama, with_lora

    return with_lora(llama(hidden=64, ffn=128).to(torch.bfloat16)).to(device)


def _lora_config(force: bool, dtype: str = "bf16", **zero: object) -> dict:
    config = engine_config(3, micro=2, lr=1e-2, dtype=dtype, stage3_param_persistence_threshold=0, **zero)
    config["comm"] = {"force_collectives": force}
    return config


def _ids(step: int, rank: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank)).to(device)


def _syncs_while(call: object) -> tuple[object, int, float]:
    """``call()``'s result, the synchronizing CUDA calls it made (sync debug mode) and its seconds."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        started = time.perf_counter()
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seconds = time.perf_counter() - started
    return result, sum("called a synchronizing CUDA operation" in str(w.message) for w in caught), seconds


def new_paths(rank: int, world_size: int) -> dict:
    """This turn's code on a GPU (GPU review K7), at one rank on NCCL with every collective
    forced, or ranks sharing the GPU over gloo: LoRA on a tiny Llama at stage 3 with int8 frozen
    weights, sharded and replicated (against the same run on the CPU where the ranks are gloo's);
    a ``gathered(modifier_rank=0)`` write; ``named_full_parameters`` against ``full_state_dict``
    with and without an offloaded optimizer (host syncs and seconds printed); ``generate``
    against the unsharded model."""
    device = local_cuda_device()
    force = world_size == 1
    out: dict = {"losses": {}, "cpu_losses": {}, "problems": [], "streams": {}}
    for frozen in ("shard", "replicate"):
        zero = {"zero_quantized_nontrainable_weights": True, "frozen_weights": frozen}
        places = [device] if force else [device, torch.device("cpu")]  # one NCCL rank: no CPU tensors on it
        for place in places:
            engine = zero_engine.initialize(_lora_llama(place), _lora_config(force and place.type == "cuda", **zero))
            losses = []
            for step in range(3):
                loss = engine(input_ids=_ids(step, rank, place), labels=_ids(step, rank, place)).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out["losses" if place.type == "cuda" else "cpu_losses"][frozen] = losses
            engine.close()
    engine = zero_engine.initialize(_lora_llama(device), _lora_config(force))
    adapter = next(p for n, p in engine.module.named_parameters() if "lora_A" in n)
    name = next(n for n, p in engine.module.named_parameters() if p is adapter)
    before = engine.full_state_dict()[name]
    with engine.gathered([adapter], modifier_rank=0):
        with torch.no_grad():
            adapter.mul_(2.0 if rank == 0 else 7.0)
    expected = (before.to(torch.bfloat16) * 2.0).float()
    if not torch.equal(engine.full_state_dict()[name].cpu(), expected.cpu()):
        out["problems"].append("gathered(modifier_rank=0): the write is not in the masters")
    engine.close()
    for label, zero in (("plain", {}), ("offloaded", {"offload_optimizer": PINNED})):
        engine = zero_engine.initialize(_lora_llama(device), _lora_config(force, **zero))
        engine.backward(engine(input_ids=_ids(0, rank, device), labels=_ids(0, rank, device)).loss)
        engine.step()
        full = engine.full_state_dict()
        streamed, syncs, seconds = _syncs_while(lambda: dict(engine.named_full_parameters(bucket_bytes=64 * 1024)))
        out["streams"][label] = (syncs, seconds)
        if list(streamed) != list(full) or any(not torch.equal(t.cpu(), full[k].cpu()) for k, t in streamed.items()):
            out["problems"].append(f"named_full_parameters ({label}) differs from full_state_dict")
        engine.close()
    model = _lora_llama(device)
    engine = zero_engine.initialize(model, _lora_config(force, dtype="fp32"))
    prompt = _ids(9, 0, device)
    with torch.no_grad():
        sharded = engine.module.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    full = engine.full_state_dict()
    engine.close()
    plain = _lora_llama(device).float()
    plain.load_state_dict(full)
    with torch.no_grad():
        unsharded = plain.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if not torch.equal(sharded.cpu(), unsharded.cpu()):
        out["problems"].append("generate at stage 3 differs from the unsharded model's")
    return out


@pytest.mark.parametrize("world_size", [1, 2], ids=["one rank on NCCL", "two ranks over gloo"])
def test_this_turns_paths_on_the_gpu(world_size: int) -> None:
    pytest.importorskip("peft", reason="scripts/prepare_wheels.sh carries peft")
    backend = None if world_size == 1 else "gloo"
    for rank, out in enumerate(run_on_ranks(world_size, new_paths, backend=backend, timeout=400, allow_numpy=True)):
        print(f"rank {rank}: losses {out['losses']} (CPU {out['cpu_losses']}); named_full_parameters: "
              f"(host syncs, seconds) {out['streams']}")
        assert not out["problems"], out["problems"]
        for frozen, losses in out["losses"].items():
            assert all(loss == loss and loss < 10 for loss in losses), (frozen, losses)  # finite, sane
            if out["cpu_losses"]:
                assert losses == pytest.approx(out["cpu_losses"][frozen], rel=2e-2), (frozen, out["cpu_losses"])
        assert out["streams"]["offloaded"][0] == 0, out["streams"]  # pinned masters: no host sync (Q2)


# -- Muon and NVMe offload (issues 68, 69) on the GPU ------------------------------------------------

MUON_CASES = [
    {"stage": 0}, {"stage": 1}, {"stage": 2, "offload": True}, {"stage": 3}, {"stage": 3, "offload": True},
]
NVME_CASES = [
    {"stage": 2, "dtype": "bf16"}, {"stage": 3}, {"stage": 2, "optimizer": "Muon", "accum": 1},
    {"stage": 3, "dtype": "bf16", "params": True},  # the parameter shards on NVMe too, filled into CUDA buffers
]


def muon_and_nvme(rank: int, world_size: int, directory: str) -> dict:
    """Muon's two all-to-alls and its Newton-Schulz on CUDA tensors (NCCL at one rank with every
    collective forced; gloo between ranks sharing the GPU), offloaded masters brought to the GPU
    for the matrix; and NVMe offload of the optimizer side (and of parameter shards) on a CUDA
    model, against CPU offload."""
    import muon_cases
    import nvme_cases

    device = local_cuda_device()
    force = {"comm": {"force_collectives": True}} if world_size == 1 else {}
    muon = []
    for case in MUON_CASES:
        engine = zero_engine.initialize(make_gpt().to(device), {**muon_cases.muon_config(case), **force})
        muon_cases.train_engine(engine, rank, world_size, range(muon_cases.STEPS // 2), 1, device)
        muon.append({name: t.cpu() for name, t in engine.full_state_dict().items()})
        engine.close()
    nvme = []
    for case in NVME_CASES:
        states = []
        for where in ("cpu", "nvme"):
            options = {key: case[key] for key in ("dtype", "accum", "optimizer") if key in case}
            config = {**nvme_cases.config(case["stage"], where, directory, **options), **force}
            if case.get("params"):
                config = nvme_cases.param_config(config, where, where, directory)
            engine = zero_engine.initialize(make_gpt().to(device), config)
            muon_cases.train_engine(engine, rank, world_size, range(6), case.get("accum", 2), device)
            states.append({name: t.cpu() for name, t in engine.full_state_dict().items()})
            engine.close()
        nvme.append([name for name in states[0] if not torch.equal(states[0][name], states[1][name])])
    return {"muon": muon, "nvme": nvme}


@pytest.mark.parametrize("world_size", [1, 2], ids=["one rank on NCCL", "two ranks over gloo"])
def test_muon_and_nvme_offload_on_the_gpu(world_size: int) -> None:
    import muon_cases

    backend = None if world_size == 1 else "gloo"
    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        per_rank = run_on_ranks(world_size, muon_and_nvme, directory, backend=backend, timeout=400)
    reference = muon_cases.train_reference(muon_cases.STEPS // 2, muon_cases.MICRO * world_size, device="cuda")
    for rank, out in enumerate(per_rank):
        for case, state in zip(MUON_CASES, out["muon"]):
            # CUDA's embedding backward adds in any order; the reference's kernels are the same otherwise
            worst = max((state[name] - expected).abs().max().item() for name, expected in reference.items())
            print(f"Muon {case} at {world_size} rank(s), rank {rank}: largest difference {worst:.2e}")
            assert worst <= 1e-4, (case, worst)
        for case, differing in zip(NVME_CASES, out["nvme"]):
            assert not differing, f"{case}: NVMe offload differs from CPU offload on the GPU in {differing}"


# -- Ulysses sequence parallelism and the tiled loss (issue 67) on the GPU --------------------------

SP_CASE = {"world": 2, "k": 2, "stage": 3, "attention": "sdpa", "length": 15, "packed": True}


def sequence_parallel_on_the_gpu(rank: int, world_size: int, tiles: int) -> dict:
    """Two ranks sharing the GPU over gloo as one sequence-parallel group: the attention's
    all-to-alls on CUDA tensors, HF's sdpa on the GPU, a padded length, the loss a tile at a time."""
    import sequence_cases as sp

    device = local_cuda_device()
    config = engine_config(3, micro=sp.MICRO, accum=sp.ACCUM, lr=1e-3, clip=1.0, optimizer_params={"weight_decay": 0.0})
    config.update(sequence_parallel_size=2, tiled_loss_tokens=tiles)
    engine = zero_engine.initialize(sp.sequence_llama("sdpa").to(device), config)
    losses = []
    for step in sp.batches(SP_CASE["length"], 1):
        for micro in range(sp.ACCUM):
            inputs = {key: t.to(device) for key, t in sp.case_inputs(SP_CASE, step[0][micro]).items()}
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    state = {name: t.cpu() for name, t in engine.full_state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state}


def test_sequence_parallelism_and_the_tiled_loss_on_the_gpu() -> None:
    pytest.importorskip("transformers")
    import sequence_cases as sp

    per_rank = run_on_ranks(2, sequence_parallel_on_the_gpu, 4, timeout=300, allow_numpy=True)
    expected = sp.reference(SP_CASE)  # one process on the CPU: the GPU's kernels sum in other orders
    for rank, result in enumerate(per_rank):
        reference_losses = [loss for step in expected["losses"] for loss in step]
        print(f"rank {rank}: losses {result['losses']} (CPU, one process {reference_losses})")
        assert result["losses"] == pytest.approx(reference_losses, abs=1e-4), rank
        worst = max((result["state"][name] - value).abs().max().item() for name, value in expected["state"].items())
        print(f"rank {rank}: largest parameter difference {worst:.2e}")
        assert worst <= 1e-4, worst


def resume_grid(rank: int, world_size: int, cases: list[dict], directory: str) -> list[dict]:
    """4 steps straight, against 2 steps, save, a new engine, load, 2 more steps."""
    device = local_cuda_device()
    out = []
    for index, case in enumerate(cases):
        straight = _engine(case, device)
        train_engine(straight, rank, world_size, range(4), MICRO, case["accum"], device=device)
        first = _engine(case, device)
        train_engine(first, rank, world_size, range(2), MICRO, case["accum"], device=device)
        first.save_checkpoint(Path(directory) / str(index))
        resumed = _engine(case, device)
        resumed.load_checkpoint(Path(directory) / str(index))
        train_engine(resumed, rank, world_size, range(2, 4), MICRO, case["accum"], device=device)
        expected, got = straight.full_state_dict(), resumed.full_state_dict()
        out.append(max((expected[name] - got[name]).abs().max().item() for name in expected))
        for engine in (straight, first, resumed):
            engine.close()
    return out


def test_save_and_resume_on_the_gpu(tmp_path: Path) -> None:
    differences = run_on_ranks(1, resume_grid, CASES, str(tmp_path), backend=None, timeout=600)[0]
    for case, difference in zip(CASES, differences):
        # exact but for CUDA's atomic adds (embedding backward), which may sum in any order
        assert difference <= (1e-5 if case["dtype"] == "fp32" else 1e-2), (case, difference)


# -- memory: the CUDA caching allocator against memory_report() -----------------------------------

SLACK = 8 * MiB  # an autograd weight gradient before it is accumulated (4 MiB), allocator rounding


def _memory_config(stage: int, dtype: str) -> dict:
    config = engine_config(
        stage, micro=BATCH, lr=0.01, optimizer="SGD", dtype=dtype, stage3_wrap_modules=["Block"],
        reduce_bucket_size=BLOCK_NUMEL,
    )
    # Every collective through NCCL (GPU review N9/K5): its buffers meet the caching allocator.
    config["comm"] = {"force_collectives": True}
    return config


def measure_cuda_memory(rank: int, world_size: int, cases: list[tuple[int, str]]) -> list[dict]:
    device = local_cuda_device()
    # cuBLAS workspaces before any baseline: the forward's stream, and autograd's device thread,
    # which allocates its own (32 MiB on sm90) at the first backward.
    warm = torch.ones(8, 8, device=device, requires_grad=True)
    (warm @ warm).sum().backward()
    del warm
    out = []
    for stage, dtype in cases:
        gc.collect()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        engine = zero_engine.initialize(Tower().to(device), _memory_config(stage, dtype))
        x = torch.randn(BATCH, WIDTH, device=device)
        for _ in range(3):
            engine.backward(engine(x))
            engine.step()
        torch.cuda.synchronize(device)
        steady = torch.cuda.memory_allocated(device) - base
        reset_cuda_peak(device)
        engine.backward(engine(x))
        engine.step()
        torch.cuda.synchronize(device)
        peak = cuda_max_allocated_bytes(device) - base - steady
        report = engine.memory_report()
        out.append({"case": (stage, dtype), "steady": steady, "peak_above_steady": peak, "report": report})
        engine.close()
        del engine
    return out


def test_the_cuda_allocator_agrees_with_memory_report() -> None:
    """Between steps the allocator holds what the report's persistent figures say; a step's peak
    above that lies between the largest transient the report names and the sum of them all."""
    cases = list(itertools.product((0, 1, 2, 3), ("fp32", "bf16")))
    for result in run_on_ranks(1, measure_cuda_memory, cases, backend=None, timeout=600)[0]:
        report = result["report"]
        persistent = sum(report[key] for key in HELD_NOW)
        assert abs(result["steady"] - persistent) <= 0.03 * persistent + SLACK, result
        transient = report["peak_gathered_backward"] + report["peak_gradients"] - report["gradients"]
        transient += report["peak_step_gradients"]
        assert result["peak_above_steady"] <= transient + SLACK, result
        largest = max(report["peak_gathered_forward"], report["peak_step_gradients"])
        assert result["peak_above_steady"] >= largest - SLACK, result


# -- host syncs: torch's sync debug mode --------------------------------------------------------------


def count_syncs(rank: int, world_size: int, cases: list[dict]) -> list[list[str]]:
    """Synchronizing CUDA calls in one optimizer step (two micro-steps), after a warm-up step:
    where each was made (the Python line torch's warning names, and the message)."""
    device = local_cuda_device()
    counts = []
    for case in cases:
        engine = _engine(case, device)
        train_engine(engine, rank, world_size, range(1), MICRO, case["accum"], device=device)
        batches = [
            tuple(t.to(device) for t in micro_batch(1, micro, rank, world_size, MICRO, case["accum"]))
            for micro in range(case["accum"])
        ]
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for batch in batches:
                    engine.backward(engine(*batch))
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append([
            f"{Path(warning.filename).name}:{warning.lineno}: {str(warning.message)[:80]}"
            # not the one-time "Synchronization debug mode is a prototype feature" notice
            for warning in caught if "called a synchronizing CUDA operation" in str(warning.message)
        ])
        engine.close()
    return counts


def test_one_host_sync_per_optimizer_step() -> None:
    """The packed used-mask and norm read back once (`OptimizerStep._agree_on_used_params_and_norm`);
    nothing else waits for the GPU, at any stage. With stage 3's parameter shards on NVMe too (GPU
    review K11): their read buffers are pinned and each gather's copy from one is asynchronous
    (R3: a copy from pageable memory made the host wait for the GPU at every gather), with the
    optimizer side on the device and on NVMe."""

    with tempfile.TemporaryDirectory(dir=DISK) as directory:
        on_nvme = {"device": "nvme", "nvme_path": directory}
        nvme = [
            {"stage": 3, "dtype": "bf16", "accum": 2, "clip": 1.0, "zero": {"offload_param": on_nvme}},
            {"stage": 3, "dtype": "bf16", "accum": 2, "clip": 1.0,
             "zero": {"offload_param": on_nvme, "offload_optimizer": on_nvme}},
        ]
        syncs = run_on_ranks(1, count_syncs, [*CASES, *nvme], backend=None, timeout=600)[0]
    assert [len(where) for where in syncs] == [1] * len([*CASES, *nvme]), list(zip([*CASES, *nvme], syncs))


# -- offload on a real GPU -----------------------------------------------------------------------

PINNED = {"device": "cpu", "pin_memory": True}
OFFLOAD_CASES = [
    dict(case, zero={"offload_optimizer": PINNED, **({"offload_param": PINNED} if case["stage"] == 3 else {})})
    for case in CASES
    if case["stage"] > 0
]


def test_offload_on_one_gpu_matches_the_reference() -> None:
    """Pinned host state, asynchronous copies ordered by the stream, the one wait per backward:
    the same training as the CPU reference."""
    per_rank = run_on_ranks(1, cuda_grid, OFFLOAD_CASES, backend=None, timeout=600)
    for index, case in enumerate(OFFLOAD_CASES):
        _check(case, 1, [per_rank[0][index]])


def offload_placement(rank: int, world_size: int) -> dict:
    """Stage 3, bf16, both offloaded: where every piece of state lives, and the allocator's
    bytes between steps against the same run without offload."""
    device = local_cuda_device()
    held = {}
    for name, zero in (("plain", {}), ("offloaded", {"offload_optimizer": PINNED, "offload_param": PINNED})):
        case = {"stage": 3, "dtype": "bf16", "accum": 2, "clip": 1.0, "zero": zero}
        engine = _engine(case, device)
        train_engine(engine, rank, world_size, range(2), MICRO, case["accum"], device=device)
        gc.collect()
        held[name] = torch.cuda.memory_allocated(device)
        if zero:
            # What crosses to and from the device is pinned: masters, host gradients, parameter
            # shards. The optimizer's own state never crosses (torch.optim makes it with
            # zeros_like, unpinned) and only has to live on the host (issue 45's N8).
            crossing = [t for unit in engine.units for t in (unit.optimizer_shard.master, unit.optimizer_shard.ensure_grad(), unit.param_shard)]
            state = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
            held["all_pinned_host"] = all(t.device.type == "cpu" and t.is_pinned() for t in crossing)
            held["state_on_host"] = bool(state) and all(t.device.type == "cpu" for t in state)
            held["params_on_device"] = all(p.device == device for p in engine.module.parameters())
        engine.close()
        del engine
    return held


def test_offloaded_state_is_pinned_host_memory_and_leaves_the_gpu() -> None:
    held = run_on_ranks(1, offload_placement, backend=None, timeout=600)[0]
    assert held["all_pinned_host"] and held["state_on_host"] and held["params_on_device"], held
    assert held["offloaded"] < held["plain"], held


# -- the host far ahead of the GPU (GPU review plan: "GPU lag" and the hidden-sync detector) -------

LAG_CYCLES = 50_000_000  # torch.cuda._sleep: tens of milliseconds of GPU time per call


class _Lagging:
    """An engine whose every forward and backward first queues a long GPU sleep, so the host
    runs far ahead of the device: storage freed and reused, the NCCL stash and the stream
    waits must still order everything (the results must not change)."""

    def __init__(self, engine: zero_engine.Engine) -> None:
        self.engine = engine

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(LAG_CYCLES)
        return self.engine(*args)

    def backward(self, loss: torch.Tensor) -> None:
        torch.cuda._sleep(LAG_CYCLES)
        self.engine.backward(loss)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


LAG_CASES = [
    {"stage": 3, "dtype": "bf16", "accum": 2, "clip": 1.0},
    {"stage": 2, "dtype": "fp32", "accum": 2, "clip": 1.0},
    {"stage": 3, "dtype": "bf16", "accum": 2, "clip": 1.0, "zero": {"offload_optimizer": {"device": "cpu"}}},
]


def lagging_grid(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    device = local_cuda_device()
    results = []
    for case in cases:
        engine = _engine(case, device)
        windows, norms = train_engine(_Lagging(engine), rank, world_size, range(STEPS), MICRO, case["accum"], device=device)
        results.append({
            "losses": [sum(window) / len(window) for window in windows], "norms": norms, "skipped": engine.skipped_steps,
            "state": {name: value.cpu() for name, value in engine.full_state_dict().items()},
        })
        engine.close()
    return results


def test_a_host_far_ahead_of_the_gpu_changes_nothing() -> None:
    """One rank, NCCL with every collective forced, a GPU sleep before each forward and backward."""
    per_rank = run_on_ranks(1, lagging_grid, LAG_CASES, backend=None, timeout=600)
    for index, case in enumerate(LAG_CASES):
        _check(case, 1, [per_rank[0][index]])


SYNC_CASES = [
    {"stage": 2, "dtype": "bf16", "accum": 1, "clip": 1.0},
    {"stage": 3, "dtype": "bf16", "accum": 1, "clip": 1.0},
    {"stage": 3, "dtype": "bf16", "accum": 1, "clip": 1.0, "zero": {"offload_optimizer": PINNED, "offload_param": PINNED}},
    {"stage": 3, "dtype": "bf16", "accum": 1, "clip": 1.0,
     "zero": {"offload_optimizer": {"device": "cpu", "pin_memory": False},
              "offload_param": {"device": "cpu", "pin_memory": False}}},
    {"stage": 2, "dtype": "fp32", "accum": 1, "clip": 1.0,
     "zero": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}},
]


def _timed_sleep(device: torch.device) -> float:
    """Seconds the GPU takes for the test's sleep, queued alone."""
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    torch.cuda._sleep(4 * LAG_CYCLES)
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def host_lead(rank: int, world_size: int, cases: list[dict]) -> list[tuple[float, float, bool]]:
    """Per case: how long the host took from queueing a GPU sleep to the end of a forward and
    backward (up to the backward's one wait for host copies, with offload), against how long the
    sleep takes alone, and whether the sleep was still queued when the host got there. Torch's
    sync debug mode misses a copy into pageable memory; this does not."""
    from zero_engine import offload

    device = local_cuda_device()
    out = []
    real_wait = offload.wait_for_host_copies
    for case in cases:
        engine = _engine(case, device)
        train_engine(engine, rank, world_size, range(1), MICRO, 1, device=device)  # warm-up
        batch = tuple(t.to(device) for t in micro_batch(1, 0, rank, world_size, MICRO, 1))
        # GPU review K4: an idle GPU clocks down (345 MHz against 1980 boosted on an H200), so a
        # sleep calibrated cold runs long and flatters the host. Twice after the warm-up, the
        # shorter one kept; and the stream must still be busy when the host arrives.
        sleep = min(_timed_sleep(device), _timed_sleep(device))
        reached: list[float] = []
        busy: list[bool] = []

        def arrive() -> None:
            reached.append(time.perf_counter())
            busy.append(not torch.cuda.current_stream(device).query())

        offload.wait_for_host_copies = lambda device_: arrive() or real_wait(device_)
        try:
            started = time.perf_counter()
            torch.cuda._sleep(4 * LAG_CYCLES)
            engine.backward(engine(*batch))
            arrive()
        finally:
            offload.wait_for_host_copies = real_wait
        engine.step()
        torch.cuda.synchronize(device)
        out.append((reached[0] - started, sleep, busy[0]))
        engine.close()
    return out


def test_forward_and_backward_never_wait_for_the_gpu() -> None:
    """The host reaches the end of backward (or its one wait for host copies) before a GPU sleep
    queued first has ended: no hidden host sync in forward or backward, at stages 2-3 and with
    offload, pinned or not (GPU review N3: a copy into pageable memory syncs every bucket)."""
    results = run_on_ranks(1, host_lead, SYNC_CASES, backend=None, timeout=600)[0]
    for case, (host, sleep, still_queued) in zip(SYNC_CASES, results):
        assert still_queued and host < 0.5 * sleep, (case, host, sleep, still_queued)


def test_lightning_trains_on_one_gpu() -> None:
    """GPU review N2: the strategy moves a LightningModule built in ``__init__`` to the GPU
    before building the engine (the CPU tests check the call; this, the device)."""
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule, Trainer

    from zero_engine.integrations.lightning import ZeroEngineStrategy

    class Small(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self) -> None:
            return None

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
            return torch.utils.data.DataLoader(data, batch_size=4)

    module = Small()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}}
    trainer = Trainer(accelerator="gpu", devices=1, max_steps=2, strategy=ZeroEngineStrategy(config),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module)
    assert all(param.device.type == "cuda" for param in module.parameters())
    assert trainer.global_step == 2


def offloaded_inputs_on_the_gpu(rank: int, world_size: int) -> dict[bool, dict]:
    """A bf16 Llama at stage 3 on this GPU, each layer recomputed, its inputs kept on the GPU and
    then in pinned host memory (side-stream copies there and back): the losses, the parameters,
    and torch.cuda.max_memory_allocated of each."""
    from tiny import llama

    device = local_cuda_device()
    results = {}
    for offload in (False, True):
        config = engine_config(3, micro=2, lr=1e-3, dtype="bf16", recompute_units=True, recompute_offload=offload)
        torch.cuda.reset_peak_memory_stats(device)
        engine = zero_engine.initialize(llama(vocab=97, hidden=64, ffn=128, layers=4, positions=256, attention="sdpa").to(device), config)
        losses = []
        for step in range(3):
            ids = torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(step)).to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[offload] = {"losses": losses, "state": engine.full_state_dict(),
                            "peak": torch.cuda.max_memory_allocated(device)}
        engine.close()
    return results


def test_recompute_offload_on_the_gpu_is_bit_for_bit_with_a_lower_peak() -> None:
    """Issue 82, item 7 on a GPU: the kept inputs through pinned memory and the side stream give
    the same losses and parameters to the bit, and the peak (printed) no higher."""
    pytest.importorskip("transformers")
    results = run_on_ranks(1, offloaded_inputs_on_the_gpu, timeout=300, allow_numpy=True)[0]
    kept, offloaded = results[False], results[True]
    print(f"peak {kept['peak'] / 2**20:.1f} MiB kept on the GPU, {offloaded['peak'] / 2**20:.1f} MiB offloaded")
    assert offloaded["losses"] == kept["losses"]
    for name, value in kept["state"].items():
        assert torch.equal(offloaded["state"][name], value), name
    assert offloaded["peak"] <= kept["peak"]
