"""``engine.named_full_parameters()``: equal to ``full_state_dict()`` bit for bit at stages 0-3
on 2 and 3 ranks (fp32, and a bf16 base under ``bf16``; buckets small enough that entries and
buckets split across ranks; ``rank0_only``); on a PEFT LoRA Llama at stage 3 with
``merge_adapters=True``, equal bit for bit to PEFT's ``merge_and_unload()`` of the same weights;
each rank's resident high-water growth during a sweep of a model many buckets large stays
within one bucket plus the largest tensor plus a small constant (the whole model gathered
would be 8 times that). The slow run adds hybrid sharding (4 ranks, groups of 2)."""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch import nn

import zero_engine
from adapted import make_model
from configs import engine_config
from harness import recorded_collectives, run_on_ranks
from tiny import llama, lora_config, with_lora
from zero_engine.state.adapters import adapter_names
from zero_engine.testing.process_memory import peak_resident_bytes, reset_peak_resident, resident_bytes

MiB = 2**20


def config(stage: int, dtype: str | None = None, wrap: str = "Layer", **zero) -> dict:
    return engine_config(
        stage, micro=2, lr=0.01, dtype=dtype, stage3_param_persistence_threshold=0, stage3_wrap_modules=[wrap], **zero
    )


def train_step(engine, rank: int) -> None:
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(ids))
    engine.step()


def case_equal(rank: int, world: int, stage: int, dtype: str | None, **zero) -> dict:
    """After a step (masters and compute copies differ under bf16), every entry equals
    ``full_state_dict()``'s bit for bit, in its order, with buckets of 100 bytes and of 64 KiB."""
    model = make_model()
    if dtype == "bf16":
        for param in model.parameters():
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    engine = zero_engine.initialize(model, config(stage, dtype, **zero))
    train_step(engine, rank)
    full = engine.full_state_dict()
    problems = []
    for bucket in (100, 64 * 1024):
        streamed = list(engine.named_full_parameters(bucket_bytes=bucket))
        if [name for name, _ in streamed] != list(full):
            problems.append(f"bucket {bucket}: names {[name for name, _ in streamed]}")
        for name, tensor in streamed:  # full_state_dict has fp32 copies; a bf16 base is streamed as stored
            if not torch.equal(tensor.to(torch.float32), full[name]) or tensor.shape != full[name].shape:
                problems.append(f"bucket {bucket}: {name}")
    only = list(engine.named_full_parameters(bucket_bytes=100, rank0_only=True))
    if rank == 0 and [(n, t.to(torch.float32)) for n, t in only].__len__() != len(full):
        problems.append("rank0_only: rank 0 got another number of entries")
    if rank == 0 and not all(torch.equal(t.to(torch.float32), full[n]) for n, t in only):
        problems.append("rank0_only: values")
    if rank != 0 and only:
        problems.append("rank0_only: another rank got entries")
    # a subset whose first sharded entry is the bf16 base (as a PEFT model's is): each bucket in one dtype
    subset = list(engine.named_full_parameters(bucket_bytes=4096, names=lambda n: not n.startswith("embed")))
    if [n for n, _ in subset] != [n for n in full if not n.startswith("embed")]:
        problems.append(f"names=predicate: names {[n for n, _ in subset]}")
    problems += [f"names=predicate: {n}" for n, t in subset if not torch.equal(t.to(torch.float32), full[n])]
    listed = dict(engine.named_full_parameters(names=["layers.1.adapt.weight", "layers.0.base.bias"]))
    if sorted(listed) != ["layers.0.base.bias", "layers.1.adapt.weight"]:
        problems.append(f"names=list: {sorted(listed)}")
    refused = []
    for names in ("layers.9.adapt.weight", ["nothing.weight"], 7):
        try:
            engine.named_full_parameters(names=names)
        except (KeyError, TypeError) as error:
            refused.append(type(error).__name__)
    if refused != ["KeyError", "KeyError", "TypeError"]:
        problems.append(f"names refused: {refused}")
    cast = dict(engine.named_full_parameters(dtype="bf16"))
    if any(not torch.equal(cast[name], full[name].to(torch.bfloat16)) for name in full):
        problems.append("dtype=bf16: values")
    bf16_base = dict(engine.named_full_parameters())["layers.0.base.weight"].dtype
    return {"problems": problems, "bf16_base": bf16_base == torch.bfloat16}


