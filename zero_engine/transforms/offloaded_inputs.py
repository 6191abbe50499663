"""Recomputed units' inputs kept in host memory (``recompute_offload``; DeepSpeed's
``activation_checkpointing.cpu_checkpointing``, Hugging Face's ``{"offload": True}``).

Under ``recompute_units`` a unit keeps, between its forward and its backward, only what torch's
checkpoint saves to recompute it: its tensor inputs (a decoder layer's hidden states, ``c h``
bytes a token). At long sequences and many layers that is still the largest thing the device
holds through a step. Here the checkpoint call runs under saved-tensor hooks that move those
inputs to host memory (pinned) as they are saved, and bring each back when its recomputation
unpacks it; the next unit's (the one before it in forward order, recomputed next) is brought
back at once behind it, so its copy runs while this unit recomputes. Values are the same to the
bit: a copy there and back.

On CUDA both copies run on a side stream of the device: the copy to the host after the work
that made the input (the input's memory is not reused until it is done: ``record_stream``), the
copy back before the recomputation that reads it (the compute stream waits for its event). A
tensor already on the host (a CPU run) is kept as it is: there is nowhere else to put it. A
host buffer is let go once its tensor was brought back; a second backward through the same
graph (``retain_graph``) would find it gone and raises, saying so. Host buffers come from torch's
caching host allocator: its first step page-locks them (a device-wide sync each, once), later
steps reuse them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import offload
from ..devices import HOST


class _Kept:
    """One input in host memory (or being brought back)."""

    __slots__ = ("host", "shape", "device", "back", "ready")

    def __init__(self, host: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
        self.host: torch.Tensor | None = host
        self.shape, self.device = shape, device
        self.back: torch.Tensor | None = None  # on the device again, once brought back
        self.ready: Any = None  # CUDA: the event its copy back recorded


class OffloadedInputs:
    """Saved-tensor hooks for the recomputed units' checkpoints (`hooks`), and the inputs kept so
    far in the current forward, in forward order (the last is recomputed first)."""

    def __init__(self) -> None:
        self._kept: list[_Kept] = []

    def new_forward(self) -> None:
        """A training forward starts: what the last one kept is its graph's (reached through
        its saved tensors), no longer this list's."""
        self._kept = []

    @property
    def host_bytes(self) -> int:
        """The bytes this forward's kept inputs hold in host memory now."""
        return sum(kept.host.numel() * kept.host.element_size() for kept in self._kept if kept.host is not None)

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device == HOST:
            return tensor
        host = offload.host_empty(tensor.numel(), tensor.dtype, pin=True)
        _to_host(host, tensor)
        kept = _Kept(host, tensor.shape, tensor.device)
        self._kept.append(kept)
        return kept

    def _unpack(self, kept: Any) -> torch.Tensor:
        if torch.is_tensor(kept):
            return kept
        tensor = _bring_back(kept)
        place = next((i for i, other in enumerate(self._kept) if other is kept), None)
        if place:  # the unit recomputed next: its input on its way while this one recomputes
            _start_back(self._kept[place - 1])
        return tensor


def _to_host(host: torch.Tensor, tensor: torch.Tensor) -> None:
    """Start copying ``tensor`` into the host buffer ``host`` (flat)."""
    if tensor.device.type == "cuda":
        _to_host_on_side_stream(host, tensor)
    else:
        offload.copy_to_host(host, tensor.reshape(-1))


def _start_back(kept: _Kept) -> None:
    """Start bringing ``kept`` back to its device, if not started."""
    if kept.back is not None:
        return
    if kept.host is None:
        raise RuntimeError(
            "recompute_offload: a recomputed unit's input was brought back and let go already: a second backward "
            "through the same forward (retain_graph) is not supported with recompute_offload"
        )
    kept.back = torch.empty(kept.shape, dtype=kept.host.dtype, device=kept.device)
    if kept.device.type == "cuda":
        kept.ready = _to_device_on_side_stream(kept.back, kept.host)
    else:
        kept.back.view(-1).copy_(kept.host)  # the flat host buffer read by the copy alone
    kept.host = None


def _bring_back(kept: _Kept) -> torch.Tensor:
    """``kept`` on its device, its copy done for the current stream."""
    _start_back(kept)
    assert kept.back is not None
    if kept.ready is not None:
        _wait_on_current_stream(kept.back, kept.ready)
        kept.ready = None
    tensor, kept.back = kept.back, None
    return tensor


# -- CUDA only ---------------------------------------------------------------------------------

_SIDE_STREAMS: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _to_host_on_side_stream(host: torch.Tensor, tensor: torch.Tensor) -> None:
    side = _side_stream(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        host.copy_(tensor.reshape(-1), non_blocking=True)
    tensor.record_stream(side)  # its memory not reused before the copy read it


def _to_device_on_side_stream(back: torch.Tensor, host: torch.Tensor) -> Any:
    side = _side_stream(back.device)
    with torch.cuda.stream(side):
        back.view(-1).copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return event


def _wait_on_current_stream(tensor: torch.Tensor, event: Any) -> None:
    current = torch.cuda.current_stream(tensor.device)
    current.wait_event(event)
    tensor.record_stream(current)  # allocated for the side stream, used on this one
