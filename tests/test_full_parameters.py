"""``engine.named_full_parameters()``: equal to ``full_state_dict()`` bit for bit at stages 0-3
on 2 and 3 ranks (fp32, and a bf16 base under ``bf16``; buckets small enough that entries and
buckets split across ranks; ``rank0_only``); on a PEFT LoRA Llama at stage 3 with
``merge_adapters=True``, equal bit for bit to PEFT's ``merge_and_unload()`` of the same weights;
each rank's resident high-water growth during a sweep of a model many buckets large stays
within one bucket plus the largest tensor plus a small constant (the whole model gathered
would be 8 times that). The slow run adds hybrid sharding (4 ranks, groups of 2)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import zero_engine
from adapted import make_model
from configs import engine_config
from harness import recorded_collectives, run_on_ranks
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


def case_equal_hybrid(rank: int, world: int, stage: int, dtype: str | None) -> dict:
    """Hybrid sharding: gathered inside each shard group (onto rank 0 from the first group)."""
    return case_equal(rank, world, stage, dtype, shard_group_size=2)


CASES = {"equal": case_equal, "memory": case_memory, "equal_hybrid": case_equal_hybrid}


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
FAST += [("memory", 3, None)]


def test_full_parameters_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the resident set
    results = run_on_ranks(2, run_cases, FAST)
    check(results, FAST)


def test_full_parameters_three_ranks() -> None:
    cases = [("equal", 3, None), ("equal", 3, "bf16"), ("equal", 1, "bf16")]
    results = run_on_ranks(3, run_cases, cases)
    check(results, cases)


@pytest.mark.slow
def test_full_parameters_with_hybrid_sharding() -> None:
    cases = [("equal_hybrid", 3, "bf16"), ("equal_hybrid", 1, None)]
    results = run_on_ranks(4, run_cases, cases)
    check(results, cases)


# -- PEFT: merged as merge_and_unload() merges ---------------------------------------------------


def lora_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, tie_word_embeddings=False,
    )
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora)


def run_merge(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model = lora_llama()
    engine = zero_engine.initialize(model, engine_config(3, micro=2, lr=0.01, stage3_param_persistence_threshold=0))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    merged = dict(engine.named_full_parameters(merge_adapters=True, bucket_bytes=4096))
    full = engine.full_state_dict()
    reference = lora_llama()
    reference.load_state_dict(full)
    expected = reference.merge_and_unload().state_dict()
    problems = [] if list(merged) == list(expected) else [f"names {list(merged)} != {list(expected)}"]
    problems += [name for name in expected if name in merged and not torch.equal(merged[name], expected[name])]
    changed = not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], full[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])
    # the adapters alone (what a PEFT save keeps): only their elements cross
    wanted = adapter_names(model)
    calls: list = []
    with recorded_collectives(calls):
        adapters = dict(engine.named_full_parameters(names=wanted.__contains__))
    crossed = sum(nbytes for method, _, _, nbytes in calls if method == "gather_pieces")  # a broadcast per piece
    adapter_bytes = sum(full[name].numel() * 4 for name in wanted)
    problems += [name for name in wanted if not torch.equal(adapters[name], full[name])]
    return {"problems": problems, "changed": changed, "crossed": (crossed, adapter_bytes), "names": sorted(adapters)}


def test_merge_adapters_equals_peft_merge() -> None:
    pytest.importorskip("peft", reason="the [test] extra installs peft")
    for result in run_on_ranks(2, run_merge, allow_numpy=True):
        assert not result["problems"], result["problems"]
        assert result["changed"]  # the merge added a non-zero delta
        crossed, adapter_bytes = result["crossed"]
        assert crossed == adapter_bytes, result["crossed"]  # pieces unpadded
        assert result["names"] and all("lora_" in name for name in result["names"])
