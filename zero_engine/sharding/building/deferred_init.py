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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ...devices import local_cuda_device

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
    return local_cuda_device() if torch.cuda.is_available() else torch.device("cpu")


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
        self._path = {id(module): path for path, module in self._modules}
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

    def _needs_init(self, own: list[_Slot]) -> list[_Slot]:
        """Those of a module's own deferred tensors that no weights file provides."""
        return [s for s in own if id(s.tensor) not in self.provided]

    def check(self) -> None:
        """Every module with tensors to initialize has a way to: fail now, naming them all."""
        if self.init_fn is not None:
            return
        lacking = []
        for path, module in self._modules:
            needs = self._needs_init(self._own(module))
            if needs and not callable(getattr(module, "reset_parameters", None)):
                lacking.append(f"{path or '<root>'} ({type(module).__name__}: {', '.join(s.key for s in needs)})")
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
        with torch.random.fork_rng(devices=_cuda_rng_devices(self.device)):
            for module in modules:
                if id(module) not in self._done:
                    self._done.add(id(module))
                    self._materialize_one(module, self._path[id(module)])

    def _materialize_one(self, module: nn.Module, path: str) -> None:
        own = self._own(module)
        for slot in own:
            if slot.tensor.is_meta:  # else a unit already made it an alias of its buffer
                torch.utils.swap_tensors(slot.tensor, _empty_like(slot.tensor, self.device))
        if not self._needs_init(own):
            return
        foreign = [s for s in _slots(module) if self._owner[id(s.tensor)] is not module]
        for slot in foreign:  # a tied tensor: its owner's init sets it, not this module's
            slot.table[slot.key] = _empty_like(slot.tensor, self.device)
        try:
            torch.manual_seed(module_seed(self.base_seed, path))
            with torch.no_grad():
                (self.init_fn or _reset_parameters)(module)
        finally:
            for slot in foreign:
                slot.table[slot.key] = slot.tensor


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialized storage on ``device`` shaped as ``tensor``, a Parameter if it is one: a
    meta tensor's storage (swapped in, keeping the tensor object that optimizer groups, tied
    modules and user code hold), or a tied slot's scratch stand-in."""
    empty = torch.empty_like(tensor, device=device)
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _cuda_rng_devices(device: torch.device) -> list[int]:
    """CUDA only: the generator that init on ``device`` draws from, restored afterwards."""
    return [device.index or 0] if device.type == "cuda" else []
