"""CPU runs that catch GPU device mistakes: mixing host and device tensors, and host syncs.

On a GPU, ``torch.cat([cpu_mask, cuda_norm])`` raises and ``cuda_tensor.item()`` stalls the
host; on a CPU-only machine both are silent, since everything is on the CPU. `DeviceGuard`
makes a CPU run behave like a GPU one in these two respects. It splits tensors into *device*
tensors and *host* tensors:

- device: the tensors of the model given to `adopt` (before `initialize`); anything made on,
  or moved to, ``GUARDED_DEVICE`` (``cpu:0``, a CPU device the guard can tell from plain
  ``cpu``); anything computed from a device tensor. A device tensor reports ``cpu:0`` as its
  ``.device``, so ``torch.empty(..., device=param.device)`` stays on the "device" as it would
  on a GPU, and the engine adopts ``cpu:0`` as its device.
- host: everything else (``torch.zeros(n)``, ``.cpu()``, ``.to("cpu")``, loaded files).

It raises `DeviceMistake` for an operation mixing device tensors with host tensors that have
dimensions (a 0-dim host tensor is a scalar, which CUDA accepts), except explicit copies and
index tensors, and records every host sync on a device tensor (``item()``, ``bool()``,
``tolist()``, copies to the host, data-dependent shapes) in `syncs`, with the line that made it.

Tags live on storages, so views and ``param.data = view`` share them; a storage's tag is set
when an operation first returns it. The guard costs a Python call per operation: tests only.

Two more things a GPU would show, for offload:

- memory: `device_bytes` is what the live device storages hold now, and `peak_device_bytes`
  the most they held at once since `reset_peak` (taken after every operation), both counted
  from the storages that exist, not from anyone's accounting;
- asynchronous copies: a ``non_blocking`` copy from the device to the host is not a sync,
  but until `zero_engine.offload.wait_for_host_copies` runs (recorded as a sync) the host
  must not touch its destination: any host operation on it raises `DeviceMistake`.
"""

from __future__ import annotations

import traceback
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .. import offload

GUARDED_DEVICE = torch.device("cpu", 0)

aten = torch.ops.aten
# Copies between host and device are how data legitimately crosses.
_TRANSFERS = frozenset({aten.copy_.default, aten._to_copy.default})
# Indexing a CUDA tensor with CPU index tensors is allowed (torch moves them).
_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
# Operations whose result the host must wait for: a value read back or a data-dependent shape.
_SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten.equal.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
    }
)
# Operations that read no element (allowed on a host tensor an asynchronous copy is writing).
_METADATA = frozenset({aten.is_pinned.default})
_DEVICE_GETTER = torch._C.TensorBase.device
_READ_BACKS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})
_HOST_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cpu})


class DeviceMistake(RuntimeError):
    """An operation mixed device tensors with host tensors (it would fail on a GPU)."""


class HostSync(NamedTuple):
    what: str  # the operation, e.g. "aten._local_scalar_dense.default" (item/bool) or "Tensor.tolist"
    where: str  # the first caller outside torch: file:line function


class DeviceGuard:
    """Context manager: ``with DeviceGuard() as guard: guard.adopt(model); ...``."""

    def __init__(self) -> None:
        self._device_storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._copying_to_host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages an async copy writes
        self.syncs: list[HostSync] = []
        self._peak: int | None = None  # tracked after `reset_peak`
        self._function_mode = _FunctionMode(self)
        self._dispatch_mode = _DispatchMode(self)
        self._real_wait = offload.wait_for_host_copies
        self._moving = 0  # inside a tensor method's move (`_FunctionMode._move_device_tensor`)

    def adopt(self, *owners: nn.Module | torch.Tensor) -> None:
        """The tensors of these modules (or these tensors) stand for tensors on the GPU."""
        for owner in owners:
            tensors = [*owner.parameters(), *owner.buffers()] if isinstance(owner, nn.Module) else [owner]
            for tensor in tensors:
                self._tag(tensor, True)

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self._device_storages.get(tensor.untyped_storage(), False)

    def take_syncs(self) -> list[HostSync]:
        """The host syncs recorded since the last call."""
        syncs, self.syncs = self.syncs, []
        return syncs

    def device_bytes(self) -> int:
        """Bytes held now by the storages of live device tensors (a freed, ``resize_(0)``
        storage holds none)."""
        return sum(self.device_storage_sizes())

    def device_storage_sizes(self) -> list[int]:
        """The bytes of each live device storage that holds any (to say what `device_bytes` counted)."""
        return [storage.nbytes() for storage, on_device in self._device_storages.items() if on_device and storage.nbytes()]

    def reset_peak(self) -> None:
        """Start tracking `peak_device_bytes` from what the device holds now."""
        self._peak = self.device_bytes()

    @property
    def peak_device_bytes(self) -> int:
        if self._peak is None:
            raise RuntimeError("DeviceGuard.reset_peak() first")
        return max(self._peak, self.device_bytes())

    def _after_operation(self) -> None:
        if self._peak is not None:
            self._peak = max(self._peak, self.device_bytes())

    def __enter__(self) -> DeviceGuard:
        self._function_mode.__enter__()
        self._dispatch_mode.__enter__()
        offload.wait_for_host_copies = self._wait_for_host_copies
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        offload.wait_for_host_copies = self._real_wait
        self._dispatch_mode.__exit__(kind, error, tb)
        self._function_mode.__exit__(kind, error, tb)

    def _wait_for_host_copies(self, device: torch.device) -> None:
        self._record_sync("wait_for_host_copies")
        self._copying_to_host = WeakIdKeyDictionary()
        self._real_wait(device)

    def _check_not_copying(self, func: Any, inputs: list[torch.Tensor]) -> None:
        """A host operation on the destination of an asynchronous copy still in flight."""
        for tensor in inputs:
            if tensor.untyped_storage() in self._copying_to_host:
                raise DeviceMistake(
                    f"{func} uses a host tensor {tuple(tensor.shape)} {tensor.dtype} that an asynchronous copy from "
                    f"the device may still be writing (wait_for_host_copies first). At {_caller()}"
                )

    def _tag(self, tensor: torch.Tensor, on_device: bool) -> None:
        self._device_storages[tensor.untyped_storage()] = on_device

    def _record_sync(self, what: str) -> None:
        self.syncs.append(HostSync(what, _caller()))


