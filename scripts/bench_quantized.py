"""ZeRO++'s quantized communication against unquantized, in ONE job: bytes, speed and quality.

    torchrun --standalone --nproc_per_node=2 scripts/bench_quantized.py --bytes --speed
    torchrun --standalone --nproc_per_node=2 scripts/bench_quantized.py --quality

``--bytes``: one optimizer step per setting (stages 1-3, fp32 and bf16), every data call handed
to ``torch.distributed`` recorded with the bytes of the tensor it is given (a gloo gather is one
broadcast per shard, a reduce-scatter one reduce per shard or one all-to-all): parameter gathers
and gradient reductions per step, and their ratio to the same step unquantized.

``--speed``: an engine per setting trains its own copy of the GPT on the same batches, their
steps alternating, and the ratio of median step times to the unquantized engine of the same
stage is reported; then the measured encode + decode cost per element, and the projection for
a bandwidth-bound link (``--bandwidth`` GB/s per rank): the seconds the saved bytes would take
against the seconds quantizing them costs.

``--quality``: the main job (scripts/train.py's model, data and config, at stage 3) trained for
the steps the unquantized run reaches in ``--time-budget`` seconds, then each quantized setting
for the same steps; held-out losses and their difference relative to unquantized.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS, decay_groups  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402
from zero_engine.comm import groups as comm_module  # noqa: E402
from zero_engine.quantize import BlockQuantizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "off": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qgZ4": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4},
    "both": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
GATHERS = {"broadcast", "_all_gather_into_tensor", "all_gather_into_tensor", "all_gather_single"}
REDUCTIONS = {"reduce", "_reduce_scatter_tensor", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single"}


def config(stage: int, setting: str, dtype: str, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {"stage": stage, "stage3_wrap_modules": ["Block"], "stage3_param_persistence_threshold": 10000,
                              "reduce_bucket_size": 2_000_000, **SETTINGS[setting]},
    }


class Recorder:
    """Wraps the torch.distributed functions the engine's data collectives use, counting the
    bytes of the tensor each call is given (the control group's int64 traffic left out)."""

    def __init__(self) -> None:
        self.bytes = {"gathers": 0, "reductions": 0}
        for name in GATHERS | REDUCTIONS:
            for owner in (dist, comm_module):
                if hasattr(owner, name) and getattr(owner, name) is not None:
                    setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name: str, function):
        kind = "gathers" if name in GATHERS else "reductions"

        def record(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if tensors and tensors[0].dtype != torch.int64:
                # an all-to-all / native collective is given the whole buffer; per-shard ones a shard
                self.bytes[kind] += max(t.numel() * t.element_size() for t in tensors)
            return function(*args, **kwargs)

        record.__wrapped_by_recorder__ = True
        return record

    def reset(self) -> None:
        self.bytes = {"gathers": 0, "reductions": 0}


def measure_bytes(args: argparse.Namespace, rank: int, world: int, data: TextBatches) -> list[dict]:
    recorder = Recorder()
    rows = []
    for dtype in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            per_setting = {}
            for setting in ("off", "qwZ", "qgZ", "qgZ4", "both"):
                torch.manual_seed(0)
                engine = zero_engine.initialize(GPT(PRESETS[args.model]), config(stage, setting, dtype, args.micro))
                for step in range(2):  # the second step is the one measured
                    recorder.reset()
                    engine.backward(engine(*data.rank_batch(step, 0, rank, world, args.micro, 1)))
                    engine.step()
                per_setting[setting] = dict(recorder.bytes)
                engine.close()
            off = per_setting["off"]
            for setting, counted in per_setting.items():
                rows.append({
                    "dtype": dtype, "stage": stage, "setting": setting, **counted,
                    "gathers_ratio": counted["gathers"] / off["gathers"] if off["gathers"] else None,
                    "reductions_ratio": counted["reductions"] / off["reductions"] if off["reductions"] else None,
                })
    return rows


def measure_speed(args: argparse.Namespace, rank: int, world: int, data: TextBatches) -> dict:
    systems = {}
    for stage in (1, 2, 3):
        for setting in ("off", "qgZ", "both") if stage == 3 else ("off", "qgZ"):
            torch.manual_seed(0)
            systems[f"stage{stage}-{setting}"] = zero_engine.initialize(
                GPT(PRESETS[args.model]), config(stage, setting, "fp32", args.micro),
                param_groups=None,
            )
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for step in range(args.warmup + args.steps):
        order = names[step % len(names):] + names[: step % len(names)]  # rotating: noise hits all alike
        batch = data.rank_batch(step, 0, rank, world, args.micro, 1)
        for name in order:
            engine = systems[name]
            dist.barrier()
            started = time.perf_counter()
            engine.backward(engine(*batch))
            engine.step()
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                times[name].append(elapsed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    sent = {name: engine.comm_report()["total"]["sent"] for name, engine in systems.items()}
    for engine in systems.values():
        engine.close()
    ratios = {name: medians[name] / medians[f"{name.split('-')[0]}-off"] for name in names}
    return {"median_s": medians, "ratio_to_unquantized": ratios, "sent_per_step": sent}


def quantization_cost(repeats: int = 20) -> dict:
    """Seconds per element to encode and decode (int8 and int4), on one thread, 4M elements."""
    values = torch.randn(4 * 2**20)
    out = {}
    for bits in (8, 4):
        quantizer = BlockQuantizer(bits)
        encoded = torch.empty(quantizer.encoded_bytes(values.numel()), dtype=torch.uint8)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            quantizer.encode(values, encoded)
            quantizer.decode(encoded, values.numel())
            samples.append(time.perf_counter() - started)
        out[f"int{bits}"] = statistics.median(samples) / values.numel()
    return out


def projection(speed: dict, cost: dict, bandwidth: float, world: int) -> dict:
    """Per setting: the seconds per step the saved bytes would take at ``bandwidth`` bytes/s,
    against the measured encode + decode seconds of the elements quantized. An int8 element
    of fp32 saves ``4 - (1 + 4/2048)`` bytes of a buffer, of which a rank sends ``(N-1)/N``."""
    rows = {}
    for name, sent in speed["sent_per_step"].items():
        stage, setting = name.split("-")
        if setting == "off":
            continue
        saved = speed["sent_per_step"][f"{stage}-off"] - sent
        elements = saved / ((4 - (1 + 4 / 2048)) * (world - 1) / world)
        transfer_s, quantize_s = saved / bandwidth, elements * cost["int8"]
        rows[name] = {"saved_bytes": saved, "transfer_s_saved": transfer_s, "quantize_s": quantize_s,
                      "net_s": transfer_s - quantize_s,
                      "break_even_bytes_per_s": saved / quantize_s if quantize_s else None}
    return rows


def quality(args: argparse.Namespace, rank: int) -> list[dict]:
    import train

    rows = []
    steps = None
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("off", "qwZ", "qgZ", "both", "qgZ4"):
            text = (ROOT / "configs" / "zero3.yaml").read_text()
            keys = "".join(f"\n  {key}: {json.dumps(value)}" for key, value in SETTINGS[setting].items())
            path = Path(tmp) / f"rank{rank}-{setting}.yaml"
            path.write_text(text.replace("\nzero_optimization:", "\nzero_optimization:" + keys, 1))
            budget = ["--time-budget", str(args.time_budget)] if steps is None else ["--steps", str(steps), "--time-budget", "1e9"]
            started = time.perf_counter()
            result = train.main(["--config", str(path), *budget])
            steps = steps or result["steps"]
            rows.append({"setting": setting, "steps": result["steps"], "held_out_loss": result["held_out_loss"],
                         "seconds": time.perf_counter() - started})
    off = rows[0]["held_out_loss"]
    for row in rows:
        row["relative_to_unquantized"] = (row["held_out_loss"] - off) / off
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--quality", action="store_true")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bandwidth", type=float, default=25e9, help="bytes/s per rank for the projection")
    parser.add_argument("--time-budget", type=float, default=90.0)
    parser.add_argument("--out", default="bench_quantized.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TextBatches(load_corpus(), PRESETS[args.model].context)
    results: dict = {"world_size": world, "model": args.model, "torch": torch.__version__}
    if args.bytes:
        results["bytes"] = measure_bytes(args, rank, world, data)
    if args.speed:
        results["speed"] = measure_speed(args, rank, world, data)
        results["quantization_cost_s_per_element"] = quantization_cost()
        results["projection"] = projection(results["speed"], results["quantization_cost_s_per_element"],
                                           args.bandwidth, world)
    if args.quality:
        results["quality"] = quality(args, rank)
    if rank == 0:
        print(json.dumps(results, indent=1))
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
