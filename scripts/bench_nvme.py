"""NVMe offload against CPU offload, and against the disk.

    python scripts/bench_nvme.py --model medium --steps 10 --nvme-path /var/tmp
    python scripts/bench_nvme.py --rss --models small medium large --nvme-path /var/tmp
    python scripts/bench_nvme.py --layout stage3 ...   # the same, parameter shards offloaded too
    python scripts/bench_nvme.py --buffer-count 8 ...  # more shards in host memory, more I/O overlapped
    python scripts/bench_nvme.py --fit --dim 2048 --layers 32 --device nvme --nvme-path /var/tmp

``--layout``: ``stage1`` (the default) offloads the optimizer side at stage 1; ``stage3``
offloads the optimizer side and every parameter shard at stage 3 (``offload_param`` too, every
parameter sharded), on the same device.

Speed (one process, stage 1): two engines train their own copy of the same GPT on the same
batches, ``offload_optimizer`` on ``cpu`` and on ``nvme``, their steps alternating (a step's
writes behind it finish during the next forward and backward, as in training); the table
gives the median step times, their ratio, and the disk's time for the step's I/O (the swap
file's bytes read and written once, at the bandwidth measured here by `SwapFile` itself on a
file of the same size), against the target: NVMe's step at most 1.25x the larger of CPU
offload's step and the I/O time.

Memory (``--rss``, one fresh process per model and device): the resident set after
``initialize`` above the one before it, and the high-water mark (``VmHWM``, reset after
``initialize`` through ``/proc/self/clear_refs``) of 3 training steps above the resident set after
``initialize``, against the optimizer state's bytes and the largest shard's: with NVMe the masters
and the state are in host memory only a few shards at a time.

Fit (``--fit``, one process): a GPT of ``--dim`` and ``--layers`` built on the meta device and
trained ``--steps`` steps at stage 3 with everything offloaded to ``--device``: the parameters,
the resident set's high-water mark above the start, the step time and the swap files' traffic;
with ``cpu``, where the host state does not fit, the refusal `initialize` gives before
allocating it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from gpt import GPT, PRESETS  # noqa: E402
from stdlib_text import TextBatches, load_corpus  # noqa: E402
from zero_engine.sharding.tiers.swap import SwapFile  # noqa: E402


def config(device: str, path: str, micro: int, layout: str = "stage1", buffer_count: int = 4) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 1, "offload_optimizer": {"device": device, "nvme_path": path}}
    if device == "nvme":
        zero["offload_optimizer"]["buffer_count"] = buffer_count
    if layout == "stage3":
        zero.update(stage=3, stage3_param_persistence_threshold=0, offload_param={"device": device, "nvme_path": path})
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": zero,
    }


def build(device: str, args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    return zero_engine.initialize(
        GPT(PRESETS[args.model]), config(device, args.nvme_path, args.micro, args.layout, args.buffer_count)
    )


def disk_bandwidth(path: str, nbytes: int) -> tuple[float, float]:
    """Bytes per second written and read by `SwapFile` (page cache dropped, as the swap does)."""
    swap = SwapFile(path, rank=0)
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    offset = swap.allocate(block.numel() * 4)
    started = time.perf_counter()
    swap.write([(offset, block)])
    written = time.perf_counter() - started
    started = time.perf_counter()
    swap.read(offset, block)
    read = time.perf_counter() - started
    swap.close()
    return nbytes / written, nbytes / read


def speed(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"})
    data = TextBatches(load_corpus(), PRESETS[args.model].context)
    engines = {device: build(device, args) for device in ("cpu", "nvme")}
    times: dict[str, list[float]] = {device: [] for device in engines}
    for step in range(args.warmup + args.steps):
        order = list(engines) if step % 2 == 0 else list(reversed(engines))
        for device in order:
            engine = engines[device]
            started = time.perf_counter()
            engine.backward(engine(*data.rank_batch(step, 0, 0, 1, args.micro, 1)))
            engine.step()
            if step >= args.warmup:
                times[device].append(time.perf_counter() - started)
    for swap in engines["nvme"].held:
        swap.drain()  # the last writes behind (the others overlap the next step)
    moved = engines["nvme"].comm_report()["nvme"]
    for engine in engines.values():
        engine.close()
    write_bw, read_bw = disk_bandwidth(args.nvme_path, moved["written"])
    io_seconds = moved["written"] / write_bw + moved["read"] / read_bw
    medians = {device: statistics.median(values) for device, values in times.items()}
    return {
        "model": args.model, "layout": args.layout, "buffer_count": args.buffer_count,
        "params": sum(p.numel() for p in GPT(PRESETS[args.model]).parameters()),
        "cpu_ms": 1000 * medians["cpu"], "nvme_ms": 1000 * medians["nvme"], "ratio": medians["nvme"] / medians["cpu"],
        "state_bytes_per_step": moved["written"], "write_MBps": write_bw / 1e6, "read_MBps": read_bw / 1e6,
        "io_ms": 1000 * io_seconds,
        "against_target": medians["nvme"] / max(medians["cpu"], io_seconds),
    }


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def one_rss(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29532"})
    data = TextBatches(load_corpus(), PRESETS[args.model].context)
    torch.manual_seed(0)
    model = GPT(PRESETS[args.model])
    params = sum(p.numel() for p in model.parameters())
    before = _status("VmRSS")
    settings = config(args.device, args.nvme_path, args.micro, args.layout, args.buffer_count)
    engine = zero_engine.initialize(model, settings)
    built = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:  # the high-water mark starts again from here
        clear.write("5")
    for step in range(3):
        engine.backward(engine(*data.rank_batch(step, 0, 0, 1, args.micro, 1)))
        engine.step()
    high = _status("VmHWM")
    largest = max(unit.optimizer_shard.owned_range[1] - unit.optimizer_shard.owned_range[0] for unit in engine.units)
    engine.close()
    return {"model": args.model, "layout": args.layout, "device": args.device, "buffer_count": args.buffer_count,
            "params": params,
            "state_bytes": params * 12,
            "largest_shard_state": largest * 12, "after_initialize_above_start": built - before,
            "steps_high_water_above_initialize": high - built}


def rss(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for model in args.models:
        for device in ("cpu", "nvme"):
            out = subprocess.run(
                [sys.executable, __file__, "--one-rss", "--model", model, "--device", device,
                 "--nvme-path", args.nvme_path, "--micro", str(args.micro), "--layout", args.layout,
                 "--buffer-count", str(args.buffer_count)],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
    return rows


def fit(args: argparse.Namespace) -> dict[str, Any]:
    """A GPT of ``--dim`` x ``--layers``, built on the meta device, trained with everything on
    ``--device`` (see the module's docstring)."""
    from dataclasses import replace

    from gpt import init_weights

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})
    torch.manual_seed(0)  # the meta-device initialization's base seed is drawn from it: runs comparable
    shape = replace(PRESETS["tiny"], dim=args.dim, num_layers=args.layers, num_heads=args.dim // 64,
                    context=args.context)
    data = TextBatches(load_corpus(), shape.context)
    with torch.device("meta"):
        model = GPT(shape)
    params = sum(p.numel() for p in model.parameters())
    row: dict[str, Any] = {"device": args.device, "params": params, "dim": args.dim, "layers": args.layers}
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    started = time.perf_counter()
    try:
        engine = zero_engine.initialize(
            model, config(args.device, args.nvme_path, args.micro, "stage3", args.buffer_count),
            param_init_fn=init_weights,
        )
    except MemoryError as refused:
        return {**row, "refused": str(refused)}
    row["initialize_s"] = time.perf_counter() - started
    times, losses = [], []
    for step in range(args.steps):
        began = time.perf_counter()
        loss = engine(*data.rank_batch(step, 0, 0, 1, args.micro, 1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - began)
        losses.append(round(loss.item(), 4))
    for swap in engine.held:
        swap.drain()
    row.update(
        step_s=statistics.median(times), losses=losses, nvme_report=engine.comm_report().get("nvme"),
        memory_report={key: value for key, value in engine.memory_report().items() if value},
        high_water_above_start_GiB=(_status("VmHWM") - before) / 2**30,
    )
    engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--models", nargs="+", default=["small", "medium", "large"])
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count of the NVMe engine")
    parser.add_argument("--rss", action="store_true")
    parser.add_argument("--one-rss", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="nvme", choices=("cpu", "nvme"))
    parser.add_argument("--layout", default="stage1", choices=("stage1", "stage3"))
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    if args.fit:
        print(json.dumps(fit(args), indent=1))
    elif args.one_rss:
        print(json.dumps(one_rss(args)))
    elif args.rss:
        for row in rss(args):
            print(json.dumps(row))
    else:
        print(json.dumps(speed(args), indent=1))


if __name__ == "__main__":
    main()
