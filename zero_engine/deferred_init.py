"""Models built on the meta device, given storage and initial values where the engine keeps them.

A model built under ``torch.device("meta")`` has shapes and no storage, so it can be described
on every rank however big it is. `initialize` materializes its tensors on the device only when
the engine needs them: at stage 3 unit by unit, a unit's parameters written straight into its
flat buffer and kept as this rank's shard (see `FlatUnit`); at stages 0-2, which keep whole
parameters on every rank anyway, the whole model before the units are made. Each module is
initialized by ``param_init_fn(module)`` when given, else by its own ``reset_parameters()``.

Determinism: a module at path ``P`` draws its random numbers from ``module_seed(base, P)``,
``base`` drawn once from rank 0's default generator at `initialize` (without advancing it) and
shared with every rank. The values therefore depend neither on the stage, the world size, how
units are cut, nor on the order modules are materialized in.

Ownership: a tensor registered in several modules (tied weights) belongs to the first one in
``named_modules()`` order, which alone allocates and initializes it. While another module that
registers it is initialized, its slot holds a scratch tensor of the same shape, thrown away
after: that module draws the same random numbers as it would alone, and cannot overwrite the
owner's values (as ``self.head.weight = self.embed.weight`` after construction means when
built eagerly).

Tensors a weights file provides get storage but no init; a module whose own tensors all come
from the file is not initialized at all (Hugging Face's ``Conv1D`` has no
``reset_parameters``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def module_seed(base: int, path: str) -> int:
    """The seed the module at ``path`` initializes under (63 bits, from ``base`` and ``path``)."""
    digest = hashlib.sha256(f"{base}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draw_base_seed() -> int:
    """A base seed from the default generator's state, leaving that state as it was."""
    with torch.random.fork_rng(devices=[]):
        return int(torch.randint(0, 2**62, (1,)).item())


def materialization_device(model: nn.Module) -> torch.device:
    """Where meta tensors get storage: beside the model's real tensors if it has any, else
    this rank's GPU when there is one (torchrun's ``LOCAL_RANK``), else the CPU."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return _local_cuda_device() or torch.device("cpu")


def _local_cuda_device() -> torch.device | None:
    """CUDA only: torchrun's one GPU per local rank."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class _Slot:
    """One registered tensor: ``module._parameters[key]`` or ``module._buffers[key]``."""

    def __init__(self, table: dict[str, Any], key: str, tensor: torch.Tensor) -> None:
        self.table, self.key, self.tensor = table, key, tensor


def _slots(module: nn.Module) -> list[_Slot]:
    tables = (module._parameters, module._buffers)
    return [_Slot(table, key, tensor) for table in tables for key, tensor in table.items() if tensor is not None]


class DeferredInit:
    """Materializes and initializes a meta-device model's modules, each once, on request."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        base_seed: int,
        param_init_fn: InitFn | None = None,
        provided: set[int] | None = None,
    ) -> None:
        self.device = device
        self.base_seed = base_seed
        self.init_fn = param_init_fn
        self.provided = provided or set()  # ids of tensors a weights file supplies
        self._modules: list[tuple[str, nn.Module]] = list(model.named_modules())
        self._owner: dict[int, nn.Module] = {}
        for _, module in self._modules:
            for slot in _slots(module):
                self._owner.setdefault(id(slot.tensor), module)
        self._deferred = {id(t) for t in [*model.parameters(), *model.buffers()] if t.is_meta}
        self._done: set[int] = set()
        self.check()

    def _own(self, module: nn.Module) -> list[_Slot]:
        """The module's deferred tensors that it owns (first registration)."""
        return [s for s in _slots(module) if id(s.tensor) in self._deferred and self._owner[id(s.tensor)] is module]

    def _needs_init(self, module: nn.Module) -> list[_Slot]:
        return [s for s in self._own(module) if id(s.tensor) not in self.provided]

    def check(self) -> None:
        """Every module with tensors to initialize has a way to: fail now, naming them all."""
        if self.init_fn is not None:
            return
        lacking = [
            f"{path or '<root>'} ({type(module).__name__}: {', '.join(s.key for s in self._needs_init(module))})"
            for path, module in self._modules
            if self._needs_init(module) and not callable(getattr(module, "reset_parameters", None))
        ]
        if lacking:
            raise ValueError(
                "modules with tensors on the meta device and no reset_parameters(): "
                + "; ".join(lacking)
                + ". Pass param_init_fn= to initialize them, or weights= that provide them"
            )

    def materialize_owners(self, params: Iterable[torch.Tensor]) -> None:
        """Materialize the modules that own ``params`` (a unit about to take their values)."""
        self.materialize(self._owner[id(p)] for p in params if id(p) in self._owner)

    def materialize_all(self) -> None:
        self.materialize(module for _, module in self._modules)

    def materialize(self, modules: Iterable[nn.Module]) -> None:
        path = {id(module): name for name, module in self._modules}
        with torch.random.fork_rng(devices=_cuda_rng_devices(self.device)):
            for module in modules:
                if id(module) not in self._done:
                    self._done.add(id(module))
                    self._materialize_one(module, path[id(module)])

    def _materialize_one(self, module: nn.Module, path: str) -> None:
        own = self._own(module)
        for slot in own:
            if slot.tensor.is_meta:  # else a unit already made it a view of its buffer
                _give_storage(slot.tensor, self.device)
        if not self._needs_init(module):
            return
        foreign = [s for s in _slots(module) if self._owner[id(s.tensor)] is not module]
        for slot in foreign:  # a tied tensor: its owner's init sets it, not this module's
            slot.table[slot.key] = _scratch_like(slot.tensor, self.device)
        try:
            torch.manual_seed(module_seed(self.base_seed, path))
            with torch.no_grad():
                (self.init_fn or _reset_parameters)(module)
        finally:
            for slot in foreign:
                slot.table[slot.key] = slot.tensor


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _give_storage(tensor: torch.Tensor, device: torch.device) -> None:
    """Uninitialized storage for a meta tensor, keeping the tensor object (optimizer groups,
    tied modules and user code hold it)."""
    empty = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):
        empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, empty)


def _scratch_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    scratch = torch.empty_like(tensor, device=device)
    return nn.Parameter(scratch, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else scratch


def _cuda_rng_devices(device: torch.device) -> list[int]:
    """CUDA only: the generator that init on ``device`` draws from, restored afterwards."""
    return [device.index or 0] if device.type == "cuda" else []
