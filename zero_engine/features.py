"""Switched-on features that the config validates but the engine does not build yet.

Each one fails at `initialize` with `NotImplementedError` naming its key, never silently
ignored. Settings that are off, or that mean "off" (``gradient_clipping: 0``), always pass.
"""

from __future__ import annotations

from typing import Any

from .config import ZeroEngineConfig

# The keys `unbuilt_features` refuses when they ask for more than plain ZeRO data parallelism.
REFUSED_WHEN_ON = (
    "zero_optimization.zero_hpz_partition_size",
    "tensor_parallel", "pipeline", "sparse_gradients",
    "sequence_parallel_size", "amp", "torch_autocast", "fp16.fp16_master_weights_and_grads",
    "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states",
    "zero_optimization.offload_optimizer.super_offload", "zero_optimization.zenflow", "managed_gradient_accumulation",
    "gradient_allreduce_op", "expert_parallel",
)


# Refused keys whose refusal is not "when on" (for the key table in docs/config.md).
REFUSED_WHEN = {
    "managed_gradient_accumulation": "refused when false", "gradient_allreduce_op": "refused when 'sum'",
    "zero_optimization.zenflow": "refused when given",
}

# Keys built in part: what of them is refused (for the key table in docs/config.md).
PARTLY_BUILT = {
    f"zero_optimization.{section}.{key}": status
    for section in ("offload_optimizer", "offload_param")
    for key, status in {
        "device": "honoured ('nvme' refused)", "ratio": "honoured at 1.0 (below: refused)",
        "nvme_path": "no effect ('nvme' refused)", "buffer_count": "no effect ('nvme' refused)",
        "fast_init": "no effect ('nvme' refused)",
    }.items()
}


def unbuilt_features(config: ZeroEngineConfig) -> list[str]:
    """Key paths of the switched-on features this version cannot run."""
    zero = config.zero_optimization
    found = []
    for key in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, key)
        if offload is None or offload.device == "none":
            continue
        if offload.device == "nvme":
            found.append(
                f"zero_optimization.{key}.device = 'nvme' (NVMe offload needs asynchronous file I/O, DeepSpeed's aio "
                "extension; use 'cpu')"
            )
        elif offload.ratio < 1.0:
            found.append(
                f"zero_optimization.{key}.ratio = {offload.ratio} (partial offload, DeepSpeed's ZeRO-Offload++ "
                "twin-flow; offloading all of it, ratio 1.0, is built)"
            )
        elif getattr(offload, "super_offload", False):
            found.append(f"zero_optimization.{key}.super_offload = true (DeepSpeed's SuperOffload)")
    if zero.zenflow is not None:
        found.append("zero_optimization.zenflow (DeepSpeed's ZenFlow: stale-gradient offloaded updates)")
    for section, key in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
                         ("bf16", "bf16_optimizer_states")):
        if getattr(getattr(config, section), key):
            found.append(f"{section}.{key} = true (masters, gradients and optimizer state are fp32 here)")
    if not config.managed_gradient_accumulation:
        found.append(
            "managed_gradient_accumulation = false (every step() a boundary; engine.set_gradient_accumulation_boundary "
            "says where a window ends)"
        )
    if config.gradient_allreduce_op != "mean":
        found.append(
            f"gradient_allreduce_op = {config.gradient_allreduce_op!r} (gradients are averaged over the ranks)"
        )
    if (config.expert_parallel or {}).get("enabled"):
        found.append("expert_parallel.enabled = true (expert parallelism; experts are sharded as any module)")
    if zero.zero_hpz_partition_size > 1:
        found.append(
            f"zero_optimization.zero_hpz_partition_size = {zero.zero_hpz_partition_size} (ZeRO++ hierarchical "
            "partitioning; zero_optimization.shard_group_size shards parameters within each node instead)"
        )
    if config.sparse_gradients:
        found.append("sparse_gradients = true (sparse embedding gradients; gradients are dense flat buffers here)")
    if config.sequence_parallel_size > 1:
        found.append(f"sequence_parallel_size = {config.sequence_parallel_size} (sequence parallelism)")
    for section in ("amp", "torch_autocast"):
        if (getattr(config, section) or {}).get("enabled"):
            found.append(f"{section}.enabled = true (use bf16 or fp16 instead)")
    pipeline = (config.pipeline or {}).get("pipeline_parallel_size", 1)
    if isinstance(pipeline, int) and pipeline > 1:
        found.append(f"pipeline.pipeline_parallel_size = {pipeline} (pipeline parallelism)")
    for key, size in _tensor_parallel_sizes(config.tensor_parallel or {}):
        if size > 1:
            found.append(f"tensor_parallel.{key} = {size} (tensor parallelism; data parallelism with ZeRO is built)")
    return found


def _tensor_parallel_sizes(section: dict[str, Any]) -> list[tuple[str, Any]]:
    """DeepSpeed's spellings of the tensor-parallel size (``autotp_size``, ``tp_size``, ``tp.tp_size``)."""
    sizes = [(key, section[key]) for key in ("autotp_size", "tp_size") if isinstance(section.get(key), int)]
    nested = section.get("tp")
    if isinstance(nested, dict) and isinstance(nested.get("tp_size"), int):
        sizes.append(("tp.tp_size", nested["tp_size"]))
    return sizes


def refuse_unbuilt_features(config: ZeroEngineConfig) -> None:
    found = unbuilt_features(config)
    if found:
        raise NotImplementedError("not built yet: " + "; ".join(found) + ". Switch them off in the config.")