class Wide(nn.Module):
    """16 layers of 512 x 512 fp32 (1 MiB each): 16 MiB of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512, bias=False) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


BUCKET = 2 * MiB
SLACK = 2 * MiB  # page rounding, interpreter objects, the small control collectives


def case_memory(rank: int, world: int, stage: int, dtype: str | None) -> dict:
    """A sweep whose consumer drops each tensor: the high-water growth per rank."""
    torch.manual_seed(0)
    engine = zero_engine.initialize(Wide(), config(3, wrap="Linear"))
    gc.collect()
    before = resident_bytes()
    reset_peak_resident()
    count = 0
    for _, tensor in engine.named_full_parameters(bucket_bytes=BUCKET):
        count += tensor.numel()
        del tensor
    growth = peak_resident_bytes() - before
    return {"growth": growth, "count": count, "problems": []}


def case_stops_early(rank: int, world: int, stage: int, dtype: str | None) -> dict:
    """Reliability review D4: a rank that stops iterating after its second entry, or streams
    alone (rank 0, ``rank0_only``) while the others train on: every rank raises
    `DivergedRanksError` within seconds, not after ``comm.timeout_s`` (at stage 1 under bf16,
    where the fp32 masters are sharded: in fp32 they are the whole parameters, and a stream
    gathers nothing to stop in)."""
    from zero_engine import DivergedRanksError

    problems = []
    for misuse in ("break", "alone"):
        engine = zero_engine.initialize(make_model(), config(stage, dtype))
        started = time.monotonic()
        try:
            if misuse == "break":
                for index, _ in enumerate(engine.named_full_parameters(bucket_bytes=64)):
                    if rank == 0 and index == 1:
                        break
            elif rank == 0:
                list(engine.named_full_parameters(rank0_only=True))
            train_step(engine, rank)
            problems.append(f"{misuse}: no error")
        except DivergedRanksError:
            if time.monotonic() - started > 30:
                problems.append(f"{misuse}: raised after {time.monotonic() - started:.0f} s")
        engine.close()
    return {"problems": problems}


def case_nccl_launches(rank: int, world: int, stage: int, dtype: str | None) -> dict:
    """GPU review Q5: on NCCL a bucket's pieces travel in one call (an all-gather of pieces of
    their own sizes, which NCCL runs as one group of broadcasts), not one broadcast per owner.
    Recorded under the NCCL model without running them (gloo takes pieces of one size only)."""
    from zero_engine.state import streaming
    from zero_engine.testing.nccl_model import NcclModel

    gathered_buckets: list[int] = []
    real = streaming._gather_bucket

    def counted(bucket, *args):  # noqa: ANN001, ANN002
        gathered_buckets.append(len(bucket))
        return real(bucket, *args)

    streaming._gather_bucket = counted
    try:
        with NcclModel(run_data_collectives=False) as nccl:
            engine = zero_engine.initialize(make_model(), config(stage, dtype))
            nccl.mark("stream")
            list(engine.named_full_parameters(bucket_bytes=100))
    finally:
        streaming._gather_bucket = real
    events = nccl.events[[e.what for e in nccl.events].index("stream"):]
    launches = [event.what for event in events if event.kind == "launch"]
    problems = [] if launches == ["all_gather"] * len(gathered_buckets) and gathered_buckets else [
        f"{len(gathered_buckets)} buckets, launches {launches}"
    ]
    engine.close()
    return {"problems": problems}


def case_equal_hybrid(rank: int, world: int, stage: int, dtype: str | None) -> dict:
    """Hybrid sharding: gathered inside each shard group (onto rank 0 from the first group)."""
    return case_equal(rank, world, stage, dtype, shard_group_size=2)


CASES = {
    "equal": case_equal, "memory": case_memory, "equal_hybrid": case_equal_hybrid, "stops_early": case_stops_early,
    "nccl_launches": case_nccl_launches,
}


def run_cases(rank: int, world: int, cases: list[tuple[str, int, str | None]]) -> dict:
    torch.set_num_threads(1)
    return {case: CASES[case[0]](rank, world, *case[1:]) for case in cases}


def check(results: list[dict], cases: list) -> None:
    for case in cases:
        for rank, result in enumerate(results):
            got = result[case]
            assert not got["problems"], (case, rank, got["problems"])
            if case[0].startswith("equal") and case[2] == "bf16":
                assert got["bf16_base"], case
            if case[0] == "memory":
                assert got["count"] == 16 * 512 * 512
                bound = BUCKET + MiB + SLACK  # one bucket, the largest tensor (1 MiB), a constant
                assert got["growth"] <= bound, (rank, got["growth"] / MiB, bound / MiB)


FAST = [("equal", stage, None) for stage in (0, 1, 2, 3)] + [("equal", 3, "bf16"), ("equal", 2, "bf16")]
FAST += [("memory", 3, None), ("stops_early", 1, "bf16"), ("stops_early", 3, None), ("nccl_launches", 3, None)]


def test_full_parameters_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the resident set
    results = run_on_ranks(2, run_cases, FAST)
    check(results, FAST)


def test_full_parameters_three_ranks() -> None:
    cases = [("equal", 3, None), ("equal", 3, "bf16"), ("equal", 1, "bf16"), ("nccl_launches", 1, "bf16")]
    results = run_on_ranks(3, run_cases, cases)
    check(results, cases)


@pytest.mark.parametrize(  # stage 3 in the fast run: each rank's pieces are its shard rank's (N15), not its world rank's
    "cases", [[("equal_hybrid", 3, "bf16")], pytest.param([("equal_hybrid", 1, None)], marks=pytest.mark.slow)],
    ids=["stage3", "stage1"],
)
def test_full_parameters_with_hybrid_sharding(cases: list) -> None:
    results = run_on_ranks(4, run_cases, cases)
    check(results, cases)


# -- PEFT: merged as merge_and_unload() merges ---------------------------------------------------


def lora_llama():
    return with_lora(llama(positions=8))


def with_inactive_adapter(model):  # noqa: ANN001, ANN201
    """A second adapter, trained by nobody and not active: the merge must leave it out (N17)."""

    model.add_adapter("other", lora_config())
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name and ".default." in name)
    return model


def run_merge(rank: int, world: int) -> dict:
    from zero_engine.state.gathered import GatheredParameters

    torch.set_num_threads(1)
    problems = []
    for stage, inactive in ((3, False), (0, True)):
        model = with_inactive_adapter(lora_llama()) if inactive else lora_llama()
        engine = zero_engine.initialize(model, engine_config(stage, micro=2, lr=0.01, stage3_param_persistence_threshold=0))
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        entered, real_enter = [], GatheredParameters.__enter__
        GatheredParameters.__enter__ = lambda self: (entered.append(1), real_enter(self))[1]
        merged = dict(engine.named_full_parameters(merge_adapters=True, bucket_bytes=4096))
        GatheredParameters.__enter__ = real_enter
        if entered != [1]:  # every adapter held once for the stream, not once per LoRA layer (Q3)
            problems.append(f"stage {stage}: {len(entered)} gathered() contexts")
        full = engine.full_state_dict()
        reference = with_inactive_adapter(lora_llama()) if inactive else lora_llama()
        reference.load_state_dict(full)
        expected = reference.merge_and_unload().state_dict()
        problems += [] if list(merged) == list(expected) else [f"stage {stage}: names {list(merged)} != {list(expected)}"]
        problems += [f"stage {stage}: {name}" for name in expected
                     if name in merged and not torch.equal(merged[name], expected[name])]
        if stage == 3:
            problems += _adapters_alone(engine, model, full)
            changed = not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], full[
                "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
        engine.close()
    return {"problems": problems, "changed": changed}


def _adapters_alone(engine, model, full: dict) -> list[str]:  # noqa: ANN001
    """The adapters alone (what a PEFT save keeps): only their elements cross."""
    wanted = adapter_names(model)
    calls: list = []
    with recorded_collectives(calls):
        adapters = dict(engine.named_full_parameters(names=wanted.__contains__))
    crossed = sum(nbytes for method, _, _, nbytes in calls if method == "gather_pieces")  # a broadcast per piece
    adapter_bytes = sum(full[name].numel() * 4 for name in wanted)
    problems = [name for name in wanted if not torch.equal(adapters[name], full[name])]
    problems += [] if crossed == adapter_bytes else [f"crossed {crossed} bytes, the adapters are {adapter_bytes}"]
    problems += [] if adapters and all("lora_" in name for name in adapters) else [f"adapters {sorted(adapters)}"]
    return problems


def test_merge_adapters_equals_peft_merge() -> None:
    pytest.importorskip("peft", reason="the [test] extra installs peft")
    for result in run_on_ranks(2, run_merge, allow_numpy=True):
        assert not result["problems"], result["problems"]
        assert result["changed"]  # the merge added a non-zero delta