class _FunctionMode(TorchFunctionMode):
    """Python-level tensor methods: the device a tensor reports, moves to the host that torch
    skips as no-ops on the CPU, and read-backs that never reach the dispatcher."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER:
            return GUARDED_DEVICE if self.guard.on_device(args[0]) else torch.device("cpu")
        if func in _READ_BACKS and self.guard.on_device(args[0]):
            self.guard._record_sync(f"Tensor.{func.__name__}")
        if func in _HOST_MOVES and self.guard.on_device(args[0]):
            return self._move_device_tensor(func, args, kwargs)
        return func(*args, **kwargs)

    def _move_device_tensor(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor = args[0]
        if func is torch.Tensor.cpu:
            device, dtype = torch.device("cpu"), None
        else:
            options = {key: value for key, value in kwargs.items() if key != "copy"}
            device, dtype, *_ = torch._C._nn._parse_to(*args[1:], **options)
        if device is None or device == GUARDED_DEVICE:  # stays on the device: as on a GPU, no copy
            return func(*args, **kwargs) if dtype is not None else tensor
        self.guard._moving += 1
        try:
            moved = func(*args, **kwargs)  # a real copy is seen (and recorded) by the dispatch mode
        finally:
            self.guard._moving -= 1
        if moved is tensor or moved.untyped_storage() is tensor.untyped_storage():
            moved = tensor.clone()  # torch skipped it as a no-op on the CPU; on a GPU it copies
            self.guard._record_sync(f"Tensor.{func.__name__} to the host")
        self.guard._tag(moved, False)
        return moved


class _DispatchMode(TorchDispatchMode):
    """Every aten operation: refuse host/device mixing, record syncs, tag what it returns."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        on_device = [self.guard.on_device(tensor) for tensor in inputs]
        if self.guard._copying_to_host and func not in _METADATA and not (func in _TRANSFERS and any(on_device)):
            self.guard._check_not_copying(func, inputs)
        if any(on_device):
            self._check(func, args, kwargs, inputs, on_device)
        out = func(*args, **kwargs)
        self._tag_outputs(func, kwargs, inputs, any(on_device), out)
        self.guard._after_operation()
        return out

    def _check(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor], on_device: list[bool]) -> None:
        if func in _SYNC_OPS:
            self.guard._record_sync(str(func))
        if func in _TRANSFERS:
            if func is aten.copy_.default and on_device[1] and not on_device[0]:
                if args[2] if len(args) > 2 else kwargs.get("non_blocking", False):
                    self.guard._copying_to_host[args[0].untyped_storage()] = True  # async: not a sync
                else:
                    self.guard._record_sync("copy_ to the host")
            return
        indices = [] if func not in _INDEXING else [leaf for leaf in tree_leaves(args[1:]) if torch.is_tensor(leaf)]
        host = [
            tensor
            for tensor, device in zip(inputs, on_device)
            if not device and tensor.dim() > 0 and not any(tensor is index for index in indices)
        ]
        if host:
            described = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in host)
            raise DeviceMistake(
                f"{func} mixes device tensors with host tensors ({described}); on a GPU this raises. At {_caller()}"
            )

    def _tag_outputs(self, func: Any, kwargs: dict, inputs: list[torch.Tensor], from_device: bool, out: Any) -> None:
        device = kwargs.get("device")
        if device is not None:
            on_device = torch.device(device) == GUARDED_DEVICE
            if func is aten._to_copy.default and from_device and not on_device:
                if self.guard._moving:  # a tensor method's move to the host (`_FunctionMode`)
                    self.guard._record_sync("copy to the host")
                else:  # autograd's cast of a gradient back to its tensor's options (bf16 under .float())
                    on_device = True  # names the real device, plain cpu: on a GPU it stays there
        else:
            on_device = from_device
        input_storages = [tensor.untyped_storage() for tensor in inputs]
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if not any(storage is seen for seen in input_storages):  # a new storage, not a view
                    self.guard._device_storages[storage] = on_device


def _caller() -> str:
    """The innermost frame outside torch and this module, for messages."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"
