"""Where tensors live and what they weigh: the host device, a tensor's bytes, this rank's GPU.

A leaf module: every layer asks these without importing the collectives (`zero_engine.comm`).
"""

from __future__ import annotations

import os

import torch

HOST = torch.device("cpu")  # host tensors name it, so a default device set by the user cannot move them


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what a collective moves, what a buffer holds)."""
    return tensor.numel() * tensor.element_size()


def saved_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy to save: on a GPU, no second copy of the state on the device; a copy of a view
    (``torch.save`` would write the whole storage behind it)."""
    return tensor.detach().to("cpu", copy=True)


def host_values(tensor: torch.Tensor) -> list:
    """``tensor``'s values as Python numbers. On a GPU the host waits here for the device (the
    step's one host sync), so it is one named function: the NCCL model of
    `zero_engine.testing.nccl_model` records it."""
    return tensor.tolist()


def local_cuda_device() -> torch.device:
    """CUDA only: this rank's GPU, one per local rank as torchrun numbers them (``LOCAL_RANK``,
    0 without torchrun), among the GPUs this process sees: where each process sees only its own
    (SLURM ``--gpus-per-task``, ``CUDA_VISIBLE_DEVICES`` set per process) that is ``cuda:0``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    return torch.device("cuda", local_rank % visible if visible else local_rank)


def free_cuda_bytes(device: torch.device) -> int:
    """CUDA only: the device's free memory, as the driver reports it."""
    free, _total = torch.cuda.mem_get_info(device)
    return free
