"""The NVMe offload configs the NVMe tests and the GPU tests share: the optimizer side on a device
('cpu' or 'nvme'), and stage 3's parameter shards too."""

from __future__ import annotations

from typing import Any

from muon_cases import MICRO


def config(stage: int, device: str, directory: str, *, dtype: str = "fp32", accum: int = 2,
           offload_param: bool = False, optimizer: str = "AdamW", shard_group_size: int = 0) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": device, "nvme_path": directory}}
    if shard_group_size:  # hybrid: a window's gradient carried across groups once (read back from NVMe)
        zero["shard_group_size"] = shard_group_size
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    params = {"lr": 1e-3, "weight_decay": 0.01} if optimizer == "AdamW" else {"lr": 0.02, "adam_lr": 1e-3}
    result = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum, "gradient_clipping": 0.5,
        "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero,
    }
    if dtype == "bf16":
        result["bf16"] = {"enabled": True}
    return result


def param_config(stage_config: dict[str, Any], params: str, optimizer: str, directory: str) -> dict[str, Any]:
    """``stage_config`` (a stage 3 config, every parameter sharded) with the parameter shards on
    ``params`` and the optimizer side on ``optimizer`` (each 'cpu' or 'nvme')."""
    zero = {**stage_config["zero_optimization"], "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": params, "nvme_path": directory}}
    if "offload_optimizer" in zero or stage_config.get("optimizer"):
        zero["offload_optimizer"] = {"device": optimizer, "nvme_path": directory}
    return {**stage_config, "zero_optimization": zero}
